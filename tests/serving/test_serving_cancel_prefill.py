"""A long prefill that is cancelled or whose deadline passes stops within one prefill chunk (issue 18, item 3), on a
real engine (tiny random model) behind the gRPC server: the steps the engine schedules are recorded, and after the
abort the request's chunks stop (at most the step already in flight and the one overlapped scheduling built beside
it), a small request sent at that moment starts at once, and every KV page comes back."""
import threading
import time

import grpc
import pytest

from engine_helpers import byte_tokenizer, reference_greedy, tiny_model
from serving.client import Client, build_generate_request
from serving.model import ServedModel
from serving.server import ServerThread
from serving.testing import kv_pages_all_free
from tbjax.engine import Engine, EngineConfig
from tbjax.sampling import SamplingParams

CHUNK = 16
LONG = 480           # 30 chunks
STEP_DELAY_S = 0.04  # every step takes at least this long, so the timeline does not depend on the box's speed


@pytest.fixture(scope="module")
def served():
    spec, params = tiny_model()
    tok = byte_tokenizer()
    eng = Engine(spec, params, tok, EngineConfig(num_pages=256, page_size=8, max_num_seqs=4,
                                                 max_num_batched_tokens=CHUNK, max_model_len=512))
    log = []                               # (time, frozenset of the seq ids computed in that step)
    lock = threading.Lock()
    schedule = eng.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        if batch is not None:
            with lock:
                log.append((time.monotonic(), frozenset(e.seq_id for e in batch)))
            time.sleep(STEP_DELAY_S)
        return batch

    eng.scheduler.schedule = recording_schedule
    model = ServedModel("tiny", spec.arch, tok, spec.vocab_size, 512, (), SamplingParams, eng)
    with ServerThread(model, metrics_port=None) as st, Client(st.address, timeout=120) as c:
        c.generate(token_ids=list(range(3, 3 + 2 * CHUNK)), max_tokens=2, temperature=0)   # compile both buckets
        yield st, c, eng, log, lock, (spec, params)


def _steps_with(log, lock, rid, after=0.0):
    with lock:
        return [t for t, ids in log if rid in ids and t >= after]


def _check_stopped(st, c, eng, log, lock, model, rid, t_abort):
    # the small request sent at the abort starts within a few steps, not after the rest of the long prefill
    spec, params = model
    t0 = time.monotonic()
    got = c.generate(token_ids=[9, 8, 7], max_tokens=3, temperature=0).token_ids
    ttft_steps = len([t for t, _ in log if t >= t0])
    assert got == reference_greedy(spec, params, [9, 8, 7], 3)
    after = _steps_with(log, lock, rid, after=t_abort)
    before = _steps_with(log, lock, rid)
    assert 1 <= len(before) - len(after) < LONG // CHUNK - 4, (len(before), len(after))   # it was mid-prefill
    assert len(after) <= 2, f"{len(after)} chunks of the aborted prefill ran after the abort"
    assert ttft_steps <= 6, f"the next request needed {ttft_steps} steps"
    assert st.server.engine_loop.call(kv_pages_all_free).result(timeout=30)["all_free"]


def test_long_prefill_past_its_deadline_stops_within_a_chunk(served):
    st, c, eng, log, lock, model = served
    with pytest.raises(grpc.RpcError) as e:
        c.generate(request_id="long-deadline", token_ids=[5 + i % 200 for i in range(LONG)], max_tokens=4,
                   temperature=0, timeout=12 * STEP_DELAY_S)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _check_stopped(st, c, eng, log, lock, model, "long-deadline", time.monotonic())


def test_long_prefill_cancelled_by_the_client_stops_within_a_chunk(served):
    st, c, eng, log, lock, model = served
    req = build_generate_request(request_id="long-cancel", token_ids=[6 + i % 200 for i in range(LONG)],
                                 max_tokens=4, temperature=0)
    call = c._rpc["Generate"](req, timeout=60)
    deadline = time.monotonic() + 60
    while len(_steps_with(log, lock, "long-cancel")) < 6 and time.monotonic() < deadline:
        time.sleep(0.005)
    call.cancel()
    t_abort = time.monotonic()
    _check_stopped(st, c, eng, log, lock, model, "long-cancel", t_abort)
