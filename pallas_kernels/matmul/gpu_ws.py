"""Warp-specialized variant of the decode weight-streaming kernel (gpu.py): why it exists.

gpu.py's kernel runs one warpgroup per CTA that both issues the TMA loads and does the work of
each step (fp8 -> 16-bit conversion, wgmma, waits). For fp8 weights that one warpgroup's
conversion is the bottleneck, and with bf16 at larger T the single warpgroup serializes the
wgmma waits with the partial flushes. Here `plgpu.emit_pipeline_warp_specialized` gives each
CTA one memory warpgroup (TMA producer, few registers) and `n_wg` compute warpgroups; the F tile
(tile_f rows) is split between them, each converting and multiplying its own tile_f / n_wg rows
against the shared x tile, with its own accumulators, and writing its own slice of the float32
partials. The work split (stream-K runs), partial layout P[M, slots, F, Tp] and the epilogue
are gpu.py's, so `gpu.reduce_partials` applies unchanged; the shared pipeline pieces are gpu_blocks.py's.

Selected by `TileConfig(n_wg=2, ...)`; gpu.raw_partials dispatches here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.matmul.gpu_blocks import (X_SHIFT, block_scale_reader, body_refs, in_specs, launch, partials_flush,
                                              pipeline_step, stream_k_maps, tile_transforms, widen_fp8_tile)
from pallas_kernels.matmul.reference import is_fp8

MEMORY_REGISTERS = 40


def kernel_call_ws(plan, w_dtype, block_scaled: bool, stacked: bool, interpret: bool):
    """plgpu.kernel computing partials P[M, slots, F, Tp] like gpu._kernel_call, warp-specialized."""
    p = plan
    M, n_wg = p.n_mats, p.n_wg
    wg_f = p.tile_f // n_wg
    fp8 = is_fp8(w_dtype)
    f16 = fp8 and p.fp8_via == "f16"
    if fp8 and not f16:
        raise ValueError("the warp-specialized kernel takes fp8 weights only with fp8_via='f16'")
    x_fac = float(2 ** X_SHIFT) if f16 else 1.0
    x_tr, w_tr, deq_tr = tile_transforms(p.tile_d, wg_f, jnp.dtype(w_dtype).itemsize)

    def body(x_gmem, *refs):
        w_gmems, s_gmems, (p_gmem, out_smem, *deq_smems) = body_refs(refs, M, block_scaled, stacked)
        c = lax.axis_index("cta")
        coords, w_map, x_map = stream_k_maps(c, p.n_per, p.n_total, p.k_steps)
        specs = in_specs(p, x_map, w_map, x_tr, w_tr)

        def pipeline_for(step_fn, ctx):
            return plgpu.emit_pipeline_warp_specialized(
                step_fn, grid=(p.n_per,), memory_registers=MEMORY_REGISTERS, in_specs=specs,
                wg_axis="wg", num_compute_wgs=n_wg, max_concurrent_steps=p.stages,
                compute_context=ctx)

        def scoped(allocs):
            wg = lax.axis_index("wg")
            cols = pl.ds(wg * wg_f, wg_f)
            # block scales of step i (clamped) for this warpgroup's F rows
            gmem_scales = block_scale_reader(s_gmems, coords, p, row0=wg * wg_f)

            def operand(m, w_smem, s_cur):
                w_mine = w_smem.at[:, cols]
                return widen_fp8_tile(w_mine, deq_smems[m].at[wg], p) if f16 else w_mine

            on_flush = partials_flush(p, c, out_smem, p_gmem, x_fac if (f16 and not block_scaled) else 1.0,
                                      at=(wg,), col0=wg * wg_f, cols=wg_f)

            step = pipeline_step(p, coords, gmem_scales, operand, block_scaled, x_fac, interpret, on_flush)

            def compute_context(run):
                zeros = tuple(jnp.zeros((wg_f, p.tp), jnp.float32) for _ in range(M))
                s0 = gmem_scales(0) if block_scaled else None
                run((zeros, s0))
                plgpu.wait_smem_to_gmem(0)

            pipeline_for(step, compute_context)(x_gmem, *w_gmems, allocations=allocs)

        ignore = lambda *_, **__: None  # noqa: E731 - bodies don't change the allocations
        pl.run_scoped(scoped, pipeline_for(ignore, ignore).get_allocations(x_gmem, *w_gmems),
                      collective_axes="wg")

    scratch = [plgpu.SMEM((n_wg, M, wg_f, p.tp), jnp.float32)]
    if f16:
        scratch += [plgpu.SMEM((n_wg, p.tile_d, wg_f), jnp.float16, transforms=deq_tr) for _ in range(M)]
    return launch(body, jax.ShapeDtypeStruct((M, p.n_slots, p.f, p.tp), jnp.float32), scratch, p.n_ctas, interpret,
                  num_threads=n_wg + 1, thread_name="wg")
