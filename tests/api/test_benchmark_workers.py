"""The benchmarks' orchestrator -> worker hand-off: a worker process must see every option the benchmark was given
(a dropped `--weight-dtype` once made an "fp8 weights" run time bf16 weights)."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
_spec = importlib.util.spec_from_file_location("bench_engine_decode",
                                               os.path.join(ROOT, "benchmarks", "bench_engine_decode.py"))
bed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bed)
from bench_common import forward_argv  # noqa: E402


@pytest.mark.parametrize("argv", [
    [],
    ["--weight-dtype", "fp8", "--shapes", "32:1024,1:1024", "--e2e", "", "--profile", "", "--layer-buffers", "split"],
    ["--fold-norms", "--command-buffers", "off", "--precompile-workers", "4", "--dtype", "float32", "--steps", "7",
     "--time-budget", "99", "--out", "x.json", "--no-hf"],
])
def test_worker_sees_every_option(argv):
    ap = bed.build_parser()
    given = ap.parse_args(argv)
    fwd = forward_argv(ap, given, skip=bed._ORCHESTRATOR_ONLY)
    seen = ap.parse_args(fwd + ["--worker", "jax"])
    for a in ap._actions:
        if a.option_strings and a.dest != "help" and a.dest not in bed._ORCHESTRATOR_ONLY:
            assert getattr(seen, a.dest) == getattr(given, a.dest), a.dest
    for d in bed._ORCHESTRATOR_ONLY:                      # the orchestrator's own options stay at home
        if d != "worker":
            assert getattr(seen, d) == ap.get_default(d), d
    assert seen.worker == "jax"


def test_forward_argv_store_false_and_none():
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-x", dest="x", action="store_false")
    ap.add_argument("--name", default=None)
    ap.add_argument("--n", type=int, default=3)
    assert forward_argv(ap, ap.parse_args([])) == ["--n", "3"]
    args = ap.parse_args(["--no-x", "--name", "a b", "--n", "5"])
    assert ap.parse_args(forward_argv(ap, args)) == args


def _run_bench(script: str, *args) -> None:
    """Runs benchmarks/<script> on the CPU with `args`; it must exit 0."""
    import subprocess
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *map(str, args)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stderr[-3000:]


def test_engine_host_bench_drives_the_engine(tmp_path):
    """bench_engine_host's simulated device stands in for ModelRunner.launch / fetch: the engine must run on it (its
    signatures follow the runner's) and the numbers must obey the simulated device: no step shorter than the device
    time, the device never busier than the wall, one token per sequence per decode step."""
    import json
    out = tmp_path / "host.json"
    _run_bench("bench_engine_host.py", "--batch", 4, "--prompt", 8, "--steps", 20, "--device-ms", 2, "--out", out)
    rows = json.loads(out.read_text())["rows"]
    assert [r["overlap"] for r in rows] == [False, True]
    for r in rows:
        assert r["median_step_ms"] >= 2.0 * 0.98, r
        assert r["device_busy"] <= 1.02, r           # (a step launched before the timed window may end inside it)
        assert r["tok_per_s"] == pytest.approx(4 * 1e3 / r["median_step_ms"], rel=0.35), r


def test_sampler_bench_times_every_variant_and_the_sampler_keeps_the_reference_set(tmp_path):
    """benchmarks/bench_sampler.py on CPU at a small vocabulary: a timing per (batch, rows, variant), and the
    kept-set search it times gives numpy's reference kept set (sampling.keep_mask_numpy) on its inputs."""
    import json

    import numpy as np

    out = tmp_path / "s.json"
    _run_bench("bench_sampler.py", "--batches", 2, "--vocab", 512, "--reps", 2, "--modes", "greedy,topp", "--out", out)
    res = json.loads(out.read_text())["results"]
    got = {(r["mode"], r["variant"]) for r in res if r.get("us", 0) > 0}
    assert {("greedy", "current"), ("topp", "current"), ("topp", "keep_threshold"), ("topp", "argmax")} <= got
    import jax.numpy as jnp

    from tbjax import sampling
    rng = np.random.default_rng(0)
    lg = rng.standard_normal((2, 512)).astype(np.float32) * 3
    x = lg / 0.7
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) + x.max(-1, keepdims=True)
    for mat, shared, bits, top_k, top_p, min_p in [
            (False, False, 4, 0, 0.9, 0.0), (True, False, 4, 0, 0.9, 0.0), (False, True, 4, 0, 0.9, 0.0),
            (False, False, 1, 7, 0.95, 0.0), (False, False, 2, 0, 0.5, 0.05), (False, False, 8, 40, 0.99, 0.0)]:
        keep = np.asarray(sampling._keep_by_threshold(
            jnp.asarray(x), jnp.asarray(lse, jnp.float32), jnp.full(2, top_k, jnp.int32),
            jnp.full(2, top_p, jnp.float32), jnp.full(2, min_p, jnp.float32), materialize=mat, bits=bits,
            shared_mask=shared))
        for b in range(2):
            want = sampling.keep_mask_numpy(lg[b], 0.7, top_k, top_p, min_p)
            assert (keep[b] == want).all(), (mat, shared, bits, b)
