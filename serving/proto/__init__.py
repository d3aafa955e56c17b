"""Generated protobuf/gRPC code for the tbjax.v1 API (do not edit: regenerate with scripts/gen_proto.sh).

`tbjax_v1.proto` is the source of truth; `tbjax_v1_pb2*.py` are generated from it and committed.
"""
