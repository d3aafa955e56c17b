"""Batch invariance on the device: does a request's output depend on what else is in the engine's steps?

Why it exists: the served engine promises that a greedy or seeded request gives the same tokens alone and under
concurrent traffic. On CPU a test checks it (tests/engine/test_determinism.py); on a GPU the matmul and
attention libraries pick algorithms per shape, so it has to be measured there. This runs each target request alone
(reference), then all of them together with other requests of other lengths arriving before and after them (their
steps land in other token buckets, beside other prefill chunks and decodes), and reports per target whether the
tokens are identical, where they first differ and the largest chosen-token logprob difference over the common
prefix. It also times the loaded run (output tok/s), the number the cost of any invariance setting is read against.

Usage (H200, default model's GGUF installed):  python3 benchmarks/bench_determinism.py --out det.json
       (CPU):                                  python benchmarks/bench_determinism.py --targets 2 --max-tokens 8
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import write_json  # noqa: E402

PROMPTS = ["The meaning of life is", "Write a haiku about the sea.", "List three prime numbers:",
           "Once upon a time, in a small village,", "def fibonacci(n):", "The capital of France is",
           "Explain photosynthesis in one sentence.", "Translate 'good morning' to Spanish:"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--targets", type=int, default=8, help="target requests (half greedy, half seeded)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--others", type=int, default=24, help="other requests in the loaded run")
    ap.add_argument("--engine-kw", default="", help="EngineConfig fields: FIELD=VALUE,...")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    from tbjax.engine.arrivals import run_arrivals
    from tbjax.engine.engine import Engine, EngineConfig
    from tbjax.sampling import SamplingParams
    from tbjax.weights import load_model

    kw = {}
    for item in filter(None, args.engine_kw.split(",")):
        k, v = item.split("=", 1)
        kw[k] = int(v) if v.lstrip("-").isdigit() else {"true": True, "false": False}.get(v.lower(), v)
    kw.setdefault("max_num_seqs", 32)
    kw.setdefault("max_num_batched_tokens", 512)
    kw.setdefault("num_pages", 2048)
    spec, params, tok = load_model(args.model, progress=False)
    eng = Engine(spec, params, tok, EngineConfig(**kw))
    t0 = time.perf_counter()
    eng.warmup()
    t_warm = time.perf_counter() - t0

    targets = []
    for i in range(args.targets):
        p = (SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=1) if i % 2 == 0 else
             SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=100 + i, logprobs=1))
        targets.append((f"t{i}", tok.encode(PROMPTS[i % len(PROMPTS)]), p))
    alone_t, alone_l = {}, {}
    for rid, ids, p in targets:
        t, lp, _ = run_arrivals(eng, [(rid, ids, p, 0)])
        alone_t.update(t)
        alone_l.update(lp)
    rng = np.random.default_rng(0)
    others = []
    for j in range(args.others):
        n = int(rng.choice([3, 17, 64, 200, 450, 900]))
        others.append((f"o{j}", [int(x) for x in rng.integers(10, 5000, n)],
                       SamplingParams(max_tokens=int(rng.integers(4, 48)), temperature=0), int(rng.integers(0, 12))))
    loaded_reqs = others + [(rid, ids, p, int(rng.integers(0, 10))) for rid, ids, p in targets]
    t0 = time.perf_counter()
    lt, ll, steps = run_arrivals(eng, loaded_reqs)
    dt = time.perf_counter() - t0
    n_out = sum(len(v) for v in lt.values())

    rows = []
    for rid, _, p in targets:
        a, b = alone_t[rid], lt[rid]
        first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
        common = len(a) if first is None else first
        dlp = max((abs(x - y) for x, y in zip(alone_l[rid][:common], ll[rid][:common])), default=0.0)
        rows.append({"id": rid, "kind": "greedy" if p.temperature == 0 else "seeded", "identical": first is None,
                     "first_diff": first, "tokens": len(a), "max_dlogprob_common": float(dlp)})
    same = sum(r["identical"] for r in rows)
    print(f"platform {jax.devices()[0].platform} ({jax.devices()[0].device_kind}); engine {kw}; warm-up {t_warm:.1f} s")
    print("| target | kind | identical | first diff | tokens | max dlogprob (common prefix) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['id']} | {r['kind']} | {r['identical']} | {r['first_diff']} | {r['tokens']} | "
              f"{r['max_dlogprob_common']:.2e} |")
    print(f"identical: {same} / {len(rows)}; loaded run {steps} steps, {n_out} output tokens in {dt:.2f} s "
          f"({n_out / dt:.0f} tok/s)")
    if args.out:
        write_json(args.out, {"platform": jax.devices()[0].platform, "device": jax.devices()[0].device_kind,
                              "engine": kw, "rows": rows, "identical": same, "targets": len(rows),
                              "loaded_steps": steps, "loaded_tokens": n_out, "loaded_s": dt, "warmup_s": t_warm})


if __name__ == "__main__":
    main()
