"""Compiled up front, never again: a server listens first with health NOT_SERVING and refuses Generate with
UNAVAILABLE ("warming up ...", at once, never a hang) while its engine compiles every program, then turns SERVING and
serves; `python -m tbjax.serve` prints its serving line only after the warm-up; XLA compiles are counted
(tbjax.compile_monitor) and exported (tbjax_xla_compiles_total, tbjax_xla_compile_seconds, tbjax_ready), the engine
process's compiles included; `tbjax.LLM` warms its engine up by default, `LLM.from_parts` only when asked.

The fake engine's warm-up (serving.fake_engine: `warmup_s`, `warmup_jit`) stands in for the engine's compiles."""
import functools
import operator
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest

from serving.client import Client
from serving.fake_engine import FakeEngine, fake_served_model, reference
from serving.server import ServerThread
from serving.testing import metric_series
from tbjax import compile_monitor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WARMUP_S = 4.0   # the warm-up the tests' refusals must land inside


def _metrics(port) -> dict:
    """/metrics by series, keyed without the label ``model_name="fake"`` that every sample must carry."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return metric_series(body, "fake")


def _refused_while_warming(c: Client, still_warming) -> str:
    """Generate during the warm-up: UNAVAILABLE while the warm-up still runs (returns its message). The answer is
    checked against the server's own state, not a wall-clock bound: `still_warming()` is asked after the answer came,
    so a request queued behind the warm-up (answered only once it ended) fails however fast or slow the box is."""
    with pytest.raises(grpc.RpcError) as e:
        c.generate(token_ids=[5, 6], max_tokens=3, temperature=0)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
    assert still_warming(), "the refusal came only after the warm-up had ended: it was queued behind it"
    return e.value.details()


@pytest.mark.parametrize("in_child", [False, True], ids=["engine-thread", "engine-process"])
def test_not_serving_and_unavailable_during_warmup_then_serving(in_child):
    kw = dict(warmup_s=WARMUP_S, warmup_jit=True, warmup_programs=3)
    server_kw = {"engine_factory": functools.partial(FakeEngine, **kw)} if in_child else {}
    model = fake_served_model(**({} if in_child else kw))
    st = ServerThread(model, warmup=True, metrics_port=0, **server_kw)
    t0 = time.perf_counter()
    st.start(timeout=60, wait_ready=False)
    try:
        with Client(st.address, timeout=30) as c:
            assert c.health() == "NOT_SERVING" and c.health("tbjax.v1.Tbjax") == "NOT_SERVING"
            msg = _refused_while_warming(c, lambda: not st.server.ready)
            assert "warming up" in msg and "SERVING" in msg, msg
            assert c.model_info()["model"] == "fake"          # no engine involved: answers meanwhile
            m = _metrics(st.server.bound_metrics_port)
            assert m["tbjax_ready"] == 0
            assert m['tbjax_requests_rejected_total{code="UNAVAILABLE"}'] == 1
            assert not st.server.ready
            st.wait_ready(60)
            assert time.perf_counter() - t0 >= WARMUP_S * 0.9      # it did wait for the warm-up
            assert c.health() == "SERVING" and c.health("tbjax.v1.Tbjax") == "SERVING"
            got = c.generate(token_ids=[5, 6], max_tokens=7, temperature=0)
            assert got.token_ids == reference([5, 6], 7)[0]
            loop = st.server.engine_loop
            assert loop.call(operator.attrgetter("ready")).result(10) is True   # picklable: runs in the child too
            info = st.server.warmup_info
            assert info["how"] == "engine" and info["programs"] == 3 and info["xla_compiles"] >= 3, info
            m = _metrics(st.server.bound_metrics_port)
            assert m["tbjax_ready"] == 1
            # the warm-up's compiles (in the child with an engine process) are in this server's counter
            assert m["tbjax_xla_compiles_total"] >= 3 and m["tbjax_xla_compile_seconds_count"] >= 3
            if in_child:
                deadline = time.time() + 10
                while "xla_compiles" not in loop.stats() and time.time() < deadline:
                    time.sleep(0.05)
                assert loop.stats()["xla_compiles"] >= 3 and "xla_compile_new_s" not in loop.stats()
    finally:
        st.stop()
    assert st.server.metrics.ready._value.get() == 0


def test_compile_counter_counts_each_compile_once_and_reaches_metrics():
    """compile_monitor counts one backend compile per new program (install() twice: still counted once), and every
    server's /metrics counter follows it."""
    compile_monitor.install()
    compile_monitor.install()
    with ServerThread(fake_served_model(), metrics_port=0) as st:
        before = _metrics(st.server.bound_metrics_port)
        n0, s0 = compile_monitor.count(), compile_monitor.seconds()
        import jax
        x = np.arange(7 * 11, dtype=np.float32).reshape(7, 11)     # host input: only the jit itself compiles
        np.testing.assert_allclose(np.asarray(jax.jit(lambda a: a * 3 - 1)(x)), x * 3 - 1)
        assert compile_monitor.count() == n0 + 1 and compile_monitor.seconds() > s0
        n, new = compile_monitor.since(n0)
        assert n == n0 + 1 and len(new) == 1 and new[0] > 0
        after = _metrics(st.server.bound_metrics_port)
        assert after["tbjax_xla_compiles_total"] - before["tbjax_xla_compiles_total"] == 1
        assert after["tbjax_xla_compile_seconds_count"] - before["tbjax_xla_compile_seconds_count"] == 1
        # a server created now starts from the process's total (earlier compiles replayed)
        assert after["tbjax_xla_compiles_total"] >= compile_monitor.count()
        assert after["tbjax_ready"] == 1


def test_no_warmup_serves_at_once_and_a_failed_warmup_is_an_error():
    with ServerThread(fake_served_model(warmup_s=30.0), metrics_port=None) as st, Client(st.address) as c:
        assert c.health() == "SERVING"
        assert c.generate(token_ids=[9], max_tokens=2, temperature=0).token_ids == reference([9], 2)[0]
        assert st.server.engine_loop.call(operator.attrgetter("ready")).result(10) is False   # not warmed up: nobody asked

    class Broken(FakeEngine):
        def warmup(self, progress=False):
            raise RuntimeError("no compiler today")

    model = fake_served_model()
    model.engine = Broken()
    st = ServerThread(model, warmup=True, metrics_port=None)
    with pytest.raises(RuntimeError, match="warm-up failed.*no compiler today"):
        st.start(timeout=30)
    st.stop()
    assert not st.server.engine_loop.alive


def test_llm_warms_its_engine_up_by_default_from_parts_only_when_asked(monkeypatch):
    monkeypatch.setenv("TBJAX_WARMUP", "1")           # the default outside the test suite (tests/conftest.py)
    import tbjax.llm
    import tbjax.weights

    calls = []

    class Eng:
        def __init__(self, *a):
            pass

        def warmup(self, progress=False):
            calls.append(progress)
            return {"programs": 1, "seconds": 0.0}

    monkeypatch.setattr(tbjax.llm, "Engine", Eng)
    monkeypatch.setattr(tbjax.weights, "load_model", lambda *a, **k: ("spec", "params", "tok"))
    tbjax.llm.LLM.from_parts("spec", "params", "tok")
    assert calls == []
    tbjax.llm.LLM.from_parts("spec", "params", "tok", warmup=True)
    assert calls == [False]
    tbjax.llm.LLM(progress=False)
    assert calls == [False, False]
    tbjax.llm.LLM(warmup=False)
    assert calls == [False, False]


def test_cli_warmup_flags(monkeypatch):
    monkeypatch.setenv("TBJAX_WARMUP", "1")           # the default outside the test suite (tests/conftest.py)
    from serving.cli import build_parser
    ap = build_parser()
    assert ap.parse_args([]).warmup is True
    assert ap.parse_args(["--warmup"]).warmup is True
    assert ap.parse_args(["--no-warmup"]).warmup is False


@pytest.mark.parametrize("extra", [[], ["--engine-process"]], ids=["engine-thread", "engine-process"])
def test_serve_cli_prints_serving_only_after_the_warmup(extra):
    p = subprocess.Popen([sys.executable, "-m", "tbjax.serve", "--fake-engine", "--fake-warmup-time", str(WARMUP_S),
                          "--warmup", "--port", "0", "--metrics-port", "0", *extra], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        err = []
        while True:   # stderr: "loaded ...", then "listening on HOST:PORT ...; health NOT_SERVING ..."
            line = p.stderr.readline()
            assert line, f"no listening line: {''.join(err)}"
            err.append(line)
            m = re.search(r"listening on (\S+):(\d+), metrics on http://\S+:(\d+)/metrics", line)
            if m:
                break
        target = f"127.0.0.1:{m.group(2)}"
        with Client(target, timeout=30) as c:
            # NOT_SERVING while warming up (with an engine process the child may still be loading: same answer)
            assert c.health() == "NOT_SERVING" and c.health("tbjax.v1.Tbjax") == "NOT_SERVING"
            assert "warming up" in _refused_while_warming(c, lambda: _metrics(m.group(3))["tbjax_ready"] == 0)
            assert _metrics(m.group(3))["tbjax_ready"] == 0
            assert select.select([p.stdout], [], [], 0)[0] == []    # no serving line yet
            line = p.stdout.readline()
            assert re.search(r"tbjax: serving fake \(colocated\) on \S+ \(gRPC tbjax.v1\), metrics on", line), line
            # (no bound on the time to the serving line: the warm-up starts before the sockets are bound and under
            # load the listening line comes late; NOT_SERVING and the refusal above were seen while it ran)
            assert c.health() == "SERVING"
            assert c.generate(token_ids=[20, 21], max_tokens=5, temperature=0).token_ids == \
                reference([20, 21], 5)[0]
            assert _metrics(m.group(3))["tbjax_ready"] == 1
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
        rest = p.stderr.read()
        assert "warm-up readied 8 programs" in rest and "stopped" in rest, rest
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_worker_rpcs_are_refused_while_warming_not_queued(monkeypatch):
    """A prefill worker's tbjax.pd.v1.Worker RPCs (here Stats, which runs on the engine thread) get UNAVAILABLE at
    once during the warm-up, then work. (The fake engine has no KV pools: the page layout is made up.)"""
    import json

    import serving.pd_worker
    from serving.pd_worker import PD_SERVICE

    monkeypatch.setattr(serving.pd_worker, "page_layout", lambda engine: ("float32", (1, 1, 2, 1)))

    st = ServerThread(fake_served_model(warmup_s=WARMUP_S), role="prefill", warmup=True, metrics_port=None,
                      kv_shm_bytes=0)
    st.start(timeout=60, wait_ready=False)
    try:
        with grpc.insecure_channel(st.address) as ch:
            rpc = ch.unary_unary(f"/{PD_SERVICE}/Stats", request_serializer=lambda b: b,
                                 response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as e:
                rpc(b"{}", timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in e.value.details()
            assert not st.server.ready    # answered while the warm-up ran, not queued behind it
            st.wait_ready(60)
            assert json.loads(rpc(b"{}", timeout=30))["unfinished"] is False
    finally:
        st.stop()
