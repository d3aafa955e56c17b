"""Mosaic GPU (Hopper) weight-streaming matmul for decode: y[T, F] = x[T, D] @ w[D, F].

Why it exists: at decode T is 1..256, so every weight byte is used T times at most and the
matmul is bound by how fast the weights stream out of HBM. XLA's paths reach 1.0-2.7 TB/s of
the H200's ~4.3. This kernel is built only to stream:

* Orientation: it computes y^T = w^T x^T, so F (large) is wgmma's M dimension and the padded T
  (Tp, a multiple of 8) its N dimension; no tensor-core work is wasted on padding rows.
  Both operands come from SMEM, transposed views of the tiles TMA brings in.
* Work split ("stream-K"): the (F-tile, D-step) iteration space, F-tile major, is cut into
  equal contiguous runs, one per CTA, on a grid of about one CTA per SM. A run may start or
  end inside an F tile; each CTA writes one float32 partial [tile_f, Tp] per F tile it touches,
  into a slot of a partial buffer P[M, slots, F, Tp]. A small XLA epilogue sums the slots
  (a static mask says which slots were written), transposes, applies per-channel scales /
  SiLU*mul, and casts. In a model that epilogue fuses into the consumer of y.
* Each CTA runs one software pipeline (`plgpu.emit_pipeline`) several stages deep over its
  whole run, so there is no pipeline restart at F-tile boundaries.
* fp8 (e4m3) weights stay fp8 in HBM (half the bytes). Default ("f16" path): each tile is
  converted e4m3 -> f16 in SMEM (one `cvt.rn.f16x2.e4m3x2` per pair, exact: every e4m3 value is
  an f16), the wgmma runs in f16 against x cast to f16(x * 2^-X_SHIFT) (exact for
  2^-8 <= |x| <= 2^22, so activations past f16's 65504 are fine), and each 128x128 block scale
  (times 2^X_SHIFT) multiplies a fresh float32 product per block: no rounding of scaled weights.
  The older "bf16" path (fp8_via="bf16": e4m3 -> f32 * block scale -> bf16 in SMEM) is kept as an
  option. Per-channel scales are applied exactly in float32 in the epilogue. The conversion's
  SMEM round trip (TMA write, 16-bit-pair loads, f16 store, wgmma read: ~6 bytes of SMEM traffic
  per weight byte) is what limits fp8 (benchmarks/RESULTS.md).
* Several weight matrices of one shape (the gate/up pair) are streamed in one launch: every
  pipeline step brings the same tile of each, and each has its own accumulator.

* One launch instead of kernel + epilogue (gpu_fused.py): decode_matmul_gpu / gate_up_silu_gpu /
  partial_products take `fused=` ("default" = the tuning row's `fused`, "auto"; tuning.py): there the kernel itself
  finishes each F tile and writes the final [T, F] (cast, gate/up SiLU*mul, transposed in the
  kernel). "direct" (no split over D, whole F tiles per CTA) is taken where it measured faster
  (gpu_fused.auto_mode); "sem" (this stream-K split, partials combined by the tile's owner CTA
  through global semaphores) is opt-in: it measured no faster than partials + epilogue.

The plan (tile sizes, runs, slots) is static Python computed from the shapes. Options
(TileConfig): ctas_per_sm, n_wg > 1 (warp-specialized kernel in gpu_ws.py: a TMA producer
warpgroup and n_wg compute warpgroups splitting the F tile), deq_layout="8bit" (fp8 tiles loaded
4 bytes per lane), deq_rows.

Measured on an H200 (benchmarks/RESULTS.md, copy ceiling 4.26 TB/s in the same run):
bf16 whole op 3.3-3.4 TB/s on the 117-235 MB Llama-8B matrices at T <= 8 (78-80%), 2.3-2.5 on
the <= 50 MB ones, falling with T; a fit over shapes gives a stream rate of 3.7 TB/s (87%) at
T <= 8 plus a fixed ~6 us per call, which is what holds the small matrices back. fp8 with block
scales (f16 path) 1.2-2.1 TB/s of fp8 bytes, up to 2.75 with the defaults chosen after that run.
"""
from __future__ import annotations

import functools

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.matmul import gpu_fused, gpu_ws, tuning
from pallas_kernels.matmul.gpu_blocks import (MAX_T, SMEM_LIMIT, X_SHIFT, Plan, TileConfig, block_scale_reader,
                                              body_refs, in_specs, kernel_args, launch, num_sms_default, padded_t,
                                              partials_flush, pipeline_stages, pipeline_step, slots_of_runs,
                                              split_operands, stage_bytes, stream_k_maps, tile_transforms,
                                              unsupported_reason, widen_fp8_tile, x_to_f16)
from pallas_kernels.matmul.reference import BLOCK, is_fp8

__all__ = ["MAX_T", "SMEM_LIMIT", "X_SHIFT", "Plan", "TileConfig", "padded_t", "unsupported_reason", "make_plan",
           "auto_config", "plan_for", "raw_partials", "reduce_partials", "fused_mode", "partial_products",
           "decode_matmul_gpu", "gate_up_silu_gpu", "num_sms_default"]

def make_plan(d: int, f: int, t: int, n_mats: int, w_itemsize: int, cfg: TileConfig,
              num_sms: int) -> Plan:
    """Static work split: runs of n_per steps per CTA over the (F tile, D step) space, slots, stages."""
    tp = padded_t(t)
    tile_d, tile_f = cfg.tile_d, cfg.tile_f
    k_steps, f_tiles = d // tile_d, f // tile_f
    n_total = k_steps * f_tiles
    grid = max(1, num_sms * cfg.ctas_per_sm)
    n_per = -(-n_total // grid)
    n_ctas = -(-n_total // n_per)
    n_slots, mask = slots_of_runs(k_steps, f_tiles, n_per)
    fixed = n_mats * tile_f * tp * 4                              # out staging
    if w_itemsize == 1:
        fixed += n_mats * tile_d * tile_f * 2                     # bf16 dequant buffers
    stages = pipeline_stages(cfg, n_per, fixed, stage_bytes(tp, tile_d, tile_f, n_mats, w_itemsize))
    return Plan(d, f, tp, n_mats, tile_d, tile_f, k_steps, f_tiles, n_total, n_per, n_ctas,
                n_slots, stages, mask, cfg.fp8_via, min(cfg.deq_rows, tile_d), cfg.n_wg, cfg.deq_layout)


def _kernel_call(plan: Plan, w_dtype, block_scaled: bool, stacked: bool, interpret: bool):
    """Builds the plgpu.kernel computing partials P[M, slots, F, Tp] from x [Tp, D], M weights (+ scales).

    stacked: the weights (and scales) carry a leading layer axis and the kernel's second input
    is an int32 [1] layer index; the kernel reads that layer's tiles in place (no slice copy).
    block_scaled: each step's 128x128-block scales are read from GMEM one step ahead and carried
    through the pipeline, so the load latency hides behind a step. (Staging scales in SMEM by TMA
    does not work: per-step 16-byte tiles give misaligned TMA destinations, a per-CTA scale window
    raises an illegal instruction on the H200; plain scalar loads work.)
    """
    p = plan
    M = p.n_mats
    fp8 = is_fp8(w_dtype)
    f16 = fp8 and p.fp8_via == "f16"
    deq_dtype = jnp.float16 if f16 else jnp.bfloat16
    x_fac = float(2 ** X_SHIFT) if f16 else 1.0
    x_tr, w_tr, deq_tr = tile_transforms(p.tile_d, p.tile_f, jnp.dtype(w_dtype).itemsize)

    def body(x_gmem, *refs):
        w_gmems, s_gmems, (p_gmem, out_smem, *rest) = body_refs(refs, M, block_scaled, stacked)
        deq_smems = rest[:M] if fp8 else ()          # one 16-bit conversion buffer per matrix
        c = lax.axis_index("cta")
        coords, w_map, x_map = stream_k_maps(c, p.n_per, p.n_total, p.k_steps)
        gmem_scales = block_scale_reader(s_gmems, coords, p)

        def operand(m, w_smem, s_cur):
            if f16:
                return widen_fp8_tile(w_smem, deq_smems[m], p)
            if not fp8:
                return w_smem
            dst = deq_smems[m]
            for r in range(p.tile_d // 64):
                rows = pl.ds(r * 64, 64)
                # fp8 -> bf16 goes through f32: this ptxas has no direct e4m3 -> bf16 cvt
                v = w_smem.at[rows][...].astype(jnp.float32)
                if block_scaled:
                    # one scale per 128x128 block; tile_f <= 128 (checked by unsupported_reason)
                    v = v * s_cur[m][(r * 64) // BLOCK]
                dst.at[rows][...] = v.astype(jnp.bfloat16)
            plgpu.commit_smem()
            return dst

        on_flush = partials_flush(p, c, out_smem, p_gmem, x_fac if (f16 and not block_scaled) else 1.0)

        # f16 with block scales: one fresh float32 product per 128-row scale block, scaled in registers
        step = pipeline_step(p, coords, gmem_scales, operand, f16 and block_scaled, x_fac, interpret, on_flush)

        zeros = tuple(jnp.zeros((p.tile_f, p.tp), jnp.float32) for _ in range(M))
        s0 = gmem_scales(0) if block_scaled else None
        plgpu.emit_pipeline(step, grid=(p.n_per,), in_specs=in_specs(p, x_map, w_map, x_tr, w_tr),
                            max_concurrent_steps=p.stages, init_carry=(zeros, s0))(x_gmem, *w_gmems)
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((M, p.tile_f, p.tp), jnp.float32)]
    if fp8:
        scratch += [plgpu.SMEM((p.tile_d, p.tile_f), deq_dtype, transforms=deq_tr) for _ in range(M)]
    return launch(body, jax.ShapeDtypeStruct((M, p.n_slots, p.f, p.tp), jnp.float32), scratch, p.n_ctas, interpret)


def auto_config(t: int, d: int, f: int, n_mats: int, w_itemsize: int, block_scaled: bool,
                num_sms: int, tun: tuning.MatmulTuning | None = None) -> TileConfig | None:
    """Tile sizes for a problem, or None if no tiling fits (registers, SMEM, divisibility).

    The running sums live in registers: n_mats * tile_f * Tp / 128 float32 per thread, kept
    <= 128. Among the D steps that divide D, pick the one with the most weight bytes in flight
    ((stages - 1) * weight bytes per stage), preferring larger steps on ties. The preferences (the
    64-row F tile of bf16 at mid T, the warp-specialized fp8 tiling) are the tuning row's (`tun`, default
    tuning.current(); tuning.py has the measurements). fp8 goes through f16 (TileConfig defaults: 128-row
    conversion rounds, 8-bit load layout), 1.25-1.5x the bf16-folding path in one run, and exact.
    """
    tun = tuning.current() if tun is None else tun
    tp = padded_t(t)
    fp8 = w_itemsize == 1
    if (fp8 and block_scaled and n_mats == 1 and tp == tun.ws_tp and f % tun.ws_tile_f == 0
            and d % tun.ws_tile_d == 0):
        ws = TileConfig(tile_d=tun.ws_tile_d, tile_f=tun.ws_tile_f, n_wg=tun.ws_n_wg, smem_budget=tun.ws_smem_budget)
        plan = make_plan(d, f, t, n_mats, w_itemsize, ws, num_sms)
        if plan.stages >= min(2, plan.n_per):
            return ws
    pref_f = 64 if tun.narrow_f(tp, fp8) else None
    best, best_key = None, None
    for tile_f in tun.tiles_f:
        if f % tile_f or n_mats * tile_f * tp // 128 > 128:
            continue
        for tile_d in tun.tiles_d:
            if d % tile_d or (block_scaled and tile_d % BLOCK):
                continue
            cfg = TileConfig(tile_d=tile_d, tile_f=tile_f)
            plan = make_plan(d, f, t, n_mats, w_itemsize, cfg, num_sms)
            if plan.stages < min(2, plan.n_per):
                continue
            key = (pref_f is None or tile_f == pref_f,
                   min(plan.stages - 1, plan.n_per) * n_mats * tile_d * tile_f * w_itemsize,
                   tile_f, tile_d)
            if best_key is None or key > best_key:
                best, best_key = cfg, key
    return best


def plan_for(x_TD, ws, scales, cfg: TileConfig | None = None, num_sms: int | None = None):
    """(cfg, plan) for these operands, or (None, reason) when the kernel can't take them."""
    t = x_TD.shape[0]
    stacked, d, f, block_scaled = split_operands(ws, scales)
    num_sms = num_sms if num_sms is not None else num_sms_default()
    if cfg is None:
        cfg = auto_config(t, d, f, len(ws), jnp.dtype(ws[0].dtype).itemsize, block_scaled, num_sms)
        if cfg is None:
            return None, f"no tiling fits T={t}, D={d}, F={f}, {len(ws)} matrices"
    reason = unsupported_reason(x_TD, ws, scales, cfg)
    if reason:
        return None, reason
    plan = make_plan(d, f, t, len(ws), jnp.dtype(ws[0].dtype).itemsize, cfg, num_sms)
    if plan.stages < min(2, plan.n_per):
        return None, f"tiles {cfg.tile_d}x{cfg.tile_f} at Tp={plan.tp} leave no SMEM for a 2-stage pipeline"
    return cfg, plan


def raw_partials(x_TD, ws, scales, *, layer=None, cfg: TileConfig | None = None,
                 num_sms: int | None = None, interpret: bool = False, x_padded: bool = False,
                 fused: str | None = None, out_dtype=None, silu_mul: bool = False):
    """The kernel alone: (float32 partials P[M, slots, F, Tp], plan). For benchmarks and tests.

    x_padded: x already has Tp rows (zeros past T); then no pad op is emitted.
    fused="direct"/"direct+pdl"/"sem": instead the one-launch kernel of gpu_fused.py: (y[n_out, T, F] in out_dtype
    (default x's), its plan); silu_mul: y = silu(x @ w0) * (x @ w1). Raises if it can't take the operands.
    """
    if fused is not None:
        mode, _, opt = fused.partition("+")
        y = gpu_fused.fused_products(x_TD, ws, scales, layer=layer, cfg=cfg, num_sms=num_sms,
                                     interpret=interpret, mode=mode, out_dtype=out_dtype, silu_mul=silu_mul,
                                     pdl=opt == "pdl")
        return y, None
    t = x_TD.shape[0]
    stacked, d, f, block_scaled = split_operands(ws, scales)
    if stacked != (layer is not None):
        raise ValueError("pass layer= exactly when the weights are stacked [L, D, F]")
    cfg, plan = plan_for(x_TD, ws, scales, cfg, num_sms)
    if cfg is None:
        raise ValueError(f"decode matmul kernel can't take these operands: {plan}")
    if x_padded and t != plan.tp:
        raise ValueError(f"x_padded=True but x has {t} rows, kernel wants Tp={plan.tp}")
    x_pad = x_TD if plan.tp == t else jnp.pad(x_TD, ((0, plan.tp - t), (0, 0)))
    if is_fp8(ws[0].dtype) and plan.fp8_via == "f16" and x_pad.dtype != jnp.float16:
        x_pad = x_to_f16(x_pad)
    args = kernel_args(x_pad, ws, scales, layer, stacked, block_scaled)
    return _jitted_kernel(plan, jnp.dtype(ws[0].dtype), block_scaled, stacked, interpret)(*args), plan


@functools.lru_cache(maxsize=None)
def _jitted_kernel(plan: Plan, w_dtype, block_scaled: bool, stacked: bool, interpret: bool):
    """One jitted callable per static configuration. A decode step calls the kernel with identical operand shapes
    once per layer (the layer index is an operand); through one jitted function JAX lowers the Mosaic module once
    and emits a call per layer, instead of re-lowering it per call site: measured on a CPU lowering of an 8-layer
    Llama-8B decode step for cuda, 10 s of lowering and a 4.4 MB module before this (a 32-layer step spent 35 s
    lowering on the H200)."""
    if plan.n_wg > 1:
        return jax.jit(gpu_ws.kernel_call_ws(plan, w_dtype, block_scaled, stacked, interpret))
    return jax.jit(_kernel_call(plan, w_dtype, block_scaled, stacked, interpret))


def reduce_partials(part, plan: Plan, t: int):
    """Sum the written slots of P[M, slots, F, Tp] (a static mask) -> float32 y[M, t, F]."""
    mask = np.repeat(np.asarray(plan.slot_mask, bool), plan.tile_f, axis=1)          # [slots, F]
    y = jnp.where(mask[None, :, :, None], part, 0.0).sum(axis=1)                     # [M, F, Tp]
    return jnp.swapaxes(y, 1, 2)[:, :t, :]


def fused_mode(x_TD, ws, scales, cfg: TileConfig | None, num_sms: int | None, interpret: bool,
               fused="default", silu_mul: bool = False, out_dtype=None) -> str | None:
    """The one-launch kernel mode (gpu_fused.py) to use for these operands, or None for the partials + XLA
    epilogue path. fused: "default" (the tuning row's `fused`, tuning.py), None/"off", "direct", "sem" or
    "auto". A mode the fused
    kernel can't take (per-channel scales, n_wg > 1, a tiling that doesn't fit, "sem" in interpret mode,
    which has no global semaphores) falls back: "sem" -> "direct" -> None."""
    if fused == "default":
        fused = tuning.current().fused
    if fused in (None, "off"):
        return None
    t = x_TD.shape[0]
    d, f = ws[0].shape[-2:]
    if fused == "auto":
        fused = gpu_fused.auto_mode(t, d, f, len(ws), jnp.dtype(ws[0].dtype).itemsize,
                                    num_sms if num_sms is not None else num_sms_default())
        if fused is None:
            return None
    order = {"sem": ("sem", "direct"), "direct": ("direct",), "direct+pdl": ("direct+pdl", "direct")}.get(fused)
    if order is None:
        raise ValueError(f"fused must be 'default', None, 'off', 'auto', 'direct', 'direct+pdl' or 'sem', "
                         f"got {fused!r}")
    out_name = jnp.dtype(out_dtype or x_TD.dtype).name
    for mode in order:
        if mode == "sem" and interpret:
            continue
        fz = gpu_fused.Fused(mode.partition("+")[0], t, out_name, silu_mul)
        c, _ = gpu_fused.plan_for(x_TD, list(ws), list(scales), cfg, num_sms, fz)
        if c is not None:
            return mode
    return None


def partial_products(x_TD, ws, scales, *, layer=None, cfg: TileConfig | None = None,
                     num_sms: int | None = None, interpret: bool = False, fused="default"):
    """Runs the kernel: float32 y[M, T, F] = x @ w_m (block scales applied; per-channel ones not).

    ws: M weights [D, F] of one dtype, or M stacked weights [L, D, F] with `layer` an int32
    scalar (may be traced): then layer `layer` is read in place. fused: see fused_mode (the
    one-launch kernel then writes float32 y itself).
    """
    mode = fused_mode(x_TD, ws, scales, cfg, num_sms, interpret, fused, out_dtype=jnp.float32)
    if mode is not None:
        return raw_partials(x_TD, ws, scales, layer=layer, cfg=cfg, num_sms=num_sms, interpret=interpret,
                            fused=mode, out_dtype=jnp.float32)[0]
    part, plan = raw_partials(x_TD, ws, scales, layer=layer, cfg=cfg, num_sms=num_sms, interpret=interpret)
    return reduce_partials(part, plan, x_TD.shape[0])


def _channel_scale(y_TF, scale, layer):
    if scale is None:
        return y_TF
    if layer is not None:
        if scale.ndim != 2:
            return y_TF
        scale = scale[layer]
    elif scale.ndim != 1:
        return y_TF
    return y_TF * scale[None, :]


def decode_matmul_gpu(x_TD, w_DF, *, w_scale=None, layer=None, cfg: TileConfig | None = None,
                      num_sms: int | None = None, interpret: bool = False, fused="default", out_dtype=None):
    """y[T, F] in out_dtype (default x's). With a fused mode (fused_mode) one launch writes y itself."""
    out_dtype = jnp.dtype(out_dtype or x_TD.dtype)
    mode = fused_mode(x_TD, [w_DF], [w_scale], cfg, num_sms, interpret, fused, out_dtype=out_dtype)
    if mode is not None:
        return raw_partials(x_TD, [w_DF], [w_scale], layer=layer, cfg=cfg, num_sms=num_sms, interpret=interpret,
                            fused=mode, out_dtype=out_dtype)[0][0]
    y = partial_products(x_TD, [w_DF], [w_scale], layer=layer, cfg=cfg, num_sms=num_sms,
                         interpret=interpret, fused=None)[0]
    return _channel_scale(y, w_scale, layer).astype(out_dtype)


def gate_up_silu_gpu(x_TD, w_gate_DF, w_up_DF, *, gate_scale=None, up_scale=None, layer=None,
                     cfg: TileConfig | None = None, num_sms: int | None = None, interpret: bool = False,
                     fused="default"):
    ws, ss = [w_gate_DF, w_up_DF], [gate_scale, up_scale]
    mode = fused_mode(x_TD, ws, ss, cfg, num_sms, interpret, fused, silu_mul=True)
    if mode is not None:
        return raw_partials(x_TD, ws, ss, layer=layer, cfg=cfg, num_sms=num_sms, interpret=interpret,
                            fused=mode, silu_mul=True)[0][0]
    y = partial_products(x_TD, ws, ss, layer=layer, cfg=cfg, num_sms=num_sms, interpret=interpret, fused=None)
    g = _channel_scale(y[0], gate_scale, layer)
    u = _channel_scale(y[1], up_scale, layer)
    return (jax.nn.silu(g) * u).astype(x_TD.dtype)
