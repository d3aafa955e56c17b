"""Sampler cost per decode step: the step program's sampling (tbjax.sampling.sample, branchless on GPU) against the
parts it is made of and against variants, at Llama-3.1-8B's vocabulary, so that the sampler's share of a decode step
is known (the one-program step's profile showed ~0.5 ms of reductions over [32, 128k] per step on an H100).

Each variant is one jitted function of [B, V] f32 logits and the per-row sampling parameters, timed on device
(median of `--reps` back-to-back calls after a warm-up, blocking once). Rows are all greedy, all sampled with
temperature 0.7 / top_p 0.9, or temperature 1 with no filter.

    python benchmarks/bench_sampler.py --batches 32,256 --vocab 128256 --out out/sampler.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_common import run_info, write_json  # noqa: E402
from tbjax import sampling  # noqa: E402


def variants():
    def current(lg, t, k, p, m, s, pos):
        return sampling.sample(lg, t, k, p, m, s, pos, branchless=True)

    def greedy_only(lg, t, k, p, m, s, pos):
        x = lg.astype(jnp.float32)
        return jnp.argmax(x, axis=-1).astype(jnp.int32), jax.nn.log_softmax(x, axis=-1)

    def argmax_only(lg, t, k, p, m, s, pos):
        return jnp.argmax(lg, axis=-1).astype(jnp.int32), lg[:, :1]

    def keep_threshold(lg, t, k, p, m, s, pos):
        x = lg / jnp.where(t > 0, t, 1.0)[:, None]
        lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)
        return sampling._keep_by_threshold(x, lse, k, p, m).sum(-1), lg[:, :1]

    def keep_threshold_mat(lg, t, k, p, m, s, pos):
        x = lg / jnp.where(t > 0, t, 1.0)[:, None]
        lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)
        return sampling._keep_by_threshold(x, lse, k, p, m, materialize=True).sum(-1), lg[:, :1]

    def keep_threshold_bits(bits, shared_mask=False):
        def f(lg, t, k, p, m, s, pos):
            x = lg / jnp.where(t > 0, t, 1.0)[:, None]
            lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)
            return sampling._keep_by_threshold(x, lse, k, p, m, bits=bits, shared_mask=shared_mask).sum(-1), lg[:, :1]
        return f

    def gumbel_only(lg, t, k, p, m, s, pos):
        keys = jax.vmap(sampling._row_key)(s, pos)
        g = jax.vmap(lambda kk: jax.random.gumbel(kk, (lg.shape[1],), jnp.float32))(keys)
        return jnp.argmax(lg + g, axis=-1).astype(jnp.int32), lg[:, :1]

    def top64(lg, t, k, p, m, s, pos):
        v, i = sampling.top_k(lg, 64)
        return i[:, 0], v

    def top20(lg, t, k, p, m, s, pos):
        v, i = sampling.top_k(jax.nn.log_softmax(lg, axis=-1), 20)
        return i[:, 0], v
    out = {"current": current, "greedy_logsoftmax": greedy_only, "argmax": argmax_only,
           "keep_threshold": keep_threshold, "keep_threshold_mat": keep_threshold_mat, "gumbel": gumbel_only,
           "top64": top64, "top20_logprobs": top20}
    for bits in (1, 2, 4, 8):
        out[f"keep_threshold_b{bits}"] = keep_threshold_bits(bits)
    out["keep_threshold_shared"] = keep_threshold_bits(4, shared_mask=True)   # one mask for count and sum
    return out


def time_fn(fn, args, reps: int) -> dict:
    f = jax.jit(fn)
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    compile_s = time.perf_counter() - t0
    for _ in range(3):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        o = None
        for _ in range(reps):
            o = f(*args)
        jax.block_until_ready(o)
        ts.append((time.perf_counter() - t0) / reps)
    return {"us": statistics.median(ts) * 1e6, "min_us": min(ts) * 1e6, "first_call_s": compile_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--modes", default="greedy,topp,plain")
    ap.add_argument("--variants", default="", help="comma list (default all)")
    ap.add_argument("--time-budget", type=float, default=120.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t_start = time.perf_counter()
    rng = np.random.default_rng(0)
    vs = variants()
    if args.variants:
        vs = {k: vs[k] for k in args.variants.split(",")}
    rows, res = [], {"info": run_info(), "device": str(jax.devices()[0].device_kind), "vocab": args.vocab,
                     "results": []}
    for B in [int(b) for b in args.batches.split(",")]:
        lg = jnp.asarray(rng.standard_normal((B, args.vocab), np.float32) * 3.0)
        for mode in args.modes.split(","):
            temp = {"greedy": 0.0, "topp": 0.7, "plain": 1.0}[mode]
            top_p = 0.9 if mode == "topp" else 1.0
            a = (lg, jnp.full((B,), temp, jnp.float32), jnp.zeros((B,), jnp.int32), jnp.full((B,), top_p, jnp.float32),
                 jnp.zeros((B,), jnp.float32), jnp.arange(B, dtype=jnp.int32), jnp.full((B,), 7, jnp.int32))
            for name, fn in vs.items():
                if time.perf_counter() - t_start > args.time_budget:
                    res["skipped"] = "time budget"
                    break
                try:
                    r = time_fn(fn, a, args.reps)
                except Exception as e:  # noqa: BLE001 - a failing variant is reported, the rest still run
                    r = {"error": repr(e)[:300]}
                r.update(batch=B, mode=mode, variant=name)
                res["results"].append(r)
                us, mn = r.get("us", float("nan")), r.get("min_us", float("nan"))
                rows.append(f"| {B} | {mode} | {name} | {us:.1f} | {mn:.1f} |")
                print(rows[-1], flush=True)
    print("| B | rows | variant | us (median) | us (min) |\n|---|---|---|---|---|\n" + "\n".join(rows))
    if args.out:
        write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
