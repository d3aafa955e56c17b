"""gRPC front end over real loopback gRPC, driven by the fake engine (serving.fake_engine: the real scheduler
and page allocator, a toy next-token hash whose output `reference` computes independently).

Covers: streaming equals the reference, concurrency does not change outputs, chat/tokenize/model info,
logprobs, stop token ids, request ids, backpressure (RESOURCE_EXHAUSTED), cancellation and deadlines
freeing KV pages, engine refusal and engine crash statuses, health, reflection, metrics, drain; the same
contract with the engine in a child process (serving.engine_proc); the uvloop event loop option.
"""
import random
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from serving.api import pb
from serving.client import Client
from serving.fake_engine import EOS, FakeEngine, fake_served_model, reference
from serving.limits import Limits
from serving.server import ServerThread
from serving.testing import kv_pages_all_free, metric_series, run_in_threads, wait_kv_pages_all_free


@pytest.fixture(scope="module")
def fast():
    st = ServerThread(fake_served_model(step_time_s=0.001, num_pages=1024), limits=Limits(max_message_bytes=1 << 16)).start()
    with Client(st.address, timeout=30) as c:
        yield st, c
    st.stop()


def _rand_prompt(rng, n=None):
    return [rng.randrange(3, 259) for _ in range(n or rng.randrange(1, 30))]


def test_stream_equals_reference_and_usage(fast):
    st, c = fast
    rng = random.Random(1)
    ids = _rand_prompt(rng, 12)
    chunks = list(c.generate_stream(token_ids=ids, max_tokens=17, temperature=0, ignore_eos=True))
    want, reason = reference(ids, 17, ignore_eos=True)
    assert [t for ch in chunks for t in ch.token_ids] == want
    assert len(chunks) >= 2                       # streamed (a stream that falls behind gets tokens merged)
    assert [ch.finish_reason for ch in chunks] == [None] * (len(chunks) - 1) + [reason] and reason == "length"
    assert (chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == (12, 17)
    assert "".join(ch.text for ch in chunks) == st.server.model.tokenizer.decode(want)


def test_busy_server_merges_waiting_tokens():
    """When the server's loop falls behind the engine (here: blocked for 0.3 s), the tokens waiting for a
    stream go out in one message, not one message per token (what keeps the Python front end from becoming
    the bottleneck under load)."""
    with ServerThread(fake_served_model(step_time_s=0.002), metrics_port=None) as st, \
            Client(st.address, timeout=30) as c:
        stream = c.generate_stream(token_ids=[30, 31], max_tokens=300, ignore_eos=True, temperature=0)
        chunks = [next(stream)]
        st.loop.call_soon_threadsafe(time.sleep, 0.3)      # the server's event loop stalls; the engine does not
        chunks += list(stream)
        want = reference([30, 31], 300, ignore_eos=True)[0]
        assert [t for ch in chunks for t in ch.token_ids] == want
        assert max(len(ch.token_ids) for ch in chunks) >= 20 and len(chunks) < 280
        assert "".join(ch.text for ch in chunks) == st.server.model.tokenizer.decode(want)
        assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 300


def test_text_prompt_and_seed_and_eos(fast):
    st, c = fast
    tok = st.server.model.tokenizer
    for seed in (0, 3, 11):
        got = c.generate("Once upon a time", max_tokens=200, seed=seed, temperature=0.7)
        want, reason = reference(tok.encode("Once upon a time"), 200, seed=seed)
        assert got.token_ids == want and got.finish_reason == reason
        if reason == "stop":
            assert want[-1] == EOS


def test_concurrent_streams_each_equal_reference(fast):
    st, c = fast
    rng = random.Random(2)
    jobs = [(_rand_prompt(rng), rng.randrange(1, 40)) for _ in range(24)]
    results = [None] * len(jobs)

    def run(i):
        ids, mt = jobs[i]
        results[i] = c.generate(token_ids=ids, max_tokens=mt, temperature=0)

    run_in_threads(run, len(jobs))
    for (ids, mt), got in zip(jobs, results):
        want, reason = reference(ids, mt)
        assert got.token_ids == want and got.finish_reason == reason
    wait_kv_pages_all_free(st)


def test_chat_and_tokenize_match_the_template(fast):
    st, c = fast
    tok = st.server.model.tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"}]
    want_ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
    assert c.tokenize(messages=msgs) == want_ids
    assert c.tokenize("héllo") == tok.encode("héllo")
    got = c.generate(messages=msgs, max_tokens=9, temperature=0)
    assert got.token_ids == reference(want_ids, 9)[0] and got.prompt_tokens == len(want_ids)
    with pytest.raises(grpc.RpcError) as e:
        c.tokenize("")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_model_info_and_health(fast):
    st, c = fast
    info = c.model_info()
    assert info["model"] == "fake" and info["vocab_size"] == 259 and info["max_context"] == 512
    assert info["max_prompt_tokens"] == 511 and info["role"] == "colocated" and info["api_version"] == "tbjax.v1"
    assert info["eos_token_ids"] == [EOS]
    assert c.health() == "SERVING" and c.health("tbjax.v1.Tbjax") == "SERVING"


def test_reflection_lists_services(fast):
    st, c = fast
    db = ProtoReflectionDescriptorDatabase(c.channel)
    services = set(db.get_services())
    assert {"tbjax.v1.Tbjax", "grpc.health.v1.Health"} <= services
    fd = db.FindFileContainingSymbol("tbjax.v1.Tbjax")
    assert fd.package == "tbjax.v1"


def test_logprobs_and_stop_token_ids(fast):
    st, c = fast
    ids = [40, 41, 42]
    want, _ = reference(ids, 30, ignore_eos=True)
    stop_at = next(i for i, t in enumerate(want) if i >= 3 and t not in want[:i])
    got = c.generate(token_ids=ids, max_tokens=30, temperature=0, ignore_eos=True,
                     stop_token_ids=[want[stop_at]], logprobs=3)
    assert got.token_ids == want[:stop_at + 1] and got.finish_reason == "stop"
    assert [lp[0] for lp in got.logprobs] == got.token_ids
    for tokid, lp, top in got.logprobs:        # the fake: sampled -0.5, then (t+k) % V at -1-k
        assert lp == -0.5 and [t for t, _ in top] == [tokid, (tokid + 1) % 259, (tokid + 2) % 259]


def test_request_id_echoed_and_duplicates_refused(fast):
    st, c = fast
    call = c.generate_call(pb.GenerateRequest(request_id="dup-1", prompt="Hi",
                                              params=pb.SamplingParams(max_tokens=400, ignore_eos=True)))
    first = next(call)
    assert first.request_id == "dup-1" and not first.finish_reason
    gate = threading.Event()
    held = st.server.engine_loop.call(lambda e: gate.wait(30))    # keep dup-1 in flight meanwhile
    try:
        with pytest.raises(grpc.RpcError) as e:
            c.generate("Hi", request_id="dup-1", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup-1" in e.value.details()
    finally:
        gate.set()
    held.result(30)
    aborted = _num_aborted(st)
    call.cancel()
    wait_kv_pages_all_free(st)
    assert _num_aborted(st) == aborted + 1
    assert c.generate("Hi", request_id="dup-1", max_tokens=2).request_id == "dup-1"   # free again


def test_metrics_endpoint(fast):
    st, c = fast
    before = st.server.metrics.ttft._sum.get(), st.server.metrics.output_tokens._value.get()
    n_req = 3
    for i in range(n_req):
        c.generate(token_ids=[50 + i], max_tokens=5, temperature=0, ignore_eos=True)
    port = st.server.bound_metrics_port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    vals = metric_series(body, "fake")
    assert vals["tbjax_generation_tokens_total"] - before[1] == 5 * n_req
    for name in ("tbjax_time_to_first_token_seconds_count", "tbjax_time_per_output_token_seconds_count",
                 "tbjax_inter_token_latency_seconds_count", 'tbjax_request_phase_seconds_count{phase="queue"}',
                 'tbjax_request_phase_seconds_count{phase="decode"}', "tbjax_kv_pages_total",
                 "tbjax_kv_pages_used", "tbjax_prefix_cache_hit_rate", "tbjax_requests_queued",
                 "tbjax_engine_running_requests", "tbjax_engine_waiting_requests",
                 "tbjax_kv_transfer_raw_bytes_total", "tbjax_kv_transfer_compressed_bytes_total"):
        assert name in vals, name
    assert vals["tbjax_kv_pages_total"] == 1023
    assert vals["tbjax_requests_inflight"] == 0 and vals["tbjax_requests_queued"] == 0


def _num_aborted(st):
    return st.server.engine_loop.call(lambda e: e.scheduler.num_aborted).result(10)


def test_cancellation_frees_pages(fast):
    st, c = fast
    aborted = _num_aborted(st)
    stream = c.generate_stream(token_ids=[7] * 40, max_tokens=450, ignore_eos=True)
    got = 0
    while got < 3:
        ch = next(stream)
        assert not ch.finish_reason
        got += len(ch.token_ids)
    gate = threading.Event()
    # pause the engine (the request cannot finish meanwhile); note what it holds at that moment
    held = st.server.engine_loop.call(
        lambda e: (e.scheduler.num_running, e.scheduler.stats()["pages_used"], gate.wait(30))[:2])
    try:
        stream.close()   # cancels the RPC
        time.sleep(0.1)
    finally:
        gate.set()
    running, used = held.result(30)
    assert running == 1 and used >= 11   # 43+ tokens in pages of 4
    wait_kv_pages_all_free(st)
    assert _num_aborted(st) == aborted + 1   # freed by the abort, not by running to the end


def test_deadline_mid_stream_aborts_and_frees(fast):
    st, c = fast
    aborted = _num_aborted(st)
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for ch in c.generate_stream(token_ids=[9] * 8, max_tokens=480, ignore_eos=True, timeout=0.3):
            got.append(ch)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < len(got) < 480
    wait_kv_pages_all_free(st)
    assert _num_aborted(st) == aborted + 1


def test_deadline_already_past(fast):
    st, c = fast
    with pytest.raises(grpc.RpcError) as e:
        c.generate("Hi", max_tokens=3, timeout=0)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert c.generate("Hi", max_tokens=3).completion_tokens == 3


class _SlowOnce(FakeEngine):
    """Fake engine whose step raises once when armed (to check the INTERNAL path)."""

    armed = False

    def step(self):
        if self.armed and self.scheduler.has_unfinished():
            self.armed = False
            raise RuntimeError("simulated device failure")
        return super().step()


async def _counts(sv):
    return sv.num_running, sv.num_queued


def test_backpressure_engine_refusal_and_engine_crash():
    model = fake_served_model(step_time_s=0.01, num_pages=40, page_size=4, max_model_len=512)
    eng = _SlowOnce(num_pages=40, page_size=4, max_model_len=512, step_time_s=0.01)
    model.engine, model.tokenizer = eng, eng.tokenizer
    lim = Limits(max_concurrent_requests=3, max_queued_requests=2)
    with ServerThread(model, limits=lim, metrics_port=None) as st, Client(st.address, timeout=30) as c:
        # engine refusal: fits the context (512) but not the 39 pages of 4 tokens
        with pytest.raises(grpc.RpcError) as e:
            c.generate(token_ids=[5] * 100, max_tokens=100)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pages" in e.value.details()
        # limits 3 / 2: three streams run, two more wait in the server's queue, the sixth is refused
        s1 = c.generate_stream(token_ids=[5], max_tokens=50, ignore_eos=True)
        s2 = c.generate_stream(token_ids=[6], max_tokens=50, ignore_eos=True)
        s3 = c.generate_stream(token_ids=[7], max_tokens=50, ignore_eos=True)
        next(s1), next(s2), next(s3)
        sv = st.server.servicer
        q1 = c.generate_call(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[8]),
                                                params=pb.SamplingParams(max_tokens=2, temperature=0)))
        q2 = c.generate_call(pb.GenerateRequest(prompt="b", params=pb.SamplingParams(max_tokens=2)))
        deadline = time.time() + 10
        while st.run_coro(_counts(sv)) != (3, 2) and time.time() < deadline:
            time.sleep(0.01)
        assert st.run_coro(_counts(sv)) == (3, 2)      # (running, waiting)
        added = st.server.engine_loop.call(lambda e: e.num_added).result(10)
        with pytest.raises(grpc.RpcError) as e:
            c.generate("x", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in e.value.details()
        assert "3 requests running" in e.value.details() and "2 waiting" in e.value.details()
        # the waiting ones never reached the engine
        assert st.server.engine_loop.call(lambda e: e.num_added).result(10) == added
        s3.close()        # a running place frees: the oldest waiting request runs
        got = [t for r in q1 for t in r.token_ids]
        assert got == reference([8], 2)[0]
        assert sum(len(r.token_ids) for r in q2) == 2
        _ = [ch for ch in s1], [ch for ch in s2]
        assert st.run_coro(_counts(sv)) == (0, 0)
        assert c.generate("x", max_tokens=2).completion_tokens == 2     # accepted again
        # an engine crash fails the requests in flight with INTERNAL; the server keeps serving
        eng.armed = True
        with pytest.raises(grpc.RpcError) as e:
            c.generate("boom", max_tokens=5)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "simulated device failure" in e.value.details()
        got = c.generate(token_ids=[8, 9], max_tokens=6, temperature=0)
        assert got.token_ids == reference([8, 9], 6)[0]
        wait_kv_pages_all_free(st)


def test_drain_finishes_running_refuses_new():
    with ServerThread(fake_served_model(step_time_s=0.01), metrics_port=None) as st, \
            Client(st.address, timeout=30) as c:
        stream = c.generate_stream(token_ids=[11, 12], max_tokens=150, ignore_eos=True, temperature=0)
        chunks = [next(stream)]
        stopper = threading.Thread(target=st.stop, kwargs={"grace": 20})
        stopper.start()
        time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as e:        # draining: new RPCs are refused
            c.generate("new", max_tokens=2, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        chunks += list(stream)                         # the running one completes (150 steps of 10 ms)
        ids = [t for ch in chunks for t in ch.token_ids]
        assert ids == reference([11, 12], 150, ignore_eos=True)[0] and chunks[-1].finish_reason == "length"
        assert chunks[0].finish_reason is None
        stopper.join(30)
        assert not stopper.is_alive() and not st.server.engine_loop.alive


def test_drain_timeout_cancels_and_frees():
    model = fake_served_model(step_time_s=0.01)
    st = ServerThread(model, metrics_port=None).start()
    c = Client(st.address, timeout=30)
    stream = c.generate_stream(token_ids=[3, 4], max_tokens=500, ignore_eos=True)
    next(stream)
    st.stop(grace=0.3)
    with pytest.raises(grpc.RpcError):
        list(stream)
    c.close()
    assert not st.server.engine_loop.alive
    assert model.engine.scheduler.num_aborted == 1
    assert kv_pages_all_free(model.engine)["all_free"]   # the engine thread is gone: safe to look directly


def test_engine_in_a_child_process():
    """``Server(engine_factory=...)``: the engine runs in a child process (serving.engine_proc). Same contract as
    the engine thread: streams equal the reference (here with the step's host work overlapped), logprobs pass
    through, refusals are INVALID_ARGUMENT, a cancelled request is aborted in the child and frees its pages, a
    failing step is INTERNAL and the server keeps serving, stats and step metrics arrive, stop ends the child."""
    import functools
    import operator

    factory = functools.partial(FakeEngine, num_pages=100, page_size=4, max_model_len=512, step_time_s=0.002,
                                overlap=True)
    with ServerThread(fake_served_model(), engine_factory=factory, metrics_port=None) as st, \
            Client(st.address, timeout=30) as c:
        loop = st.server.engine_loop
        assert loop.engine is None and loop.alive
        rng = random.Random(4)
        jobs = [(_rand_prompt(rng), rng.randrange(1, 60)) for _ in range(8)]
        results = [None] * len(jobs)

        def run(i):
            results[i] = c.generate(token_ids=jobs[i][0], max_tokens=jobs[i][1], temperature=0, logprobs=2)

        run_in_threads(run, len(jobs))
        for (ids, mt), got in zip(jobs, results):
            want, reason = reference(ids, mt)
            assert got.token_ids == want and got.finish_reason == reason
            assert got.text == FakeEngine().tokenizer.decode(want)
            assert [lp[0] for lp in got.logprobs] == want and all(lp[1] == -0.5 for lp in got.logprobs)
        # refused by the engine in the child: fits the context (512) but never the 99 pages of 4 tokens
        with pytest.raises(grpc.RpcError) as e:
            c.generate(token_ids=[5] * 300, max_tokens=200)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pages" in e.value.details()
        # cancellation aborts in the child and frees the pages
        num_aborted = operator.attrgetter("scheduler.num_aborted")
        aborted = loop.call(num_aborted).result(10)
        stream = c.generate_stream(token_ids=[7] * 40, max_tokens=300, ignore_eos=True)
        assert not next(stream).finish_reason
        stream.close()
        wait_kv_pages_all_free(st)
        assert loop.call(num_aborted).result(10) == aborted + 1
        with pytest.raises(TypeError, match="must pickle"):   # call() needs a picklable fn: its caller hears
            loop.call(lambda e: 1).result(10)
        # a step that raises: INTERNAL for the request in flight, then the server serves again
        loop.call(operator.methodcaller("__setattr__", "step_time_s", "broken")).result(10)
        with pytest.raises(grpc.RpcError) as e:
            c.generate("boom", max_tokens=5)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "engine step failed" in e.value.details()
        loop.call(operator.methodcaller("__setattr__", "step_time_s", 0.002)).result(10)
        assert c.generate(token_ids=[8, 9], max_tokens=6, temperature=0).token_ids == reference([8, 9], 6)[0]
        wait_kv_pages_all_free(st)
        deadline = time.time() + 5
        while loop.stats().get("kv_pages_used", -1) != 0 and time.time() < deadline:
            time.sleep(0.05)
        assert loop.stats()["kv_pages_total"] == 99 and loop.stats()["kv_pages_used"] == 0
        assert loop.num_steps > 0 and st.server.metrics.step._sum.get() > 0
    assert not loop.alive and loop._proc.exitcode == 0


def test_engine_process_that_dies():
    """The engine's child process killed mid-request (e.g. a crash in the runtime): the request in flight ends
    with INTERNAL naming the exit, later requests get UNAVAILABLE, and the server still stops cleanly."""
    import functools
    import os
    import signal

    factory = functools.partial(FakeEngine, step_time_s=0.005)
    with ServerThread(fake_served_model(), engine_factory=factory, metrics_port=None) as st, \
            Client(st.address, timeout=30) as c:
        stream = c.generate_stream(token_ids=[3, 4], max_tokens=400, ignore_eos=True)
        assert not next(stream).finish_reason
        os.kill(st.server.engine_loop.pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "exited unexpectedly" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.generate("x", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not st.server.engine_loop.alive


def test_event_loop_choice():
    """``ServerThread(event_loop="uvloop")`` serves on uvloop's loop (measured faster under load in
    benchmarks/RESULTS.md); an unknown loop, or uvloop when it is not installed, is a clear error."""
    from serving.server import new_event_loop

    with pytest.raises(ValueError, match="not one of"):
        new_event_loop("trio")
    try:
        import uvloop  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="needs the uvloop package"):
            new_event_loop("uvloop")
        return
    with ServerThread(fake_served_model(step_time_s=0.001), metrics_port=None, event_loop="uvloop") as st, \
            Client(st.address, timeout=30) as c:
        assert type(st.loop).__module__.startswith("uvloop")
        got = c.generate(token_ids=[5, 6], max_tokens=20, temperature=0)
        assert got.token_ids == reference([5, 6], 20)[0] and got.finish_reason == "length"
