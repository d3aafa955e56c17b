"""The committed generated code matches serving/proto/tbjax_v1.proto (regenerated with scripts/gen_proto.sh
into a temp dir and compared byte for byte), and it imports under the pinned runtime versions."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERATED = tuple(f"{m}{suffix}" for m in ("tbjax_v1", "tbjax_kv_v1")
                  for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


def test_generated_code_in_sync(tmp_path):
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gen_proto.sh"), str(tmp_path)],
                       env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in GENERATED:
        fresh = (tmp_path / "serving" / "proto" / name).read_bytes()
        with open(os.path.join(ROOT, "serving", "proto", name), "rb") as f:
            committed = f.read()
        assert fresh == committed, f"serving/proto/{name} is stale: run scripts/gen_proto.sh and commit"


def test_generated_modules_import_and_describe_the_api():
    from serving.proto import tbjax_v1_pb2 as pb
    from serving.proto import tbjax_v1_pb2_grpc as pbg   # needs grpcio >= 1.85.1 (pinned in pyproject)

    svc = pb.DESCRIPTOR.services_by_name["Tbjax"]
    assert pb.DESCRIPTOR.package == "tbjax.v1"
    assert {m.name for m in svc.methods} == {"Generate", "Tokenize", "ModelInfo"}
    assert svc.methods_by_name["Generate"].server_streaming
    assert hasattr(pbg, "TbjaxStub") and hasattr(pbg, "add_TbjaxServicer_to_server")
    # optional fields keep "unset" apart from 0 (so top_p=0 is an error, not "default")
    sp = pb.SamplingParams()
    assert not sp.HasField("top_p")
    sp.top_p = 0.0
    assert sp.HasField("top_p")


def test_gen_script_refuses_other_tools_version(tmp_path):
    fake_py = tmp_path / "py"
    fake_py.write_text("#!/bin/sh\necho 0.0.1\n")
    fake_py.chmod(0o755)
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gen_proto.sh"), str(tmp_path / "out")],
                       env=dict(os.environ, PYTHON=str(fake_py)), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "grpcio-tools 0.0.1 found, 1.85.1 required" in r.stderr
