"""The tbjax.v1 wire API for Python code: message classes, the service and method names, (de)serializers.

Server and client use this instead of the generated ``tbjax_v1_pb2_grpc`` module: that module refuses to
import under a grpcio older than the grpcio-tools that generated it (1.85.1), while the messages
(``tbjax_v1_pb2``) only need protobuf. So the serving code runs on hosts with an older grpcio (the H200
has 1.84.0). ``tbjax_v1_pb2_grpc`` stays committed for other users of the proto.
"""
from __future__ import annotations

from google.protobuf.message import DecodeError

from .proto import tbjax_v1_pb2 as pb

__all__ = ["pb", "SERVICE_NAME", "API_VERSION", "METHODS", "Undecodable", "lenient_deserializer",
           "FINISH_REASONS", "finish_reason_name"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tbjax"].full_name  # "tbjax.v1.Tbjax"
API_VERSION = pb.DESCRIPTOR.package                                # "tbjax.v1"

# method name -> (request class, response class, server-streaming?)
METHODS = {
    "Generate": (pb.GenerateRequest, pb.GenerateResponse, True),
    "Tokenize": (pb.TokenizeRequest, pb.TokenizeResponse, False),
    "ModelInfo": (pb.ModelInfoRequest, pb.ModelInfoResponse, False),
}


def method_path(name: str) -> str:
    return f"/{SERVICE_NAME}/{name}"


class Undecodable:
    """Stands in for a request whose bytes did not parse (e.g. invalid UTF-8 in a string field), so the
    handler can answer INVALID_ARGUMENT with the reason instead of gRPC's generic INTERNAL."""

    __slots__ = ("type_name", "reason")

    def __init__(self, type_name: str, reason: str):
        self.type_name = type_name
        self.reason = reason


def lenient_deserializer(cls):
    def deserialize(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return Undecodable(cls.DESCRIPTOR.full_name, str(e))
    return deserialize


FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


def finish_reason_name(value: int) -> str | None:
    """``pb.FINISH_REASON_STOP`` -> "stop"; UNSPECIFIED -> None."""
    for k, v in FINISH_REASONS.items():
        if v == value:
            return k
    return None
