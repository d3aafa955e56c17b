"""Probe: per-launch host overhead of Mosaic GPU custom calls inside a decode-like step, under XLA flag variants.

Why it exists: the engine's decode step with the weight-streaming matmul kernel showed ~1.2 ms/step more device idle
time than with XLA dots (benchmarks/RESULTS.md, issue 3/9), although the kernels themselves streamed faster. This
isolates the cause on a toy step of L layers (each: the Mosaic matmul over a [L, D, D] stack read in place, or an
XLA dot, then a residual add and an RMSNorm-like fusion) and measures, per XLA flag variant (one subprocess each):
step time (sync and pipelined), device busy time and span from a profiler trace.

Usage (H200): python3 benchmarks/probe_launch_overhead.py --out $OUT/probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MARK = "PROBE "

VARIANTS = {
    "default": "",
    "cb_custom_call": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
    "cb_custom_call_min1": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
                           "--xla_gpu_graph_min_graph_size=1",
    "cb_off": "--xla_gpu_enable_command_buffer=",
}


def worker(args):
    import jax
    import jax.numpy as jnp
    sys.path.insert(0, REPO)
    sys.path.insert(0, HERE)
    from bench_engine_decode import profile_steps
    from pallas_kernels.matmul import decode_matmul

    L, D, T = args.layers, args.dim, args.tokens
    ws = jax.random.normal(jax.random.key(0), (L, D, D), jnp.bfloat16) * 0.02
    x0 = jax.random.normal(jax.random.key(1), (T, D), jnp.bfloat16)
    out = {"flags": os.environ.get("XLA_FLAGS", ""), "modes": {}}

    def step(x, w, mode):
        for i in range(L):
            if mode == "kernel":
                y = decode_matmul(x, w, layer=i, impl="gpu")
            else:
                y = jnp.dot(x, w[i], preferred_element_type=jnp.float32).astype(x.dtype)
            x = x + y
            x32 = x.astype(jnp.float32)
            x = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)
        return x

    for mode in args.modes.split(","):
        f = jax.jit(step, static_argnums=2)
        t = time.perf_counter()
        jax.block_until_ready(f(x0, ws, mode))
        r = {"compile_s": time.perf_counter() - t}
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            jax.block_until_ready(f(x0, ws, mode))
            ts.append(time.perf_counter() - t)
        ts.sort()
        r["sync_ms"] = 1e3 * ts[len(ts) // 2]
        t = time.perf_counter()
        y = x0
        for _ in range(20):
            y = f(y, ws, mode)
        jax.block_until_ready(y)
        r["pipe_ms"] = 1e3 * (time.perf_counter() - t) / 20
        r["weight_TBps_pipe"] = L * D * D * 2 / (r["pipe_ms"] * 1e-3) / 1e12
        prof = profile_steps(lambda: f(x0, ws, mode), 5, top=6)
        if prof.get("lines"):
            ln = prof["lines"][0]
            r["busy_us"], r["span_us"], r["events"] = ln["busy_us_per_step"], ln["span_us_per_step"], ln["events_per_step"]
            r["top"] = ln["top"]
        out["modes"][mode] = r
        print(f"  {mode}: {r}", file=sys.stderr, flush=True)
    print(MARK + json.dumps(out), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--modes", default="kernel,xla")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "layers": a.layers, "dim": a.dim, "tokens": a.tokens,
           "variants": {}}
    for name in a.variants.split(","):
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + VARIANTS[name]).strip())
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--layers", str(a.layers),
                            "--dim", str(a.dim), "--tokens", str(a.tokens), "--modes", a.modes],
                           capture_output=True, text=True, env=env, timeout=300)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
        res["variants"][name] = json.loads(line[-1][len(MARK):]) if line else {"error": p.stderr[-2000:]}
        v = res["variants"][name]
        for mode, r in v.get("modes", {}).items():
            print(f"{name:22s} {mode:7s} sync {r['sync_ms']:.3f} ms pipe {r['pipe_ms']:.3f} ms "
                  f"({r['weight_TBps_pipe']:.2f} TB/s) busy {r.get('busy_us', 0):.0f} us span {r.get('span_us', 0):.0f} "
                  f"events {r.get('events', 0):.0f} compile {r['compile_s']:.1f}s", flush=True)
        if "error" in v:
            print(f"{name}: error {v['error'][-500:]}", flush=True)
    if a.out:
        write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
