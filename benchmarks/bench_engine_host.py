"""Host side of Engine.step() with the model replaced by a simulated device (CPU): scheduling, input building,
output processing and detokenization, and how much of it the device time hides.

Why it exists: at batch 32 the H200's decode step is ~6 ms, so a millisecond of Python per step is a sixth of the
throughput unless it overlaps the device. The simulated device is a queue: a launch starts when the previous
launch ends (or now) and takes --device-ms; fetching a step's tokens sleeps until it ends (the host thread is free
meanwhile, as with a real accelerator). --device-ms 0 measures the bare host cost per step. Each configuration
runs with overlapped scheduling off (launch, wait, process, schedule) and on (launch step N+1, then wait for N).

Usage: python benchmarks/bench_engine_host.py [--batch 32 --prompt 100 --steps 300 --device-ms 0,6] [--out x.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import add_options, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


class SimulatedDevice:
    """Stands in for ModelRunner.launch / fetch: random tokens, a fixed time per step, steps run in order."""

    def __init__(self, step_s: float, seed: int = 0):
        self.step_s = step_s
        self.busy_until = 0.0
        self.busy_s = 0.0
        self.rng = np.random.default_rng(seed)

    def launch(self, inp, packed=None, want_logprobs=False, prev=None, qbuf=None):
        start = max(time.perf_counter(), self.busy_until)
        self.busy_until = start + self.step_s
        self.busy_s += self.step_s
        S = inp.temperature_S.size                 # one sampled token per sampling row
        return {"tokens": self.rng.integers(0, 256, S).astype(np.int32), "_end": self.busy_until}

    @staticmethod
    def fetch(out, want_logprobs=False):
        wait = out["_end"] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return {"tokens": out["tokens"]}


def measure(batch: int, prompt: int, steps: int, device_ms: float, overlap: bool) -> dict:
    from engine_helpers import byte_tokenizer, tiny_model
    from tbjax.engine import Engine, EngineConfig
    from tbjax.sampling import SamplingParams

    spec, params = tiny_model()
    pages = batch * -(-(prompt + steps + 20) // 16) + 1
    eng = Engine(spec, params, byte_tokenizer(), EngineConfig(num_pages=pages, page_size=16, max_num_seqs=batch,
                                                              max_num_batched_tokens=max(4096, batch * prompt),
                                                              overlap_scheduling=overlap))
    dev = SimulatedDevice(device_ms * 1e-3)
    eng.runner.launch, eng.runner.fetch = dev.launch, dev.fetch
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=steps + 10, temperature=0.8, ignore_eos=True)
    for i in range(batch):
        eng.add_request(i, [int(x) for x in rng.integers(0, 256, prompt)], sp)
    for _ in range(3):                           # the prefill step (and, with overlap, the first decode launch)
        eng.step()
    ts, n_tok = [], 0
    t0 = time.perf_counter()
    busy0 = dev.busy_s
    for _ in range(steps):
        t = time.perf_counter()
        n_tok += sum(len(o.new_token_ids) for o in eng.step())
        ts.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    return {"batch": batch, "device_ms": device_ms, "overlap": overlap, "steps": steps,
            "median_step_ms": 1e3 * statistics.median(ts), "last50_median_ms": 1e3 * statistics.median(ts[-50:]),
            "tok_per_s": n_tok / wall, "device_busy": (dev.busy_s - busy0) / wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(ap, {"--batch": 32, "--prompt": 100, "--steps": 300}, int)
    ap.add_argument("--device-ms", default="0,6", help="comma list of simulated device times per step (ms)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    print(f"{'device ms':>9} {'overlap':>7} {'step ms (median)':>16} {'last 50':>8} {'tok/s':>8} {'device busy':>11}")
    for dms in [float(x) for x in args.device_ms.split(",")]:
        for overlap in (False, True):
            r = measure(args.batch, args.prompt, args.steps, dms, overlap)
            rows.append(r)
            print(f"{dms:9.2f} {str(overlap):>7} {r['median_step_ms']:16.3f} {r['last50_median_ms']:8.3f} "
                  f"{r['tok_per_s']:8.0f} {r['device_busy']:11.1%}", flush=True)
    res = {"rows": rows, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count()}
    if args.out:
        write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
