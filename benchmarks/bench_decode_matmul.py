"""Benchmark (issue 9): weight bytes read per second by the decode matmuls, kernel vs XLA, on a GPU.

What it measures, all in one process and one run so ratios are comparable:
  1. ceiling: a large device-to-device copy (torch, read + write bytes) and a JAX copy;
  2. sweep:   Llama-3.1-8B (4096x{6144 qkv, 4096 o, 28672 gate/up, 14336 down}) and DeepSeek-V3
              expert (7168x2048, 2048x7168) shapes at T = 1, 8, 32, 64, 128, bf16 and fp8 (128x128
              block scales): the Mosaic GPU kernel (layers read in place from a stack) vs the best
              XLA arrangement of the issue's table (a Python loop of jnp.dot over separate arrays;
              fp8: dequantize to bf16 then dot). Every kernel result is checked against XLA's.
  3. loops:   the layer-loop question on 4096x14336 bf16, 16 layers: Python loop / fori_loop with a
              layer index / scan over stacked weights / scan(unroll=True), with the kernel and XLA dot;
  4. fused:   gate_up_silu (two matrices, one launch) vs two decode_matmul calls + XLA silu*mul;
  5. tune:    a few tile configurations on one shape;
  6. flags:   (subprocess) the XLA loop variants again under default XLA flags (the main
              process runs with --xla_gpu_enable_triton_gemm=false).
  variants:   kernel options (TileConfig fields) against the auto plan on a few shapes, each checked
              against the reference (VARIANT_SHAPES=name:dtype,... picks the shapes).
  fsmoke:     the one-launch kernel modes (gpu_fused.py: "direct", "sem") against the reference, run twice;
              modes that pass are appended to $OUT/fsmoke_modes (run it in its own process first).
  percall:    per-call time (us per layer) of the small and big shapes at T = 1, 8, 32, 64 (PERCALL_TS):
              "old" = kernel + float32 partials + XLA epilogue, "direct"/"sem" = one-launch kernels
              (bf16 out), "direct+pdl" = direct with programmatic dependent launch, "dispatch" = the
              library entry point with its defaults, XLA dots (triton on / cuBLAS); PERCALL_MODES /
              PERCALL_SHAPES (+ "floor", a 1024x1024 launch-floor probe) pick; each checked against
              the reference.
  smoke:      fp8 unscaled / per-channel / block-scaled and bf16, each against the reference
              (SMOKE_KINDS picks; exit code 3 if one fails). tune: a few tile configurations.
Each timed call runs L layers (L chosen so a call streams >= ~1.5 GB, far above the 50 MB L2);
10 calls are queued back to back and timed together (host dispatch hidden), median of 3.

The sweep's XLA column is the better of two executables compiled in this process: triton GEMM on
(XLA's default) and off (cuBLAS), set per executable with compile(compiler_options=...).
Run: python3 benchmarks/bench_decode_matmul.py --out DIR   (DIR gets bench_decode_matmul.json)
     e.g. --sections ceiling,variants,sweep --fp8-shapes llama --no-kernel-only --stream-gb 0.45
     --dry: tiny shapes in interpret mode on CPU, to check the script itself.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cuda_copy_seconds, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LLAMA = [("llama8b.qkv", 4096, 6144), ("llama8b.o", 4096, 4096), ("llama8b.gate_up", 4096, 28672),
         ("llama8b.down", 14336, 4096)]
DSV3 = [("dsv3.expert_up", 7168, 2048), ("dsv3.expert_down", 2048, 7168)]
TS = (1, 8, 32, 64, 128)
T0 = time.perf_counter()
RESULTS: dict = {"rows": [], "loops": [], "fused": [], "percall": [], "fsmoke": [], "tune": [], "smoke": [], "variants": [], "errors": []}
OUT_NAME = "bench_decode_matmul.json"


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def save(out_dir):
    if out_dir:
        write_json(os.path.join(out_dir, OUT_NAME), RESULTS)


def torch_copy_ceiling(nbytes=4 << 30):
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
        b = torch.empty_like(a)
        t = statistics.median(cuda_copy_seconds(b, a, warmup=3, reps=5, inner=5))
        del a, b
        torch.cuda.empty_cache()
        return {"what": "torch D2D copy, read+write bytes", "bytes": 2 * nbytes, "s": t, "TBps": 2 * nbytes / t / 1e12}
    except Exception as e:  # noqa: BLE001 - the ceiling is optional
        return {"error": repr(e)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--sections", default="ceiling,sweep,loops,fused,tune,flags")
    ap.add_argument("--default-flags", action="store_true", help="don't set the library's XLA flags")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting sweep rows after this")
    ap.add_argument("--dtypes", default="bf16,fp8", help="weight dtypes for sweep/fused/tune")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name")
    ap.add_argument("--fp8-shapes", default="all", help="sweep: 'all' or 'llama' (fp8 rows only on Llama shapes)")
    ap.add_argument("--ts", default=",".join(map(str, TS)), help="sweep: T values")
    ap.add_argument("--no-kernel-only", action="store_true", help="sweep: skip the kernel-alone column")
    ap.add_argument("--stream-gb", type=float, default=1.5, help="weight GB streamed per timed call")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    dtypes = [dt == "fp8" for dt in args.dtypes.split(",")]   # [False]=bf16, [True]=fp8
    global OUT_NAME
    OUT_NAME = f"bench_decode_matmul{('_' + args.tag) if args.tag else ''}.json"
    if args.dry:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from pallas_kernels.matmul.flags import GPU_NO_TRITON_GEMM, merged_xla_flags
    if not args.default_flags and not args.dry:
        # The main process runs XLA with cuBLAS for its dots (the best XLA setting at T>=8);
        # the "flags" section re-runs the XLA loops with default flags in a subprocess.
        os.environ["XLA_FLAGS"] = merged_xla_flags(os.environ.get("XLA_FLAGS"), extra=(GPU_NO_TRITON_GEMM,))
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")
    RESULTS["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    if "ceiling" in sections and not args.dry:
        RESULTS["torch_copy"] = torch_copy_ceiling()
        log("torch copy", RESULTS["torch_copy"])

    import numpy as np
    import jax
    import jax.numpy as jnp
    from pallas_kernels.matmul import gpu, tpu, reference

    dry = args.dry
    interp = jax.default_backend() != "gpu"
    nsm = 4 if interp else None
    RESULTS["device"] = str(jax.devices()[0].device_kind)
    RESULTS["jax"] = jax.__version__
    log("device", RESULTS["device"], "flags", RESULTS["xla_flags"])
    n_calls, n_meas = (1, 1) if dry else (10, 3)

    def timeit(fn, *a):
        out = fn(*a)
        jax.block_until_ready(out)
        ts = []
        for _ in range(n_meas):
            t = time.perf_counter()
            for _ in range(n_calls):
                out = fn(*a)
            jax.block_until_ready(out)
            ts.append((time.perf_counter() - t) / n_calls)
        return statistics.median(ts), out

    key = [jax.random.key(int(time.time()))]

    def rnd(shape, dtype, scale=1.0):
        key[0], k = jax.random.split(key[0])
        return (jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype)

    def make_weights(L, d, f, fp8):
        if fp8:
            w = rnd((L, d, f), jnp.float8_e4m3fn, 8.0)
            key[0], k = jax.random.split(key[0])
            s = jax.random.uniform(k, (L, -(-d // 128), -(-f // 128)), jnp.float32, 0.5, 1.5) / (8 * math.sqrt(d))
            return w, s
        return rnd((L, d, f), jnp.bfloat16, 1 / math.sqrt(d)), None

    if "ceiling" in sections:
        n = (1 << 28) if not dry else (1 << 16)
        a = rnd((n,), jnp.bfloat16)
        cp = jax.jit(lambda a: a * 1.0001)
        t, _ = timeit(cp, a)
        RESULTS["jax_copy"] = {"what": "jax elementwise x*c, read+write", "bytes": 4 * n, "s": t, "TBps": 4 * n / t / 1e12}
        log("jax copy", RESULTS["jax_copy"])
        del a
    ceil_tb = (RESULTS.get("torch_copy") or {}).get("TBps") or (RESULTS.get("jax_copy") or {}).get("TBps") or 1.0

    def layers_for(nbytes):
        if dry:
            return 2
        return int(min(48, max(6, math.ceil(args.stream_gb * 1e9 / nbytes))))

    # ---- building blocks ------------------------------------------------------------------
    def kernel_stack_fn(L, cfg=None):
        """Python loop over layers; each call reads layer l of the stack in place (inner jit: lowered once)."""
        @jax.jit
        def one(x, w, s, l):
            return gpu.decode_matmul_gpu(x, w, w_scale=s, layer=l, cfg=cfg, num_sms=nsm, interpret=interp)

        @jax.jit
        def f(x, w, s):
            return jnp.stack([one(x, w, s, jnp.int32(l)) for l in range(L)])
        return f

    def kernel_only_fn(L, cfg=None):
        """The kernel alone (x pre-padded, partials returned unreduced): no pad/epilogue XLA ops."""
        @jax.jit
        def one(xp, w, s, l):
            return gpu.raw_partials(xp, [w], [s], layer=l, cfg=cfg, num_sms=nsm, interpret=interp,
                                    x_padded=True)[0]

        @jax.jit
        def f(xp, w, s):
            return tuple(one(xp, w, s, jnp.int32(l)) for l in range(L))
        return f

    def xla_list_fn(fp8):
        @jax.jit
        def f(x, ws, ss):
            if fp8:
                return jnp.stack([tpu.decode_matmul_xla(x, w, w_scale=s) for w, s in zip(ws, ss)])
            return jnp.stack([jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype) for w in ws])
        return f

    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(min(14, os.cpu_count() or 8))

    def precompile(jobs):
        """[(jitted fn, args[, compiler options])] -> [compiled or exception]: lower here, compile on
        threads (C++ releases the GIL). Options (e.g. {"xla_gpu_enable_triton_gemm": False}) apply
        to that one executable, so XLA variants under different flags run in one process."""
        lowered = []
        for fn, a, *opt in jobs:
            try:
                lowered.append((fn.lower(*a), opt[0] if opt else None))
            except Exception as e:  # noqa: BLE001
                lowered.append(e)

        def comp(lo):
            if isinstance(lo, Exception):
                return lo
            try:
                return lo[0].compile(compiler_options=lo[1]) if lo[1] else lo[0].compile()
            except Exception as e:  # noqa: BLE001
                return e
        return list(pool.map(comp, lowered))

    def relerr(a, b):
        a = np.asarray(a, np.float32)
        b = np.asarray(b, np.float32)
        if np.isnan(a).any():
            return float("nan")
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    def timed_stacks(rows, jobs, w, s, bytes_per_layer, L, ceil_tb=None):
        """Compile `jobs` (one per (row, x) of `rows`), time each over (x, w, s) and check its last layer against the
        reference: yields each row with TBps (and frac_ceiling of `ceil_tb`) and relerr_vs_reference, or error."""
        for (row, x), ck in zip(rows, precompile(jobs)):
            try:
                if isinstance(ck, Exception):
                    raise ck
                t, y = timeit(ck, x, w, s)
                row["TBps"] = bytes_per_layer * L / t / 1e12
                if ceil_tb is not None:
                    row["frac_ceiling"] = row["TBps"] / ceil_tb
                r = reference.decode_matmul_reference(x, w[L - 1], w_scale=None if s is None else s[L - 1])
                row["relerr_vs_reference"] = relerr(y[L - 1], r)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:500]
            yield row

    def over_budget(what):
        if time.perf_counter() - T0 > args.budget_s:
            RESULTS["errors"].append(f"time budget reached: skipped {what}")
            return True
        return False

    # ---- 1b. smoke: fp8 without scales, per-channel, block (in this order: a crash names its kind) --
    if "smoke" in sections:
        d, f, T = (4096, 4096, 8) if not dry else (256, 384, 5)
        for kind in os.environ.get("SMOKE_KINDS", "none,channel,block,bf16").split(","):
            row = {"kind": kind, "D": d, "F": f, "T": T}
            try:
                x = rnd((T, d), jnp.bfloat16)
                if kind == "bf16":
                    w, s = rnd((d, f), jnp.bfloat16, 1 / math.sqrt(d)), None
                else:
                    w = rnd((d, f), jnp.float8_e4m3fn, 8.0)
                    s = {"none": None,
                         "channel": jnp.full((f,), 1 / (8 * math.sqrt(d)), jnp.float32),
                         "block": jnp.full((-(-d // 128), -(-f // 128)), 1 / (8 * math.sqrt(d)), jnp.float32)}[kind]
                y = jax.jit(lambda x, w, s: gpu.decode_matmul_gpu(x, w, w_scale=s, num_sms=nsm, interpret=interp))(x, w, s)
                r = reference.decode_matmul_reference(x, w, w_scale=s)
                row["relerr_vs_reference"] = relerr(y, r)
                row["nan"] = int(np.isnan(np.asarray(y, np.float32)).sum())
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:400]
            RESULTS["smoke"].append(row)
            log(json.dumps(row))
            save(args.out)

    # ---- 1c. variants: kernel options against the auto plan, one shape at a time ------------
    if "variants" in sections:
        import dataclasses as dc
        R = dc.replace
        # run 1 (git 2ffd1d1) compared f16 / rows128 / cta2 / d256 / f64-cta2 / ws2 variants against
        # the bf16-folding fp8 path and tile choices for bf16; these are the follow-ups
        fp8_vars = [("auto", lambda b: b), ("8bit", lambda b: R(b, deq_layout="8bit")),
                    ("8bit-rows64", lambda b: R(b, deq_layout="8bit", deq_rows=64)),
                    ("8bit-ws2-f256", lambda b: R(b, deq_layout="8bit", tile_f=256, n_wg=2, smem_budget=224 * 1024)),
                    ("8bit-d256", lambda b: R(b, deq_layout="8bit", tile_d=256, deq_rows=128)),
                    ("fold-bf16", lambda b: R(b, fp8_via="bf16", deq_rows=64))]
        bf16_vars = [("auto", lambda b: b), ("f128-d128", lambda b: R(b, tile_d=128, tile_f=128)),
                     ("f64-d256", lambda b: R(b, tile_d=256, tile_f=64)),
                     ("f64-d128", lambda b: R(b, tile_d=128, tile_f=64))]
        var_env = os.environ.get("VARIANT_SHAPES")
        specs = ([("llama8b.o", 4096, 4096, True, (8, 64)), ("llama8b.gate_up", 4096, 28672, True, (8, 64)),
                  ("llama8b.qkv", 4096, 6144, False, (32, 64)), ("llama8b.gate_up", 4096, 28672, False, (64,)),
                  ("dsv3.expert_down", 2048, 7168, False, (64,))]
                 if not dry else [("tiny", 256, 512, True, (8,)), ("tiny", 256, 512, False, (8,))])
        if var_env:
            specs = [sp for sp in specs if f"{sp[0]}:{'fp8' if sp[3] else 'bf16'}" in var_env.split(",")]
        for name, d, f, fp8, vts in specs:
            if over_budget(f"variants {name}"):
                break
            L = layers_for(d * f * (1 if fp8 else 2))
            w, s = make_weights(L, d, f, fp8)
            jobs, rows = [], []
            for T in vts:
                x = rnd((T, d), jnp.bfloat16)
                base, _ = gpu.plan_for(x, [w], [s], None, nsm)
                for vname, mk in (fp8_vars if fp8 else bf16_vars):
                    row = {"shape": name, "D": d, "F": f, "T": T, "dtype": "fp8-block" if fp8 else "bf16",
                           "variant": vname, "L": L}
                    cfg = mk(base) if base is not None else None
                    c, plan = gpu.plan_for(x, [w], [s], cfg, nsm)
                    if c is None:
                        row["skip"] = plan
                        RESULTS["variants"].append(row)
                        continue
                    row["cfg"] = dataclass_dict(c)
                    row["plan"] = [plan.stages, plan.n_ctas, plan.n_per, plan.n_slots]
                    rows.append((row, x))
                    jobs.append((kernel_stack_fn(L, c), (x, w, s)))
            for row in timed_stacks(rows, jobs, w, s, d * f * (1 if fp8 else 2), L, ceil_tb):
                RESULTS["variants"].append(row)
                log(json.dumps({k: v for k, v in row.items() if k != "cfg"}))
                save(args.out)
            del w, s

    # ---- 2. sweep --------------------------------------------------------------------------
    shapes = LLAMA + DSV3 if not dry else [("tiny.a", 256, 384), ("tiny.b", 512, 256)]
    ts = tuple(int(v) for v in args.ts.split(",")) if not dry else (1, 13)
    # Per-executable XLA options: the process's XLA_FLAGS turn triton GEMM off, so the default-flags
    # variant must turn it back on explicitly (run 4dfb16d missed this: both XLA columns were cuBLAS).
    NO_TRITON = {"xla_gpu_enable_triton_gemm": False}
    TRITON = {"xla_gpu_enable_triton_gemm": True}
    if "sweep" in sections:
        anchored = set()
        for fp8, (name, d, f) in [(fp8, sh) for fp8 in dtypes for sh in shapes]:   # all bf16 rows first
            if True:
                if fp8 and args.fp8_shapes == "llama" and not name.startswith(("llama", "tiny")):
                    continue
                itemsize = 1 if fp8 else 2
                bytes_layer = d * f * itemsize + (4 * math.ceil(d / 128) * math.ceil(f / 128) if fp8 else 0)
                L = layers_for(bytes_layer)
                w, s = make_weights(L, d, f, fp8)
                ws = [w[l] for l in range(L)]           # separate arrays for XLA's best arrangement
                ss = [s[l] for l in range(L)] if fp8 else [None] * L
                ws = [jnp.array(a, copy=True) for a in ws]
                jax.block_until_ready(ws)
                if time.perf_counter() - T0 > args.budget_s:
                    RESULTS["errors"].append(f"budget reached before {name} fp8={fp8}")
                    continue
                xs = {T: rnd((T, d), jnp.bfloat16) for T in ts}
                xps = {T: jnp.pad(xs[T], ((0, gpu.padded_t(T) - T), (0, 0))) for T in ts}
                xla_f = xla_list_fn(fp8)
                ker_f = kernel_stack_fn(L)
                kon_f = kernel_only_fn(L)
                jobs = []
                for T in ts:
                    jobs += [(xla_f, (xs[T], ws, ss), None if dry else TRITON),
                             (xla_f, (xs[T], ws, ss), None if dry else NO_TRITON),
                             (ker_f, (xs[T], w, s)),
                             (kon_f, (xps[T], w, s)) if not args.no_kernel_only else (None, None)]
                comp = precompile([j for j in jobs if j[0] is not None])
                comp_it = iter(comp)
                comp = [next(comp_it) if j[0] is not None else ValueError("not run") for j in jobs]
                for ti, T in enumerate(ts):
                    row = {"shape": name, "D": d, "F": f, "dtype": "fp8-block" if fp8 else "bf16", "T": T,
                           "L": L, "bytes_per_layer": bytes_layer}
                    x = xs[T]
                    cx, cx2, ck, co = comp[4 * ti:4 * ti + 4]
                    try:
                        cfg, plan = gpu.plan_for(x, [w], [s], None, nsm if nsm else None)
                        row["cfg"] = None if cfg is None else [cfg.tile_d, cfg.tile_f, plan.stages, plan.n_ctas,
                                                               plan.n_slots, cfg.ctas_per_sm, cfg.fp8_via]
                        if isinstance(cx, Exception):
                            raise cx
                        # best XLA variant: Python loop of dots, triton GEMM on (XLA's default) or off
                        tx, yx = timeit(cx, x, ws, ss)
                        row["xla_triton_TBps"] = bytes_layer * L / tx / 1e12
                        if not isinstance(cx2, Exception):
                            tx2, yx2 = timeit(cx2, x, ws, ss)
                            row["xla_no_triton_TBps"] = bytes_layer * L / tx2 / 1e12
                            if tx2 < tx:
                                tx, yx = tx2, yx2
                        row["xla_s_per_layer"] = tx / L
                        row["xla_TBps"] = bytes_layer * L / tx / 1e12
                        if isinstance(ck, Exception):
                            raise ck
                        tk, yk = timeit(ck, x, w, s)
                        row["kernel_s_per_layer"] = tk / L
                        row["kernel_TBps"] = bytes_layer * L / tk / 1e12
                        row["kernel_frac_ceiling"] = row["kernel_TBps"] / ceil_tb
                        row["speedup_vs_xla"] = tx / tk
                        row["relerr_vs_xla"] = relerr(yk, yx)
                        if args.no_kernel_only:
                            pass
                        elif not isinstance(co, Exception):
                            to, _ = timeit(co, xps[T], w, s)
                            row["kernel_only_s_per_layer"] = to / L
                            row["kernel_only_TBps"] = bytes_layer * L / to / 1e12
                        else:
                            row["kernel_only_error"] = repr(co)[:300]
                        if (fp8, T) not in anchored and T in (1, 13, 64):
                            r = reference.decode_matmul_reference(x, w[L - 1], w_scale=None if s is None else s[L - 1])
                            row["relerr_vs_reference"] = relerr(yk[L - 1], r)
                            anchored.add((fp8, T))
                    except Exception as e:  # noqa: BLE001 - keep going, record the failure
                        row["error"] = repr(e)[:500]
                    RESULTS["rows"].append(row)
                    log(json.dumps(row))
                    save(args.out)
                del w, s, ws, ss

    # ---- 3. layer loops --------------------------------------------------------------------
    if "loops" in sections and not over_budget("loops"):
        d, f, L = (4096, 14336, 16) if not dry else (256, 384, 2)
        w, _ = make_weights(L, d, f, False)
        ws = [jnp.array(w[l], copy=True) for l in range(L)]
        bytes_all = L * d * f * 2

        def k1(x, wl):
            return gpu.decode_matmul_gpu(x, wl, num_sms=nsm, interpret=interp)
        k1j = jax.jit(k1)

        def kl(x, w, l):
            return gpu.decode_matmul_gpu(x, w, layer=l, num_sms=nsm, interpret=interp)
        klj = jax.jit(kl)

        def x1(x, wl):
            return jnp.dot(x, wl, preferred_element_type=jnp.float32).astype(x.dtype)

        variants = {
            "kernel.python_loop.separate_arrays": (jax.jit(lambda x, ws: jnp.stack([k1j(x, a) for a in ws])), "list"),
            "kernel.python_loop.stack_layer_index": (jax.jit(lambda x, w: jnp.stack([klj(x, w, jnp.int32(l)) for l in range(L)])), "stack"),
            "kernel.fori_loop.stack_layer_index": (jax.jit(lambda x, w: jax.lax.fori_loop(
                0, L, lambda l, acc: acc.at[l].set(kl(x, w, l)), jnp.zeros((L, x.shape[0], f), x.dtype))), "stack"),
            "kernel.scan.stacked_xs": (jax.jit(lambda x, w: jax.lax.scan(lambda c, wl: (c, k1(x, wl)), 0, w)[1]), "stack"),
            "kernel.scan_unroll.stacked_xs": (jax.jit(lambda x, w: jax.lax.scan(lambda c, wl: (c, k1(x, wl)), 0, w, unroll=True)[1]), "stack"),
            "xla.python_loop.separate_arrays": (jax.jit(lambda x, ws: jnp.stack([x1(x, a) for a in ws])), "list"),
            "xla.fori_loop.stack_dynamic_index": (jax.jit(lambda x, w: jax.lax.fori_loop(
                0, L, lambda l, acc: acc.at[l].set(x1(x, w[l])), jnp.zeros((L, x.shape[0], f), x.dtype))), "stack"),
            "xla.scan.stacked_xs": (jax.jit(lambda x, w: jax.lax.scan(lambda c, wl: (c, x1(x, wl)), 0, w)[1]), "stack"),
            "xla.scan_unroll.stacked_xs": (jax.jit(lambda x, w: jax.lax.scan(lambda c, wl: (c, x1(x, wl)), 0, w, unroll=True)[1]), "stack"),
        }
        only_xla = args.default_flags
        for T in ((1, 32) if not dry else (1,)):
            x = rnd((T, d), jnp.bfloat16)
            base = None
            for vname, (fn, kind) in variants.items():
                if only_xla and not vname.startswith("xla."):
                    continue
                row = {"variant": vname, "T": T, "L": L, "D": d, "F": f, "flags": RESULTS["xla_flags"]}
                try:
                    t, y = timeit(fn, x, ws if kind == "list" else w)
                    row["s_per_layer"] = t / L
                    row["TBps"] = bytes_all / t / 1e12
                    if base is None:
                        base = y
                    row["relerr_vs_first"] = relerr(y, base)
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:500]
                RESULTS["loops"].append(row)
                log(json.dumps(row))
                save(args.out)
        del w, ws

    # ---- 6. XLA under default flags (subprocess) -------------------------------------------
    if "flags" in sections and not args.default_flags and not over_budget("flags"):
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)
        cmd = [sys.executable, os.path.abspath(__file__), "--sections", "loops", "--default-flags", "--out", ""]
        if dry:
            cmd.append("--dry")
        try:
            left = args.budget_s + 90 - (time.perf_counter() - T0)
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(30.0, min(240.0, left)))
            rows = [json.loads(line.split("] ", 1)[1]) for line in p.stdout.splitlines()
                    if "] {" in line and '"variant"' in line]
            RESULTS["loops_default_flags"] = rows
            if p.returncode:
                RESULTS["errors"].append(p.stderr[-2000:])
        except Exception as e:  # noqa: BLE001
            RESULTS["errors"].append(repr(e))
        save(args.out)

    # ---- 4. fused gate/up ------------------------------------------------------------------
    if "fused" in sections and not over_budget("fused"):
        d, f = (4096, 14336) if not dry else (256, 256)
        for fp8 in dtypes:
            itemsize = 1 if fp8 else 2
            L = layers_for(2 * d * f * itemsize)
            wg, sg = make_weights(L, d, f, fp8)
            wu, su = make_weights(L, d, f, fp8)
            bytes_all = 2 * L * d * f * itemsize

            @jax.jit
            def fused_one(x, wg, wu, sg, su, l):
                return gpu.gate_up_silu_gpu(x, wg, wu, gate_scale=sg, up_scale=su, layer=l, num_sms=nsm, interpret=interp)

            @jax.jit
            def mm_one(x, w, s, l):
                return gpu.decode_matmul_gpu(x, w, w_scale=s, layer=l, num_sms=nsm, interpret=interp)

            fused = jax.jit(lambda x, wg, wu, sg, su: jnp.stack(
                [fused_one(x, wg, wu, sg, su, jnp.int32(l)) for l in range(L)]))
            sep = jax.jit(lambda x, wg, wu, sg, su: jnp.stack(
                [(jax.nn.silu(mm_one(x, wg, sg, jnp.int32(l)).astype(jnp.float32))
                  * mm_one(x, wu, su, jnp.int32(l)).astype(jnp.float32)).astype(x.dtype) for l in range(L)]))
            for T in (tuple(int(v) for v in os.environ.get("FUSED_TS", "1,32,64").split(",")) if not dry else (5,)):
                x = rnd((T, d), jnp.bfloat16)
                row = {"T": T, "D": d, "F": f, "dtype": "fp8-block" if fp8 else "bf16", "L": L}
                try:
                    t1, y1 = timeit(fused, x, wg, wu, sg, su)
                    t2, y2 = timeit(sep, x, wg, wu, sg, su)
                    row.update(fused_TBps=bytes_all / t1 / 1e12, separate_TBps=bytes_all / t2 / 1e12,
                               relerr=relerr(y1, y2))
                    r = reference.gate_up_silu_reference(x, wg[0], wu[0], gate_scale=None if sg is None else sg[0],
                                                         up_scale=None if su is None else su[0])
                    row["relerr_vs_reference"] = relerr(y1[0], r)
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:500]
                RESULTS["fused"].append(row)
                log(json.dumps(row))
                save(args.out)
            del wg, wu, sg, su

    # ---- 4a. fsmoke: each one-launch mode against the reference (own process first: a fault or a hang
    # must not take the timed sections with it); modes that pass are appended to $OUT/fsmoke_modes --------
    if "fsmoke" in sections:
        big = not dry
        cases = ([(4096, 4096, 1, 1, False, None), (4096, 14336, 13, 2, False, 2), (2048, 7168, 64, 1, False, None),
                  (4096, 4096, 8, 1, True, None)]
                 if big else [(512, 384, 1, 1, False, None), (256, 256, 13, 2, False, 2), (512, 256, 5, 1, True, None)])
        for mode in os.environ.get("FSMOKE_MODES", "direct,sem").split(","):
            if interp and mode == "sem":
                continue
            ok_bf16 = True
            for d, f, T, M, fp8, L in cases:
                row = {"mode": mode, "D": d, "F": f, "T": T, "mats": M, "dtype": "fp8-block" if fp8 else "bf16",
                       "layers": L}
                try:
                    x = rnd((T, d), jnp.bfloat16)
                    wms = [make_weights(L or 1, d, f, fp8) for _ in range(M)]
                    ws = [w if L else w[0] for w, _ in wms]
                    ss = [None if sc is None else (sc if L else sc[0]) for _, sc in wms]
                    lay = None if L is None else jnp.int32(L - 1)
                    pick = (lambda a: a) if L is None else (lambda a: None if a is None else a[L - 1])
                    if M == 1:
                        fn = jax.jit(lambda x, ws, ss, l: gpu.decode_matmul_gpu(
                            x, ws[0], w_scale=ss[0], layer=l, num_sms=nsm, interpret=interp, fused=mode))
                        r = reference.decode_matmul_reference(x, pick(ws[0]), w_scale=pick(ss[0]))
                    else:
                        fn = jax.jit(lambda x, ws, ss, l: gpu.gate_up_silu_gpu(
                            x, ws[0], ws[1], gate_scale=ss[0], up_scale=ss[1], layer=l, num_sms=nsm,
                            interpret=interp, fused=mode))
                        r = reference.gate_up_silu_reference(x, pick(ws[0]), pick(ws[1]), gate_scale=pick(ss[0]),
                                                             up_scale=pick(ss[1]))
                    mode_used = gpu.fused_mode(x, [w[0] if L else w for w in ws], [None if a is None else (a[0] if L else a) for a in ss],
                                               None, nsm, interp, mode, silu_mul=M == 2)
                    row["mode_used"] = mode_used
                    y1 = np.asarray(fn(x, ws, ss, lay), np.float32)
                    y2 = np.asarray(fn(x, ws, ss, lay), np.float32)     # a second call: semaphores back at 0
                    row["shape_ok"] = list(y1.shape) == [T, f]
                    row["relerr_vs_reference"] = relerr(y1, r)
                    row["calls_equal"] = bool(np.array_equal(y1, y2))
                    row["nan"] = int(np.isnan(y1).sum())
                    good = (row["shape_ok"] and row["relerr_vs_reference"] < 1e-2 and row["calls_equal"]
                            and mode_used == mode)
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:400]
                    good = False
                row["ok"] = good
                if not fp8:
                    ok_bf16 = ok_bf16 and good
                RESULTS["fsmoke"].append(row)
                log(json.dumps(row))
                save(args.out)
            if ok_bf16 and args.out:
                with open(os.path.join(args.out, "fsmoke_modes"), "a") as fh:
                    fh.write(f",{mode}")

    # ---- 4b. per-call cost: the one-launch kernels (gpu_fused.py) vs the partials + epilogue path --
    if "percall" in sections and not over_budget("percall"):
        pc_shapes = ([("llama8b.o", 4096, 4096, 1), ("llama8b.qkv", 4096, 6144, 1), ("dsv3.expert_up", 7168, 2048, 1),
                      ("dsv3.expert_down", 2048, 7168, 1), ("llama8b.gate_up_pair", 4096, 14336, 2),
                      ("llama8b.down", 14336, 4096, 1), ("floor", 1024, 1024, 1)]   # floor: only if PERCALL_SHAPES names it
                     if not dry else [("tiny", 512, 384, 1), ("tiny.pair", 256, 256, 2)])
        pc_ts = tuple(int(v) for v in os.environ.get("PERCALL_TS", "1,8,32,64").split(",")) if not dry else (1, 13)
        modes = os.environ.get("PERCALL_MODES", "old,direct,sem").split(",")
        if interp:
            modes = [m for m in modes if m != "sem"]          # interpret mode has no global semaphores
        for fp8 in dtypes:
            for name, d, f, M in pc_shapes:
                if over_budget(f"percall {name}"):
                    break
                if (os.environ.get("PERCALL_SHAPES") and name not in os.environ["PERCALL_SHAPES"].split(",")) or (
                        name == "floor" and "floor" not in os.environ.get("PERCALL_SHAPES", "")):
                    continue
                itemsize = 1 if fp8 else 2
                bytes_layer = M * d * f * itemsize
                L = layers_for(bytes_layer)
                wms = [make_weights(L, d, f, fp8) for _ in range(M)]
                w_, s_ = [a for a, _ in wms], [b for _, b in wms]
                sep = [[jnp.array(w_[m][l], copy=True) for l in range(L)] for m in range(M)]
                sep_s = [[None if s_[m] is None else s_[m][l] for l in range(L)] for m in range(M)]

                def kern_fn(mode, M=M, L=L):
                    fz = None if mode == "old" else mode
                    if mode == "dispatch":        # the library entry point with its defaults (what the model calls)
                        from pallas_kernels.matmul import decode_matmul as dm, gate_up_silu as gus
                        if M == 1:
                            one = jax.jit(lambda x, w, s, l: dm(x, w, w_scale=s, layer=l, impl="gpu"))
                            return jax.jit(lambda x, ws, ss: jnp.stack(
                                [one(x, ws[0], ss[0], jnp.int32(l)) for l in range(L)]))
                        one = jax.jit(lambda x, wg, wu, sg, su, l: gus(x, wg, wu, gate_scale=sg, up_scale=su, layer=l,
                                                                      impl="gpu"))
                        return jax.jit(lambda x, ws, ss: jnp.stack(
                            [one(x, ws[0], ws[1], ss[0], ss[1], jnp.int32(l)) for l in range(L)]))
                    if M == 1:
                        one = jax.jit(lambda x, w, s, l: gpu.decode_matmul_gpu(
                            x, w, w_scale=s, layer=l, num_sms=nsm, interpret=interp, fused=fz))
                        return jax.jit(lambda x, ws, ss: jnp.stack([one(x, ws[0], ss[0], jnp.int32(l)) for l in range(L)]))
                    one = jax.jit(lambda x, wg, wu, sg, su, l: gpu.gate_up_silu_gpu(
                        x, wg, wu, gate_scale=sg, up_scale=su, layer=l, num_sms=nsm, interpret=interp, fused=fz))
                    return jax.jit(lambda x, ws, ss: jnp.stack(
                        [one(x, ws[0], ws[1], ss[0], ss[1], jnp.int32(l)) for l in range(L)]))

                def xla_fn(M=M, L=L):
                    def dot(x, w, s):
                        if fp8:
                            return tpu.decode_matmul_xla(x, w, w_scale=s).astype(jnp.float32)
                        return jnp.dot(x, w, preferred_element_type=jnp.float32)
                    if M == 1:
                        return jax.jit(lambda x, ws, ss: jnp.stack(
                            [dot(x, ws[0][l], ss[0][l]).astype(x.dtype) for l in range(L)]))
                    return jax.jit(lambda x, ws, ss: jnp.stack(
                        [(jax.nn.silu(dot(x, ws[0][l], ss[0][l])) * dot(x, ws[1][l], ss[1][l])).astype(x.dtype)
                         for l in range(L)]))
                xs = {T: rnd((T, d), jnp.bfloat16) for T in pc_ts}
                xf = xla_fn()
                jobs, keys = [], []
                for T in pc_ts:
                    for mode in modes:
                        jobs.append((kern_fn(mode), (xs[T], w_, s_)))
                        keys.append((T, mode))
                    for opt, nm in ((TRITON, "xla_triton"), (NO_TRITON, "xla_cublas")):
                        jobs.append((xf, (xs[T], sep, sep_s), None if dry else opt))
                        keys.append((T, nm))
                comp = dict(zip(keys, precompile(jobs)))
                for T in pc_ts:
                    x = xs[T]
                    row = {"shape": name, "D": d, "F": f, "mats": M, "dtype": "fp8-block" if fp8 else "bf16",
                           "T": T, "L": L, "bytes_per_layer": bytes_layer}
                    pick = [a[L - 1] if a is not None else None for a in s_]
                    if M == 1:
                        ref = reference.decode_matmul_reference(x, w_[0][L - 1], w_scale=pick[0])
                    else:
                        ref = reference.gate_up_silu_reference(x, w_[0][L - 1], w_[1][L - 1],
                                                               gate_scale=pick[0], up_scale=pick[1])
                    for mode in modes + ["xla_triton", "xla_cublas"]:
                        ck = comp[(T, mode)]
                        try:
                            if isinstance(ck, Exception):
                                raise ck
                            args_ = (x, sep, sep_s) if mode.startswith("xla") else (x, w_, s_)
                            t, y = timeit(ck, *args_)
                            row[f"{mode}_us"] = t / L * 1e6
                            row[f"{mode}_TBps"] = bytes_layer * L / t / 1e12
                            row[f"{mode}_frac_ceiling"] = row[f"{mode}_TBps"] / ceil_tb
                            row[f"{mode}_relerr_vs_reference"] = relerr(y[L - 1], ref)
                            if mode in ("direct", "sem", "direct+pdl"):
                                from pallas_kernels.matmul import gpu_fused
                                fz = gpu_fused.Fused(mode.partition("+")[0], T, "bfloat16", M == 2)
                                c, plan = gpu_fused.plan_for(x, [a[0] for a in w_],
                                                             [None if a is None else a[0] for a in s_], None, nsm, fz)
                                row[f"{mode}_plan"] = (None if c is None else
                                                       [c.tile_d, c.tile_f, plan.stages, plan.n_ctas, plan.n_per,
                                                        plan.n_slots])
                        except Exception as e:  # noqa: BLE001
                            row[f"{mode}_error"] = repr(e)[:400]
                    xla_best = max(row.get("xla_triton_TBps", 0), row.get("xla_cublas_TBps", 0))
                    row["xla_best_TBps"] = xla_best
                    RESULTS["percall"].append(row)
                    log(json.dumps(row))
                    save(args.out)
                del w_, s_, sep, sep_s, wms

    # ---- 5. tile configurations -------------------------------------------------------------
    if "tune" in sections and not over_budget("tune"):
        tune_shapes = [("llama8b.qkv", 4096, 6144), ("llama8b.gate_up", 4096, 28672)] if not dry else [("tiny", 256, 512)]
        for name, d, f in tune_shapes:
            for fp8 in dtypes:
                if over_budget(f"tune {name}"):
                    break
                itemsize = 1 if fp8 else 2
                bytes_layer = d * f * itemsize
                L = layers_for(bytes_layer)
                w, s = make_weights(L, d, f, fp8)
                cfgs = [None] + [gpu.TileConfig(td, tf, ms, bud, cps) for td, tf, ms, bud, cps in
                                 [(128, 256, 8, 200 * 1024, 1), (64, 256, 8, 200 * 1024, 1),
                                  (128, 128, 3, 200 * 1024, 2), (64, 128, 12, 216 * 1024, 1)]]
                jobs, rows = [], []
                for T in ((8, 64) if not dry else (8,)):
                    x = rnd((T, d), jnp.bfloat16)
                    for cfg in cfgs:
                        row = {"shape": name, "D": d, "F": f, "T": T, "dtype": "fp8-block" if fp8 else "bf16",
                               "cfg": None if cfg is None else dataclass_dict(cfg)}
                        c, plan = gpu.plan_for(x, [w], [s], cfg, nsm)
                        if c is None:
                            row["skip"] = plan
                            RESULTS["tune"].append(row)
                            continue
                        row["plan"] = [c.tile_d, c.tile_f, plan.stages, plan.n_ctas, plan.n_per, plan.n_slots]
                        rows.append((row, x))
                        jobs.append((kernel_stack_fn(L, cfg), (x, w, s)))
                for row in timed_stacks(rows, jobs, w, s, bytes_layer, L):
                    RESULTS["tune"].append(row)
                    log(json.dumps(row))
                    save(args.out)
                del w, s

    print_tables()
    save(args.out)
    if any("error" in r or r.get("nan") for r in RESULTS["smoke"]):
        sys.exit(3)


def dataclass_dict(c):
    import dataclasses
    return dataclasses.asdict(c)


def print_tables():
    R = RESULTS
    print("\n== ceilings:", "torch copy", (R.get("torch_copy") or {}).get("TBps"), "TB/s; jax copy",
          (R.get("jax_copy") or {}).get("TBps"), "TB/s")
    print("\n== sweep (TB/s of weight bytes): shape dtype T | kernel xla | kernel/ceiling | speedup | relerr")
    for r in R["rows"]:
        if "error" in r:
            print(f"{r['shape']:18s} {r['dtype']:9s} T={r['T']:3d} ERROR {r['error'][:200]}")
            continue
        print(f"{r['shape']:18s} {r['dtype']:9s} T={r['T']:3d} | {r['kernel_TBps']:5.2f} {r['xla_TBps']:5.2f} | "
              f"{r['kernel_frac_ceiling']:5.1%} | x{r['speedup_vs_xla']:4.2f} | {r['relerr_vs_xla']:.1e} cfg={r.get('cfg')}"
              f" | kernel-only {r.get('kernel_only_TBps', float('nan')):5.2f}")
    print("\n== layer loops (TB/s)")
    for r in R["loops"] + R.get("loops_default_flags", []):
        print(f"{r['variant']:40s} T={r['T']:3d} {r.get('TBps', float('nan')):5.2f} flags={r['flags']!r} {r.get('error', '')[:120]}")
    print("\n== smoke")
    for r in R["smoke"]:
        print(r)
    print("\n== fused gate/up (TB/s)")
    for r in R["fused"]:
        print(r)
    print("\n== variants (TB/s, fraction of ceiling, rel. error vs reference)")
    for r in R["variants"]:
        print(f"{r['shape']:18s} {r['dtype']:9s} T={r['T']:3d} {r['variant']:18s} {r.get('TBps', float('nan')):5.2f} "
              f"{r.get('frac_ceiling', float('nan')):6.1%} {r.get('relerr_vs_reference', float('nan')):.1e} "
              f"plan={r.get('plan')} {r.get('skip', '')}{r.get('error', '')[:160]}")
    print("\n== per call (us per layer, TB/s, % of ceiling, rel. error vs reference)")
    for r in R["percall"]:
        cells = []
        for m in ("old", "direct", "direct+pdl", "sem", "dispatch", "xla_triton", "xla_cublas"):
            if f"{m}_us" in r:
                cells.append(f"{m} {r[m + '_us']:6.1f}us {r[m + '_TBps']:4.2f} {r[m + '_frac_ceiling']:5.1%} "
                             f"{r[m + '_relerr_vs_reference']:.0e}")
            elif f"{m}_error" in r:
                cells.append(f"{m} ERR {r[m + '_error'][:80]}")
        print(f"{r['shape']:20s} {r['dtype']:9s} T={r['T']:3d} | " + " | ".join(cells),
              f"| plans direct={r.get('direct_plan')} sem={r.get('sem_plan')}")
    print("\n== tune (TB/s)")
    for r in R["tune"]:
        print(r.get("shape"), r.get("T"), r.get("dtype"), r.get("plan"), r.get("TBps"), r.get("relerr_vs_reference"),
              r.get("skip", ""), r.get("error", "")[:120])
    if R["errors"]:
        print("\nerrors:", R["errors"])


if __name__ == "__main__":
    main()
