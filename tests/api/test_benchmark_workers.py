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
