"""Host-side cost of one Engine.step() with the model replaced by a no-op (CPU): scheduling, input building,
output processing and detokenization, i.e. what the device step cannot hide today (one step in flight).

Why it exists: at batch 32 the H200's decode step is ~6 ms, so a millisecond of Python per step is a sixth of the
throughput. Usage: python benchmarks/bench_engine_host.py [--batch 32 --prompt 100 --steps 300] [--out x.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from engine_helpers import byte_tokenizer, tiny_model
    from tbjax.engine import Engine, EngineConfig
    from tbjax.sampling import SamplingParams

    spec, params = tiny_model()
    eng = Engine(spec, params, byte_tokenizer(), EngineConfig(num_pages=4096, page_size=16, max_num_seqs=args.batch,
                                                              max_num_batched_tokens=4096))
    rng = np.random.default_rng(0)
    eng.runner.run = lambda inp, want_logprobs=False: {
        "tokens": rng.integers(0, 256, inp.block_tables_SP.shape[0]).astype(np.int32)}
    sp = SamplingParams(max_tokens=args.steps + 10, temperature=0.8, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(i, [int(x) for x in rng.integers(0, 256, args.prompt)], sp)
    eng.step()                                   # the prefill step
    ts = []
    for _ in range(args.steps):
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
    res = {"batch": args.batch, "steps": args.steps, "median_ms": 1e3 * statistics.median(ts),
           "last50_median_ms": 1e3 * statistics.median(ts[-50:]), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
