"""Bad requests over real gRPC: each gets its own status and a message naming the problem, and the server
keeps serving after each (a good request right after returns the right tokens). Runs against the fake
engine (fast); tests/serving/test_serving_e2e.py repeats the table against the real default model."""
import grpc
import pytest

from serving.client import Client
from serving.fake_engine import fake_served_model, reference
from serving.limits import Limits
from serving.server import ServerThread
from serving.testing import BAD_REQUESTS, raw_generate

MAX_MSG = 1 << 16


@pytest.fixture(scope="module")
def server():
    st = ServerThread(fake_served_model(step_time_s=0.0), limits=Limits(max_message_bytes=MAX_MSG),
                      metrics_port=None).start()
    with Client(st.address, timeout=30) as c:
        info = dict(c.model_info(), _max_message_bytes=MAX_MSG)
        yield st, c, info
    st.stop()


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[b.name for b in BAD_REQUESTS])
def test_bad_request_gets_clear_status_and_server_keeps_serving(server, case):
    st, c, info = server
    req = case.make(info)
    added = st.server.engine_loop.call(lambda e: e.num_added).result(10)
    with pytest.raises(grpc.RpcError) as e:
        if isinstance(req, bytes):
            raw_generate(c.channel, req)
        else:
            list(c.generate_call(req, timeout=30))
    assert e.value.code() == case.code, (e.value.code(), e.value.details())
    assert case.must_mention.lower() in (e.value.details() or "").lower(), e.value.details()
    assert st.server.engine_loop.call(lambda e: e.num_added).result(10) == added   # never reached the engine
    got = c.generate(token_ids=[70, 71], max_tokens=4, temperature=0)      # still serving, still right
    assert got.token_ids == reference([70, 71], 4)[0]


def test_deadline_already_past_then_serving(server):
    st, c, info = server
    with pytest.raises(grpc.RpcError) as e:
        c.generate("Hi", max_tokens=3, timeout=-1.0)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert c.generate(token_ids=[70], max_tokens=2, temperature=0).token_ids == reference([70], 2)[0]
