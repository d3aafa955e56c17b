"""fp8 KV vs bf16 KV on the real default model (CPU is fine): how far the outputs move.

For each prompt: greedy continuation with a bf16 KV cache and with fp8 (e4m3fn, e5m2) caches; reports the number
of leading tokens that agree, and for the first sampled token the |difference| of the top-20 logprobs.
Usage: python benchmarks/fp8_kv_quality.py [--tokens 32] [--out F.json]
"""
import argparse
import json

import numpy as np
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import write_json  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,",
           "The three laws of thermodynamics are", "List five fruits:", "In 1969, the first humans"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from tbjax.llm import LLM
    from tbjax.sampling import SamplingParams
    from tbjax.weights import load_model
    spec, params, tok = load_model(None, progress=False)
    p = SamplingParams(max_tokens=a.tokens, temperature=0.0, logprobs=20, ignore_eos=True)
    runs = {}
    for kv in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        llm = LLM.from_parts(spec, params, tok, kv_dtype=kv, num_pages=256, max_num_seqs=8, max_num_batched_tokens=64)
        runs[kv] = llm.generate(PROMPTS, p)
    rows = []
    for kv in ("float8_e4m3fn", "float8_e5m2"):
        agree, diffs = [], []
        for b, f in zip(runs["bfloat16"], runs[kv]):
            n = next((i for i, (x, y) in enumerate(zip(b.token_ids, f.token_ids)) if x != y), len(b.token_ids))
            agree.append(n)
            da, db = dict(b.logprobs[0][1][:5]), dict(f.logprobs[0][1])
            diffs += [abs(da[t] - db[t]) for t in da if t in db]
        rows.append({"kv": kv, "leading_tokens_equal": agree, "mean_equal": float(np.mean(agree)),
                     "first_token_top5_mean_abs_dlogprob": float(np.mean(diffs)),
                     "first_token_top5_max_abs_dlogprob": float(np.max(diffs))})
    print(f"| KV dtype | leading greedy tokens equal to bf16 (of {a.tokens}) | mean | first-token top-5 mean / max |dlogprob| |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['kv']} | {r['leading_tokens_equal']} | {r['mean_equal']:.1f} | "
              f"{r['first_token_top5_mean_abs_dlogprob']:.4f} / {r['first_token_top5_max_abs_dlogprob']:.4f} |")
    if a.out:
        write_json(a.out, rows)


if __name__ == "__main__":
    main()
