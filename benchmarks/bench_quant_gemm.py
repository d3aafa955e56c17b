"""Decode-sized GEMMs with quantized weights, timed against bf16 and the copy ceiling in one run.

Why this exists: the fp8 Llama-8B decode step reads half the bytes of the bf16 one but took 0.77-0.96x its time
(H100, 2026-12-06): the projections do not stream fp8 weights at the rate they stream bf16. This script times each
way a projection can read a quantized weight at decode token counts, on the Llama-3.1-8B projection shapes, as a
sweep over distinct per-layer weights (so nothing stays in L2) the way a step reads them:

  bf16         x @ w, bf16 weights (the baseline)
  fp8_cvt      (x @ convert(q)) * s: per-channel fp8 codes converted to bf16 inside XLA's GEMM (the engine's
               `channel_dot`)
  fp8_f16      the same with f16 activations (e4m3 -> f16 is one hardware conversion)
  w8a8_kn      x quantized per token to e4m3 (amax / 448), an fp8 x fp8 GEMM (tensor cores), both scales on the
               float32 result; codes stored [K, N]
  w8a8_nk      the same with codes stored [N, K] (contracting axis minor, what cuBLASLt's fp8 GEMM takes)
  int8_cvt     per-channel int8 codes converted inside the GEMM
  kernel_fp8   the decode weight-streaming kernel (pallas_kernels.matmul), fp8 with 128 x 128 block scales

Each row: ms per sweep, weight GB/s, fraction of the copy ceiling measured in the same run, the max relative error
against a float32 reference of the same quantized weights (w8a8 adds its activation rounding), and which GEMM the
compiled program calls (cuBLAS, cuBLASLt fp8, Triton, the kernel).

    python benchmarks/bench_quant_gemm.py --json benchmarks/results/quant_gemm_h200_$(git rev-parse --short HEAD).json
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_common import write_json  # noqa: E402

F8 = jnp.float8_e4m3fn
F8_MAX = 448.0
# Llama-3.1-8B projections [K, N]: fused qkv, o, fused gate+up, down
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
VARIANTS = ("bf16", "fp8_cvt", "fp8_f16", "w8a8_kn", "w8a8_nk", "int8_cvt", "kernel_fp8")


def _time(fn, args, iters: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def copy_ceiling(nbytes: int = 1 << 31) -> float:
    """Bytes read + written per second by an elementwise XLA copy of a bf16 buffer (TB/s): the rate the other
    benchmarks' MBU divides by (a GEMM reading weights at this rate streams them as fast as HBM moves a copy)."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 2)
    t = _time(f, (x,), 10)
    return 2 * nbytes / t / 1e12


def _gemm_kinds(compiled_text: str) -> str:
    kinds = []
    for pat, name in (("__cublas\\$lt\\$matmul\\$f8", "cublasLt-f8"), ("__cublas\\$lt\\$matmul\"", "cublasLt"),
                      ("__cublas\\$gemm", "cublas"), ("__triton_gemm", "triton-gemm"), ("triton_softmax", "triton"),
                      ("mosaic_gpu", "mosaic"), ("__gpu\\$xla\\.gpu\\.triton", "pallas-triton")):
        n = len(re.findall(pat, compiled_text))
        if n:
            kinds.append(f"{name}x{n}")
    return ",".join(kinds) or "?"


def quant_x(x_MK):
    """Per-token e4m3 activations: (codes, scale [M, 1] float32)."""
    xf = x_MK.astype(jnp.float32)
    s = jnp.maximum(jnp.max(jnp.abs(xf), axis=1, keepdims=True), 1e-12) / F8_MAX
    return (xf / s).astype(F8), s


def make_fn(variant: str):
    """A jitted sweep: sum over layers of (x @ w_l), float32 [M, N]."""
    if variant == "bf16":
        def one(x, w):
            return jnp.dot(x, w, preferred_element_type=jnp.float32)
    elif variant in ("fp8_cvt", "int8_cvt"):
        def one(x, w):
            q, s = w
            return jnp.dot(x, q.astype(x.dtype), preferred_element_type=jnp.float32) * s
    elif variant == "fp8_f16":
        def one(x, w):
            q, s = w
            return jnp.dot(x.astype(jnp.float16), q.astype(jnp.float16), preferred_element_type=jnp.float32) * s
    elif variant in ("w8a8_kn", "w8a8_nk"):
        contract = ((1,), (0,)) if variant == "w8a8_kn" else ((1,), (1,))

        def one(x, w):
            q, s = w
            xq, sx = quant_x(x)
            y = jax.lax.dot_general(xq, q, (contract, ((), ())), preferred_element_type=jnp.float32)
            return y * sx * s
    elif variant == "kernel_fp8":
        from pallas_kernels.matmul import decode_matmul

        def one(x, w):
            q, s = w
            return decode_matmul(x, q, w_scale=s, impl="gpu", out_dtype=jnp.float32)
    else:
        raise ValueError(variant)

    def sweep(x, ws):
        acc = None
        for w in ws:
            y = one(x, w)
            acc = y if acc is None else acc + y
        return acc
    return jax.jit(sweep)


def make_weights(variant: str, K: int, N: int, layers: int, seed: int):
    """Per-layer weights of one variant, built on the device; also returns bytes read per sweep and a float32
    dequantized copy of layer 0 for the reference."""
    key = jax.random.PRNGKey(seed)
    out, ref0 = [], None
    for i in range(layers):
        wf = jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.float32) * 0.02
        if variant == "bf16":
            w = wf.astype(jnp.bfloat16)
            deq = w.astype(jnp.float32)
        elif variant in ("fp8_cvt", "fp8_f16", "w8a8_kn", "w8a8_nk", "int8_cvt"):
            qmax = 127.0 if variant == "int8_cvt" else F8_MAX
            s = jnp.max(jnp.abs(wf), axis=0, keepdims=True) / qmax          # [1, N]
            if variant == "int8_cvt":
                q = jnp.clip(jnp.round(wf / s), -127, 127).astype(jnp.int8)
            else:
                q = (wf / s).astype(F8)
            deq = q.astype(jnp.float32) * s
            if variant == "w8a8_nk":
                q = q.T.copy()
            w = (q, s)
        elif variant == "kernel_fp8":
            nb_k, nb_n = -(-K // 128), -(-N // 128)
            blk = jnp.pad(wf, ((0, nb_k * 128 - K), (0, nb_n * 128 - N))).reshape(nb_k, 128, nb_n, 128)
            s = jnp.max(jnp.abs(blk), axis=(1, 3)) / F8_MAX                  # [nb_k, nb_n]
            sb = jnp.repeat(jnp.repeat(s, 128, 0), 128, 1)[:K, :N]
            q = (wf / sb).astype(F8)
            deq = q.astype(jnp.float32) * sb
            w = (q, s.astype(jnp.float32))
        else:
            raise ValueError(variant)
        if i == 0:
            ref0 = deq
        out.append(w)
    jax.block_until_ready(out)
    nbytes = sum(a.size * a.dtype.itemsize for w in out for a in (w if isinstance(w, tuple) else (w,)))
    return out, nbytes, ref0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,32", help="decode token counts M")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {list(SHAPES)}")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sweep-mb", type=float, default=1200, help="weight MB per sweep (bf16), beyond the L2")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--time-budget", type=float, default=300)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t_start = time.time()
    ceil = copy_ceiling()
    print(f"device {jax.devices()[0].device_kind}; copy ceiling {ceil:.3f} TB/s (read + write)", flush=True)
    rows = []
    Ms = [int(m) for m in a.tokens.split(",")]
    for shape in a.shapes.split(","):
        K, N = SHAPES[shape]
        layers = max(2, int(a.sweep_mb * 1e6 // (K * N * 2)))
        for variant in a.variants.split(","):
            if time.time() - t_start > a.time_budget:
                print(f"time budget: {shape} {variant} and later skipped", flush=True)
                break
            try:
                ws, nbytes, ref0 = make_weights(variant, K, N, layers, seed=hash(shape) % 1000)
            except Exception as e:  # noqa: BLE001 - a variant this device cannot build is a row, not a crash
                rows.append({"shape": shape, "variant": variant, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"{shape:8s} {variant:10s} build failed: {e}"[:200], flush=True)
                continue
            fn = make_fn(variant)
            for M in Ms:
                x = (jax.random.normal(jax.random.PRNGKey(M), (M, K), jnp.float32)).astype(jnp.bfloat16)
                row = {"shape": shape, "K": K, "N": N, "M": M, "variant": variant, "layers": layers,
                       "weight_bytes": nbytes}
                try:
                    kinds = _gemm_kinds(fn.lower(x, ws).compile().as_text())
                    t = _time(fn, (x, ws), a.iters)
                    y0 = np.asarray(fn(x, ws[:1]), np.float64)
                    ref = np.asarray(x, np.float64) @ np.asarray(ref0, np.float64)
                    err = float(np.max(np.abs(y0 - ref)) / max(np.max(np.abs(ref)), 1e-30))
                    row.update(ms=t * 1e3, TBps=nbytes / t / 1e12, of_ceiling=nbytes / t / 1e12 / ceil,
                               max_rel_err=err, gemm=kinds)
                    print(f"{shape:8s} {variant:10s} M={M:3d}: {t * 1e3:8.3f} ms  {nbytes / t / 1e12:5.2f} TB/s "
                          f"({row['of_ceiling']:.0%} of the copy rate)  err {err:.1e}  {kinds}", flush=True)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(f"{shape:8s} {variant:10s} M={M:3d}: failed {e}"[:200], flush=True)
                rows.append(row)
            del ws
    print("\nper shape and M, time / bf16 time:")
    for shape in a.shapes.split(","):
        for M in Ms:
            base = next((r["ms"] for r in rows if r.get("shape") == shape and r.get("M") == M
                         and r["variant"] == "bf16" and "ms" in r), None)
            cells = [f"{r['variant']} {r['ms'] / base:.2f}" for r in rows
                     if base and r.get("shape") == shape and r.get("M") == M and "ms" in r]
            print(f"  {shape:8s} M={M:3d}: " + "  ".join(cells))
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "copy_ceiling_TBps": ceil,
           "rows": rows, "total_s": time.time() - t_start}
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
