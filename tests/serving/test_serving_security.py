"""Security switches (issue 18): TLS for gRPC and the HTTP API (a self-signed certificate made here with the openssl
CLI, or the cryptography package when installed), a bearer token (``api_key``: UNAUTHENTICATED / 401 without it,
health checks open), reflection off; against the fake engine."""
import json
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from serving.api import method_path, pb
from serving.client import Client
from serving.fake_engine import fake_served_model, reference
from serving.server import ServerThread

KEY = "s3cret-token"


def _self_signed(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    try:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is available")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                       check=True, capture_output=True)
        return str(cert), str(key)
    import ipaddress
    k = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    c = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
         .not_valid_after(now + datetime.timedelta(days=2))
         .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
         .sign(k, hashes.SHA256()))
    cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return str(cert), str(key)


def _http(url, body=None, key=None, ctx=None):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _generate(channel, key=None, **kw):
    rpc = channel.unary_stream(method_path("Generate"), request_serializer=pb.GenerateRequest.SerializeToString,
                               response_deserializer=pb.GenerateResponse.FromString)
    md = [("authorization", f"Bearer {key}")] if key is not None else None
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6]), params=pb.SamplingParams(max_tokens=3))
    return [t for r in rpc(req, metadata=md, timeout=30) for t in r.token_ids]


def test_tls_and_api_key_grpc_and_http(tmp_path):
    cert, key = _self_signed(tmp_path)
    want = reference([5, 6], 3)[0]
    with ServerThread(fake_served_model(), metrics_port=None, http_port=0, tls_cert=cert, tls_key=key,
                      api_key=KEY) as st:
        with open(cert, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        with grpc.secure_channel(f"localhost:{st.port}", creds) as ch:
            for bad in (None, "wrong", KEY + "x"):
                with pytest.raises(grpc.RpcError) as e:
                    _generate(ch, bad)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
                assert KEY not in (e.value.details() or "")
            with pytest.raises(grpc.RpcError) as e:      # unary methods too
                Client(channel=ch).model_info()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:      # reflection needs the key as well
                ProtoReflectionDescriptorDatabase(ch).get_services()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _generate(ch, KEY) == want            # TLS + the right key
            health = health_pb2_grpc.HealthStub(ch)       # health checks stay open
            assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(st.address) as ch:     # plaintext to a TLS port fails
            with pytest.raises(grpc.RpcError) as e:
                _generate(ch, KEY)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        url = st.server.http_url
        assert url.startswith("https://")
        ctx = ssl.create_default_context(cafile=cert)
        body = {"prompt": [5, 6], "max_tokens": 3}
        for bad in (None, "wrong"):
            code, out = _http(url + "/v1/completions", body, key=bad, ctx=ctx)
            assert code == 401 and out["error"]["code"] == "invalid_api_key", (code, out)
            assert out["error"]["type"] == "invalid_request_error"
        code, out = _http(url + "/v1/models", key=None, ctx=ctx)
        assert code == 401
        code, out = _http(url + "/v1/completions", body, key=KEY, ctx=ctx)
        assert code == 200 and out["choices"][0]["text"], out
        code, out = _http(url + "/health", ctx=ctx)       # open
        assert code == 200
        with pytest.raises(urllib.error.URLError):        # the certificate is checked: an untrusting client fails
            urllib.request.urlopen(url + "/health", timeout=10, context=ssl.create_default_context())
        text = st.server.metrics.text()
        assert 'tbjax_requests_rejected_total{code="UNAUTHENTICATED",model_name="fake"}' in text
        assert 'tbjax_requests_rejected_total{code="HTTP_401",model_name="fake"}' in text


def test_api_key_without_tls_and_reflection_off():
    with ServerThread(fake_served_model(), metrics_port=None, api_key=KEY, reflection=False) as st, \
            grpc.insecure_channel(st.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            _generate(ch)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _generate(ch, KEY) == reference([5, 6], 3)[0]
        md = [("authorization", f"Bearer {KEY}")]
        rpc = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        with pytest.raises(grpc.RpcError) as e:         # no reflection service at all
            list(rpc(iter([b""]), metadata=md, timeout=10))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_reflection_on_by_default_and_no_key_needed_without_api_key():
    with ServerThread(fake_served_model(), metrics_port=None) as st, grpc.insecure_channel(st.address) as ch:
        assert "tbjax.v1.Tbjax" in set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert _generate(ch) == reference([5, 6], 3)[0]


def test_server_refuses_half_a_tls_config(tmp_path):
    with pytest.raises(ValueError, match="tls"):
        ServerThread(fake_served_model(), metrics_port=None, tls_cert=str(tmp_path / "c.pem"))
    with pytest.raises(ValueError, match="api_key"):
        ServerThread(fake_served_model(), metrics_port=None, api_key="")


def test_serve_cli_api_key_from_the_environment_and_no_reflection():
    import os
    import re
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TBJAX_API_KEY=KEY)
    p = subprocess.Popen([sys.executable, "-m", "tbjax.serve", "--fake-engine", "--port", "0", "--metrics-port", "-1",
                          "--http-port", "0", "--no-reflection"], cwd=root, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        m = re.search(r"on (\S+):(\d+) \(gRPC tbjax.v1\)", line)
        assert m, (line, p.stderr.read() if p.poll() is not None else "")
        assert m.group(1) == "127.0.0.1"                 # loopback stays the default
        with grpc.insecure_channel(f"127.0.0.1:{m.group(2)}") as ch:
            with pytest.raises(grpc.RpcError) as e:
                _generate(ch)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _generate(ch, KEY) == reference([5, 6], 3)[0]
            rpc = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
            with pytest.raises(grpc.RpcError) as e:
                list(rpc(iter([b""]), metadata=[("authorization", f"Bearer {KEY}")], timeout=10))
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        p.terminate()
        p.wait(30)


@pytest.mark.parametrize("args,msg", [(["--tls-cert", "x.pem"], "--tls-key"),
                                      (["--tls-cert", "/no/such.pem", "--tls-key", "/no/such.key"], "no such file"),
                                      (["--role", "decode", "--api-key", "k"], "--api-key")])
def test_serve_cli_rejects_bad_security_flags(args, msg):
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "tbjax.serve", "--fake-engine", *args], cwd=root, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
