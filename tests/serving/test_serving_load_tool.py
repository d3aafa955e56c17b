"""benchmarks/load_test.py: workload generation, percentiles (vs numpy), and a short run against the fake
engine over gRPC and offline whose token counts must equal the workload's."""
import argparse
import importlib.util
import math
import os
import random
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("load_test", os.path.join(ROOT, "benchmarks", "load_test.py"))
lt = importlib.util.module_from_spec(_spec)
sys.modules["load_test"] = lt
_spec.loader.exec_module(lt)


def test_percentiles_match_numpy():
    rng = np.random.default_rng()
    xs = rng.exponential(size=257).tolist()
    p = lt.percentiles(xs)
    for k, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert math.isclose(p[k], float(np.percentile(xs, q)), rel_tol=1e-12)
    assert math.isclose(p["mean"], float(np.mean(xs))) and p["max"] == max(xs) and p["n"] == 257
    assert lt.percentiles([]) == {"n": 0}


def test_distributions_and_workload():
    rng = random.Random(0)
    assert {lt.parse_dist("7")(rng) for _ in range(10)} == {7}
    u = [lt.parse_dist("uniform:3:5")(rng) for _ in range(300)]
    assert set(u) == {3, 4, 5}
    assert min(lt.parse_dist("normal:2:5")(rng) for _ in range(300)) == 1
    for bad in ("0", "uniform:5:3", "zipf:1:2", "normal:1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            lt.parse_dist(bad)
    jobs = lt.make_workload(50, lt.parse_dist("uniform:10:40"), lt.parse_dist("uniform:5:30"), 100, 48, 20.0, 1)
    assert all(len(j.prompt_token_ids) + j.max_tokens <= 48 for j in jobs)
    assert all(0 <= t < 100 for j in jobs for t in j.prompt_token_ids)
    arr = [j.arrival_s for j in jobs]
    assert arr == sorted(arr) and 0.5 < arr[-1] < 10   # Poisson at 20/s: ~2.5 s for 50
    assert lt.make_workload(3, lt.parse_dist("4"), lt.parse_dist("4"), 100, 48, float("inf"), 1)[2].arrival_s == 0


@pytest.mark.parametrize("mode", ["grpc", "offline", "offline+grpc", "offline+grpc/client-process",
                                  "offline+grpc/engine-process"])
def test_short_run_against_fake_engine(mode, tmp_path):
    out = tmp_path / "r.json"
    args = ["--spawn", "fake", "--num-requests", "40", "--concurrency", "8", "--prompt-len", "uniform:4:40",
            "--output-len", "uniform:1:20", "--seed", "5", "--warmup", "1", "--out", str(out)]
    if "grpc" in mode:
        # a step takes 2 ms, so tokens leave the server one step apart: with an instant fake engine a whole
        # request could reach a slow client as one merged chunk and leave no inter-token gap to measure (seen in CI)
        args += ["--fake-step-time", "0.002"]
    rep = lt.main(args + {"grpc": [], "offline": ["--offline"], "offline+grpc": ["--compare-offline"],
                          "offline+grpc/client-process": ["--compare-offline", "--client-process"],
                          # the H200 proxy's knobs: the engine in a child process, host work overlapped, pages of 16
                          "offline+grpc/engine-process": ["--compare-offline", "--engine-process", "--fake-overlap",
                                                          "--fake-page-size", "16", "--max-model-len", "256",
                                                          "--max-num-batched-tokens", "128"]}[mode])
    mode = mode.split("/")[0]      # the client/engine process runs the same workload: the same summary checks hold
    assert rep["mode"] == mode
    for key in mode.split("+"):
        _check_summary(rep[key])
    if mode == "offline+grpc":
        assert rep["grpc_over_offline_output_throughput"] > 0
    for key in mode.split("+"):   # engine steps are counted in every pass: at most 8 in flight, 8 tokens a step
        assert rep[key]["engine_steps"] > 0 and rep[key]["output_tokens"] / rep[key]["engine_steps"] <= 8
    assert out.exists()


def _check_summary(s):
    jobs = lt.make_workload(40, lt.parse_dist("uniform:4:40"), lt.parse_dist("uniform:1:20"), 259, 512,
                            float("inf"), 5)
    assert s["completed"] == 40 and s["failed"] == 0
    assert s["output_tokens"] == sum(j.max_tokens for j in jobs)
    assert s["prompt_tokens"] == sum(len(j.prompt_token_ids) for j in jobs)
    assert s["ttft_s"]["n"] == 40 and s["tpot_s"]["n"] == sum(j.max_tokens > 1 for j in jobs)
    assert 0 < s["itl_s"]["n"] <= sum(j.max_tokens - 1 for j in jobs)   # one per chunk (chunks may merge tokens)
    for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert 0 <= s[k]["p50"] <= s[k]["p90"] <= s[k]["p99"] <= s[k]["max"]
