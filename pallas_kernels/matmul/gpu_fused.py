"""Decode weight-streaming matmul that returns the final y[T, F] in one launch (no XLA epilogue).

Why it exists: gpu.py's kernel writes float32 split-K partials P[M, slots, F, Tp] and an XLA fusion
sums them, transposes, applies SiLU*mul and casts. On the H200 that epilogue plus the gap before it
is most of a fixed ~6-9 us per call, which keeps the <= 50 MB matrices (qkv, o, DeepSeek experts) at
40-58% of the copy ceiling and cost ~0.4 ms per Llama-8B decode step in the engine (RESULTS.md).
Here the kernel itself finishes each F tile: the running sum [tile_f, Tp] (F is wgmma's M dim, as
in gpu.py) is optionally combined (gate/up: silu(g) * u), cast to the output dtype and stored
through a transposed SMEM view in the WGMMA_TRANSPOSED register layout (Mosaic turns the
transpose into one lane shuffle), then a TMA store of the first T rows writes y[:, tile] of the
[T, F] output directly: no padding rows, no float32 round trip through HBM.

Two ways to own an F tile (`Fused.mode`):
* "direct": no split over D. Each CTA runs whole F tiles (n_per is a multiple of the D steps of a
  tile), so every tile has one owner and nothing is combined across CTAs. Grid = F tiles (or fewer
  CTAs each running several tiles); fewer CTAs than SMs on the small matrices.
* "sem": gpu.py's stream-K split (about one CTA per SM, runs cut inside F tiles). A CTA whose run
  ends inside tile j (slot 0: it reaches tile j last in its run) owns j; the other contributors
  write float32 partials to a scratch output, wait for their TMA store to land, and signal a
  per-tile global semaphore; the owner waits for the count, sums the partials (TMA loads) onto its
  own and finishes the tile. The semaphore wait decrements the count back to 0 for the next call.
  This needs every CTA resident at once (grid <= SMs, one CTA per SM), which the plan guarantees
  for this kernel alone on the device. GPU interpret mode has no global semaphores: "sem" is
  checked by lowering for cuda on CPU and against the reference on the GPU (benchmark).

Option `Fused.pdl` ("direct+pdl" in gpu.fused_mode): programmatic dependent launch, so a kernel's start
(launch, L2 prefetch of its first weight tiles) overlaps the previous kernel's tail; measured, the
per-call floor is ~5 us for Mosaic and XLA kernels alike, which is what it targets. Its own gain is not
measured (default off).

Weights: bf16, or fp8 e4m3 through gpu.py's f16 path (exact e4m3 -> f16 in SMEM, 128x128 block
scales on per-block float32 products). Per-channel fp8 scales and the warp-specialized /
bf16-folding fp8 variants are not taken here (gpu.py's kernel + epilogue handle them).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.matmul import gpu_blocks as blocks
from pallas_kernels.matmul import tuning
from pallas_kernels.matmul.gpu_blocks import (X_SHIFT, Plan, TileConfig, at_layer, block_scale_reader, in_specs,
                                              kernel_args, launch, padded_t, pipeline_stages, pipeline_step,
                                              slots_of_runs, split_operands, stage_bytes, stream_k_maps,
                                              tile_transforms, widen_fp8_tile, x_to_f16)
from pallas_kernels.matmul.reference import BLOCK, is_fp8

MODES = ("direct", "sem")
OUT_DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class Fused:
    """Static epilogue description: mode, true T, output dtype name, gate/up combination."""
    mode: str
    t: int
    out_dtype: str = "bfloat16"
    silu_mul: bool = False
    # Programmatic dependent launch (Hopper): the kernel lets the next launch start early, prefetches its first
    # weight tiles into L2 and only then waits for the previous kernel (griddepcontrol.wait) before it reads x.
    # Mosaic launches a kernel that uses griddepcontrol with the PDL attribute, so its prologue can overlap the
    # previous kernel's tail. Weights written by the previous kernel stay correct: the prefetch is an L2 hint and
    # every real load comes after the wait. Not measured on the H200 (default off).
    pdl: bool = False


def make_plan(d: int, f: int, t: int, n_mats: int, w_itemsize: int, cfg: TileConfig,
              num_sms: int, mode: str, out_itemsize: int) -> Plan:
    """gpu.make_plan's split for "sem"; for "direct" runs of whole F tiles. SMEM also holds the output staging."""
    tp = padded_t(t)
    tile_d, tile_f = cfg.tile_d, cfg.tile_f
    k_steps, f_tiles = d // tile_d, f // tile_f
    n_total = k_steps * f_tiles
    grid = max(1, num_sms * cfg.ctas_per_sm)
    if mode == "direct":
        tiles_per = -(-f_tiles // grid)
        n_per = tiles_per * k_steps
    else:
        n_per = -(-n_total // grid)
    n_ctas = -(-n_total // n_per)
    n_slots, mask = slots_of_runs(k_steps, f_tiles, n_per)
    n_out = 1 if n_mats == 2 else n_mats
    fixed = n_out * tp * tile_f * out_itemsize                     # output staging
    if mode == "sem":
        fixed += 2 * n_mats * tile_f * tp * 4                      # partial staging + partial loads
    if w_itemsize == 1:
        fixed += n_mats * tile_d * tile_f * 2                      # f16 conversion buffers
    stages = pipeline_stages(cfg, n_per, fixed, stage_bytes(tp, tile_d, tile_f, n_mats, w_itemsize))
    return Plan(d, f, tp, n_mats, tile_d, tile_f, k_steps, f_tiles, n_total, n_per, n_ctas,
                    n_slots, stages, mask, "f16", min(cfg.deq_rows, tile_d), 1, cfg.deq_layout)


def unsupported_reason(x_TD, ws, scales, cfg: TileConfig, fz: Fused) -> str | None:
    """Why this kernel can't take the operands (None if it can); the stream-K kernels' checks plus its own."""
    why = blocks.unsupported_reason(x_TD, ws, scales, cfg)
    if why:
        return why
    if fz.mode not in MODES:
        return f"mode={fz.mode!r} (use one of {MODES})"
    if fz.out_dtype not in OUT_DTYPES:
        return f"out_dtype {fz.out_dtype} (fused kernel writes {OUT_DTYPES})"
    if fz.silu_mul and len(ws) != 2:
        return "silu_mul needs exactly two matrices (gate, up)"
    if is_fp8(ws[0].dtype) and cfg.fp8_via != "f16":
        return "the fused kernel takes fp8 weights only through fp8_via='f16'"
    if cfg.n_wg != 1:
        return "the fused kernel runs one compute warpgroup (n_wg=1)"
    if any(s is not None and s.ndim == ws[0].ndim - 1 for s in scales):
        return "per-channel scales are applied by gpu.py's epilogue, not the fused kernel"
    if fz.mode == "sem" and cfg.ctas_per_sm != 1:
        return "mode='sem' needs one CTA per SM (every CTA resident while owners wait)"
    return None


def _silu_mul(g, u):
    return g / (1.0 + jnp.exp(-g)) * u


def kernel_call(plan: Plan, w_dtype, block_scaled: bool, stacked: bool, interpret: bool, fz: Fused):
    """plgpu.kernel: x [Tp, D], M weights (+ block scales) -> y [n_out, T, F] (+ "sem": float32 partial scratch)."""
    p = plan
    M = p.n_mats
    n_out = 1 if fz.silu_mul else M
    sem_mode = fz.mode == "sem"
    fp8 = is_fp8(w_dtype)
    x_fac = float(2 ** X_SHIFT) if fp8 else 1.0
    out_dt = jnp.dtype(fz.out_dtype)
    x_tr, w_tr, deq_tr = tile_transforms(p.tile_d, p.tile_f, jnp.dtype(w_dtype).itemsize)
    n_per, n_total, k_steps = p.n_per, p.n_total, p.k_steps
    n_in = M * (2 if block_scaled else 1)
    T = fz.t

    def body(x_gmem, *refs):
        c = lax.axis_index("cta")
        coords, w_map, x_map = stream_k_maps(c, n_per, n_total, k_steps)
        if stacked:
            layer_gmem, *refs = refs
        if fz.pdl and not interpret:
            plgpu.griddepcontrol_launch_dependents()
            # the layer index may come from the previous kernel: read here, it only steers the L2 hint
            hint_ws = [r.at[layer_gmem[0]] if stacked else r for r in refs[:M]]
            for i0 in range(min(p.stages, n_per)):          # the first pipeline steps' weight tiles -> L2
                g0, j0, k0 = coords(i0)
                for m in range(M):
                    plgpu.async_prefetch(
                        hint_ws[m].at[pl.ds(k0 * p.tile_d, p.tile_d), pl.ds(j0 * p.tile_f, p.tile_f)],
                        predicate=g0 < n_total)
            plgpu.griddepcontrol_wait()                      # everything below reads after the wait
        if stacked:
            refs = at_layer(refs, n_in, layer_gmem[0])
        w_gmems = refs[:M]
        s_gmems = refs[M:n_in] if block_scaled else ()
        rest = list(refs[n_in:])
        y_gmem = rest.pop(0)
        p_gmem = rest.pop(0) if sem_mode else None
        out_smem = rest.pop(0)
        if sem_mode:
            part_smem, red_smem, bar = rest[:3]
            rest = rest[3:]
            sems = pl.get_global(plgpu.SemaphoreType.REGULAR((p.f_tiles,)))
        deq_smems = rest[:M] if fp8 else ()

        gmem_scales = block_scale_reader(s_gmems, coords, p)

        def finish(vals, j):
            """vals: M float32 [tile_f, Tp] sums of tile j -> y[:, tile j] in out_dt (T rows)."""
            outs = [_silu_mul(vals[0], vals[1])] if fz.silu_mul else list(vals)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)          # previous tile's store read its SMEM
            for o in range(n_out):
                v = plgpu.layout_cast(outs[o], plgpu.Layout.WGMMA).astype(out_dt)
                out_smem.at[o].T[...] = plgpu.layout_cast(v, plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()
            for o in range(n_out):
                plgpu.copy_smem_to_gmem(out_smem.at[o, pl.ds(0, T)],
                                        y_gmem.at[o, :, pl.ds(j * p.tile_f, p.tile_f)])

        def operand(m, w_smem, s_cur):
            return widen_fp8_tile(w_smem, deq_smems[m], p) if fp8 else w_smem

        def on_flush(flush, new_accs, j):
            vals = [a * x_fac if (fp8 and not block_scaled) else a for a in new_accs]

            if not sem_mode:
                @pl.when(flush)
                def _finish():
                    finish(vals, j)
            else:
                first = lax.div(j * k_steps, n_per)
                n_contrib = lax.div((j + 1) * k_steps - 1, n_per) - first + 1
                slot = c - first

                @pl.when(jnp.logical_and(flush, slot != 0))
                def _contribute():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for m in range(M):
                        part_smem[m] = vals[m]
                    plgpu.commit_smem()
                    for m in range(M):
                        plgpu.copy_smem_to_gmem(part_smem.at[m],
                                                p_gmem.at[m, slot, pl.ds(j * p.tile_f, p.tile_f)])
                    plgpu.wait_smem_to_gmem(0)                       # the partial has landed in GMEM
                    plgpu.semaphore_signal(sems.at[j], 1, memory_scope="gpu")

                @pl.when(jnp.logical_and(flush, slot == 0))
                def _own():
                    @pl.when(n_contrib > 1)
                    def _wait():
                        plgpu.semaphore_wait(sems.at[j], n_contrib - 1, memory_scope="gpu")
                    for m in range(M):
                        red_smem[m] = vals[m]
                    for s in range(1, p.n_slots):
                        @pl.when(s < n_contrib)
                        def _add():
                            for m in range(M):
                                plgpu.copy_gmem_to_smem(p_gmem.at[m, s, pl.ds(j * p.tile_f, p.tile_f)],
                                                        part_smem.at[m], bar)
                                plgpu.barrier_wait(bar)
                                red_smem[m] = red_smem[m] + part_smem[m]
                    finish([plgpu.layout_cast(red_smem[m], plgpu.Layout.WGMMA) for m in range(M)], j)

        step = pipeline_step(p, coords, gmem_scales, operand, block_scaled, x_fac, interpret, on_flush)

        zeros = tuple(jnp.zeros((p.tile_f, p.tp), jnp.float32) for _ in range(M))
        s0 = gmem_scales(0) if block_scaled else None
        plgpu.emit_pipeline(step, grid=(n_per,), in_specs=in_specs(p, x_map, w_map, x_tr, w_tr),
                            max_concurrent_steps=p.stages, init_carry=(zeros, s0))(x_gmem, *w_gmems)
        plgpu.wait_smem_to_gmem(0)

    out_type = [jax.ShapeDtypeStruct((n_out, T, p.f), out_dt)]
    scratch = [plgpu.SMEM((n_out, p.tp, p.tile_f), out_dt)]
    if sem_mode:
        out_type.append(jax.ShapeDtypeStruct((M, p.n_slots, p.f, p.tp), jnp.float32))
        scratch += [plgpu.SMEM((M, p.tile_f, p.tp), jnp.float32), plgpu.SMEM((M, p.tile_f, p.tp), jnp.float32),
                    plgpu.Barrier(num_arrivals=1)]
    if fp8:
        scratch += [plgpu.SMEM((p.tile_d, p.tile_f), jnp.float16, transforms=deq_tr) for _ in range(M)]
    return launch(body, tuple(out_type), scratch, p.n_ctas, interpret)


@functools.lru_cache(maxsize=None)
def _jitted(plan: Plan, w_dtype, block_scaled: bool, stacked: bool, interpret: bool, fz: Fused):
    """One jitted callable per static configuration (lowered once per layer loop; see gpu._jitted_kernel)."""
    return jax.jit(kernel_call(plan, w_dtype, block_scaled, stacked, interpret, fz))


def plan_for(x_TD, ws, scales, cfg: TileConfig | None, num_sms: int | None, fz: Fused):
    """(cfg, plan) for the fused kernel, or (None, reason)."""
    t = x_TD.shape[0]
    stacked, d, f, block_scaled = split_operands(ws, scales)
    num_sms = num_sms if num_sms is not None else blocks.num_sms_default()
    w_item = jnp.dtype(ws[0].dtype).itemsize
    out_item = jnp.dtype(fz.out_dtype).itemsize if fz.out_dtype in OUT_DTYPES else 4
    if cfg is None:
        cfg = auto_config(t, d, f, len(ws), w_item, block_scaled, num_sms, fz.mode)
        if cfg is None:
            return None, f"no fused tiling fits T={t}, D={d}, F={f}, {len(ws)} matrices"
    why = unsupported_reason(x_TD, ws, scales, cfg, fz)
    if why:
        return None, why
    plan = make_plan(d, f, t, len(ws), w_item, cfg, num_sms, fz.mode, out_item)
    if plan.stages < min(2, plan.n_per):
        return None, f"tiles {cfg.tile_d}x{cfg.tile_f} at Tp={plan.tp} leave no SMEM for a 2-stage pipeline"
    if fz.mode == "sem" and plan.n_ctas > num_sms:
        return None, f"mode='sem' needs every CTA resident: {plan.n_ctas} CTAs > {num_sms} SMs"
    return cfg, plan


def auto_config(t, d, f, n_mats, w_itemsize, block_scaled, num_sms, mode,
                tun: tuning.MatmulTuning | None = None) -> TileConfig | None:
    """"direct" takes the tuning row's direct_tiles_f order (64 first: twice the CTAs of 128 on a small F); "sem"
    takes gpu.auto_config's tiles (f16 path, one warpgroup) when they fit the extra SMEM, else the largest tile_d
    that does. `tun`: the tuning row (default tuning.current())."""
    tun = tuning.current() if tun is None else tun
    tp = padded_t(t)
    fp8 = w_itemsize == 1
    tiles_f = tun.direct_tiles_f if mode == "direct" else tun.tiles_f
    if mode == "sem" and tun.narrow_f(tp, fp8):
        tiles_f = sorted(tun.tiles_f, key=lambda v: v != 64)
    for tile_f in tiles_f:
        if f % tile_f or n_mats * tile_f * tp // 128 > 128:
            continue
        if block_scaled and tile_f > BLOCK:
            continue
        best, best_key = None, None
        for tile_d in tun.tiles_d:
            if d % tile_d or (block_scaled and tile_d % BLOCK):
                continue
            cfg = TileConfig(tile_d=tile_d, tile_f=tile_f)
            plan = make_plan(d, f, t, n_mats, w_itemsize, cfg, num_sms, mode, 4)
            if plan.stages < min(2, plan.n_per):
                continue
            key = (min(plan.stages - 1, plan.n_per) * n_mats * tile_d * tile_f * w_itemsize, tile_d)
            if best_key is None or key > best_key:
                best, best_key = cfg, key
        if best is not None:
            return best
    return None


def fused_products(x_TD, ws, scales, *, layer=None, cfg: TileConfig | None = None,
                   num_sms: int | None = None, interpret: bool = False, mode: str = "direct",
                   out_dtype=None, silu_mul: bool = False, pdl: bool = False):
    """One launch: y[n_out, T, F] in out_dtype (default x's), n_out = 1 if silu_mul (silu(x@w0) * x@w1) else M.

    ws: M weights [D, F] (bf16, or fp8 with None / 128x128-block scales), or stacked [L, D, F] with
    `layer` (int32 scalar, may be traced): read in place. Raises ValueError if the kernel can't take them.
    """
    t = x_TD.shape[0]
    stacked, d, f, block_scaled = split_operands(ws, scales)
    if stacked != (layer is not None):
        raise ValueError("pass layer= exactly when the weights are stacked [L, D, F]")
    fz = Fused(mode, t, jnp.dtype(out_dtype or x_TD.dtype).name, silu_mul, pdl)
    cfg, plan = plan_for(x_TD, ws, scales, cfg, num_sms, fz)
    if cfg is None:
        raise ValueError(f"fused decode matmul kernel can't take these operands: {plan}")
    # T < 8: the x tile's TMA box is clipped to T rows (rows >= T of the SMEM tile only feed output
    # columns >= T, which are never stored), so no pad op is emitted; other ragged T pad to Tp.
    x_pad = x_TD if (plan.tp == t or t < 8) else jnp.pad(x_TD, ((0, plan.tp - t), (0, 0)))
    if is_fp8(ws[0].dtype):
        x_pad = x_to_f16(x_pad)
    args = kernel_args(x_pad, ws, scales, layer, stacked, block_scaled)
    return _jitted(plan, jnp.dtype(ws[0].dtype), block_scaled, stacked, interpret, fz)(*args)[0]



def auto_mode(t: int, d: int, f: int, n_mats: int, w_itemsize: int, num_sms: int,
              tun: tuning.MatmulTuning | None = None) -> str | None:
    """fused="auto" (the tuning row's default): "direct" where it measured faster than the partials + epilogue
    kernel in two H200 runs, else None (that kernel): bf16 at Tp <= direct_max_tp whose whole-tile runs occupy
    >= direct_min_busy of the SMs, at Tp <= direct_short_tp or D >= direct_min_d (tuning.py has the
    measurements). fp8 never ("direct" measured 0.65-0.78x the warp-specialized kernel); "sem" measured 0.9-1.06x the
    partials path: opt-in only."""
    tun = tuning.current() if tun is None else tun
    tp = padded_t(t)
    if w_itemsize != 2 or tp > tun.direct_max_tp:
        return None
    cfg = auto_config(t, d, f, n_mats, w_itemsize, False, num_sms, "direct", tun)
    if cfg is None:
        return None
    plan = make_plan(d, f, t, n_mats, w_itemsize, cfg, num_sms, "direct", 4)
    busy = plan.n_ctas / max(1, num_sms)
    if busy >= tun.direct_min_busy and (tp <= tun.direct_short_tp or d >= tun.direct_min_d):
        return "direct"
    return None
