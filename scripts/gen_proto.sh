#!/usr/bin/env bash
# Regenerates the Python gRPC code for serving/proto/*.proto (tbjax_v1: the public API; tbjax_kv_v1: KV transfer
# between workers).
#   scripts/gen_proto.sh            writes next to the .proto files (commit the result)
#   scripts/gen_proto.sh OUT_DIR    writes into OUT_DIR/serving/proto/ (used by tests/serving/test_grpc_proto.py)
# Pinned generator: grpcio-tools 1.85.1 (its protoc is libprotoc 35.1). Code it generates needs, at import,
# grpcio >= 1.85.1 and protobuf >= 7.35.1 (pyproject.toml pins both). Use the project venv's Python.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
OUT="${1:-$ROOT}"
WANT_TOOLS="1.85.1"
HAVE_TOOLS="$("$PY" -c 'from importlib.metadata import version; print(version("grpcio-tools"))')"
if [ "$HAVE_TOOLS" != "$WANT_TOOLS" ]; then
  echo "gen_proto.sh: grpcio-tools $HAVE_TOOLS found, $WANT_TOOLS required (pip install grpcio-tools==$WANT_TOOLS)" >&2
  exit 1
fi
mkdir -p "$OUT/serving/proto"
cd "$ROOT"
# -I . makes the generated grpc module import `serving.proto.tbjax_v1_pb2` (a package path, no sys.path tricks).
"$PY" -m grpc_tools.protoc -I . --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
  serving/proto/tbjax_v1.proto serving/proto/tbjax_kv_v1.proto
echo "generated into $OUT/serving/proto"
