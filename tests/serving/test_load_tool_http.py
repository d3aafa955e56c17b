"""benchmarks/load_test.py over the OpenAI HTTP API (``--protocols http``): against a fake-engine server, the token
counts the HTTP client reports per request equal what the server generated (the requested max_tokens with
ignore_eos; the fake engine's own reference lengths when eos ends requests), through this process and through
client processes, and a grpc,http run reports the same totals on both rows."""
import asyncio
import importlib.util
import os
import sys

import pytest

from serving.fake_engine import fake_served_model, reference
from serving.limits import Limits
from serving.server import ServerThread

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("load_test", os.path.join(ROOT, "benchmarks", "load_test.py"))
lt = importlib.util.module_from_spec(_spec)
sys.modules["load_test"] = lt
_spec.loader.exec_module(lt)

N, CONC = 24, 6
PROMPT, OUTPUT = "uniform:4:40", "uniform:1:40"


def _generated(st) -> float:
    """Tokens the server streamed so far (its tbjax_generation_tokens counter)."""
    for fam in st.server.metrics.output_tokens.collect():
        for s in fam.samples:
            if s.name.endswith("_total"):
                return s.value
    raise AssertionError("no tbjax_generation_tokens_total sample")


@pytest.fixture(scope="module")
def server():
    # step time 0: the engine outruns the front end, so chunks often merge several tokens (a client that counted
    # SSE chunks as tokens would come out short)
    model = fake_served_model(step_time_s=0.0)
    with ServerThread(model, limits=Limits(max_concurrent_requests=64, max_queued_requests=64),
                      metrics_port=None, http_port=0) as st:
        yield st


def _args(*extra):
    return lt.build_parser().parse_args(["--target", "unused", "--concurrency", str(CONC), "--timeout", "60",
                                         *extra])


def _jobs(seed):
    return lt.make_workload(N, lt.parse_dist(PROMPT), lt.parse_dist(OUTPUT), 259, 512, float("inf"), seed)


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_http_client_counts_what_the_server_generated(server, ignore_eos):
    seed = 3
    jobs = _jobs(seed)
    want = [j.max_tokens if ignore_eos else len(reference(j.prompt_token_ids, j.max_tokens)[0]) for j in jobs]
    if not ignore_eos:   # this workload has requests that eos ends early: the check below can tell the two apart
        assert any(w < j.max_tokens for w, j in zip(want, jobs))
    g0 = _generated(server)
    args = _args(*([] if ignore_eos else ["--no-ignore-eos"]))
    res, dur = asyncio.run(lt.run_http(server.server.http_url, jobs, args))
    assert dur > 0 and len(res) == N
    assert [r.error for r in res if not r.ok] == []
    assert [r.index for r in res] == [j.index for j in jobs]
    assert [r.output_tokens for r in res] == want
    assert [r.prompt_tokens for r in res] == [len(j.prompt_token_ids) for j in jobs]
    assert _generated(server) - g0 == sum(want)
    assert all(r.ttft is not None and 0 < r.ttft <= r.e2e for r in res)
    assert all((r.tpot is not None) == (r.output_tokens > 1) for r in res)
    assert all(len(r.itl) <= r.output_tokens - 1 for r in res)
    s = lt.summarize(res, dur)
    assert s["completed"] == N and s["output_tokens"] == sum(want)


def test_client_processes_grpc_and_http_same_counts(server):
    """Two client processes per pass (jobs dealt round robin): every request comes back once, with the server's
    count, over gRPC and HTTP alike."""
    jobs = _jobs(4)
    a = _args("--client-processes", "2")
    got = {}
    for proto in ("grpc", "http"):
        g0 = _generated(server)
        res, dur = lt._client_process(a, server.address, jobs, proto,
                                      server.server.http_url if proto == "http" else None)
        assert dur > 0 and [r.index for r in res] == list(range(N)), proto
        assert all(r.ok for r in res), [r.error for r in res]
        got[proto] = [r.output_tokens for r in res]
        assert _generated(server) - g0 == sum(j.max_tokens for j in jobs), proto
        assert a._client_pass_cpu > 0
    assert got["grpc"] == got["http"] == [j.max_tokens for j in jobs]


def test_grpc_and_http_rows_have_the_same_totals(tmp_path):
    out = tmp_path / "r.json"
    rep = lt.main(["--spawn", "fake", "--fake-step-time", "0.002", "--num-requests", str(N), "--concurrency",
                   str(CONC), "--prompt-len", PROMPT, "--output-len", OUTPUT, "--seed", "5", "--warmup", "1",
                   "--protocols", "grpc,http", "--compare-offline", "--out", str(out)])
    jobs = lt.make_workload(N, lt.parse_dist(PROMPT), lt.parse_dist(OUTPUT), 259, 512, float("inf"), 5)
    assert rep["mode"] == "offline+grpc+http"
    for mode in ("offline", "grpc", "http"):
        s = rep[mode]
        assert (s["completed"], s["failed"]) == (N, 0), mode
        assert s["output_tokens"] == sum(j.max_tokens for j in jobs), mode
        assert s["prompt_tokens"] == sum(len(j.prompt_token_ids) for j in jobs), mode
        assert s["ttft_s"]["n"] == N and s["tpot_s"]["n"] == sum(j.max_tokens > 1 for j in jobs), mode
        assert s["engine_steps"] > 0, mode
    cmp = rep["comparison"]
    assert cmp["same_totals"] and list(cmp["rows"]) == ["offline", "grpc", "http"]
    assert set(cmp["ratios"]) == {"http/grpc", "grpc/offline", "http/offline"}
    assert rep["http_over_grpc_output_throughput"] == pytest.approx(
        rep["http"]["output_token_throughput"] / rep["grpc"]["output_token_throughput"])
    assert rep["summary"] is rep["grpc"] and out.exists()


def test_protocols_flag():
    assert lt.parse_protocols("grpc") == ["grpc"] and lt.parse_protocols("http,grpc") == ["http", "grpc"]
    for bad in ("", "rest", "grpc,grpc"):
        with pytest.raises(Exception):
            lt.parse_protocols(bad)
    assert lt.default_http_target("10.0.0.2:50051") == "http://10.0.0.2:8000"
    assert lt.default_http_target("[::1]:50051") == "http://[::1]:8000"
    assert lt.http_base_url("http://h:1/v1/") == "http://h:1"
