"""Warp-specialized variant of the decode weight-streaming kernel (gpu.py): why it exists.

gpu.py's kernel runs one warpgroup per CTA that both issues the TMA loads and does the work of
each step (fp8 -> 16-bit conversion, wgmma, waits). For fp8 weights that one warpgroup's
conversion is the bottleneck, and with bf16 at larger T the single warpgroup serializes the
wgmma waits with the partial flushes. Here `plgpu.emit_pipeline_warp_specialized` gives each
CTA one memory warpgroup (TMA producer, few registers) and `n_wg` compute warpgroups; the F tile
(tile_f rows) is split between them, each converting and multiplying its own tile_f / n_wg rows
against the shared x tile, with its own accumulators, and writing its own slice of the float32
partials. The work split (stream-K runs), partial layout P[M, slots, F, Tp] and the epilogue
are gpu.py's, so `gpu.reduce_partials` applies unchanged.

Selected by `gpu.TileConfig(n_wg=2, ...)`; gpu.raw_partials dispatches here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.matmul.reference import BLOCK, is_fp8

MEMORY_REGISTERS = 40


def kernel_call_ws(plan, w_dtype, block_scaled: bool, stacked: bool, interpret: bool):
    """plgpu.kernel computing partials P[M, slots, F, Tp] like gpu._kernel_call, warp-specialized."""
    from pallas_kernels.matmul import gpu  # late import: gpu imports this module lazily too

    p = plan
    M, n_wg = p.n_mats, p.n_wg
    wg_f = p.tile_f // n_wg
    fp8 = is_fp8(w_dtype)
    f16 = fp8 and p.fp8_via == "f16"
    if fp8 and not f16:
        raise ValueError("the warp-specialized kernel takes fp8 weights only with fp8_via='f16'")
    x_fac = float(2 ** gpu.X_SHIFT) if f16 else 1.0
    w_item = jnp.dtype(w_dtype).itemsize
    x_tr = gpu._tiled(min(p.tile_d, 64) * 2, 2)
    w_tr = gpu._tiled(min(wg_f, 128 // w_item) * w_item, w_item)
    deq_tr = gpu._tiled(64 * 2, 2)
    n_per, n_total, k_steps = p.n_per, p.n_total, p.k_steps
    rb_per_step = p.tile_d // BLOCK
    n_sc = M * (2 if block_scaled else 1)

    def body(x_gmem, *refs):
        if stacked:
            layer_gmem, *refs = refs
            layer = layer_gmem[0]
            refs = [r.at[layer] for r in refs[:n_sc]] + list(refs[n_sc:])
        w_gmems = refs[:M]
        s_gmems = refs[M:2 * M] if block_scaled else ()
        p_gmem, out_smem, *deq_smems = refs[n_sc:]
        c = lax.axis_index("cta")
        coords, w_map, x_map = gpu._stream_k_maps(c, n_per, n_total, k_steps)

        in_specs = [plgpu.BlockSpec((p.tp, p.tile_d), x_map, transforms=x_tr)]
        in_specs += [plgpu.BlockSpec((p.tile_d, p.tile_f), w_map, transforms=w_tr)] * M

        def pipeline_for(step_fn, ctx):
            return plgpu.emit_pipeline_warp_specialized(
                step_fn, grid=(n_per,), memory_registers=MEMORY_REGISTERS, in_specs=in_specs,
                wg_axis="wg", num_compute_wgs=n_wg, max_concurrent_steps=p.stages,
                compute_context=ctx)

        def scoped(allocs):
            wg = lax.axis_index("wg")
            cols = pl.ds(wg * wg_f, wg_f)

            def gmem_scales(i):  # block scales of step i (clamped) for this warpgroup's F rows
                _, j, k = coords(jnp.minimum(i, n_per - 1))
                fb = lax.div(j * p.tile_f + wg * wg_f, BLOCK)
                return tuple(tuple(s_gmems[m][k * rb_per_step + rb, fb] for rb in range(rb_per_step))
                             for m in range(M))

            def step(idx, x_smem, *smems_and_carry):
                (i,) = idx
                *w_smems, (accs, s_cur) = smems_and_carry
                g, j, k = coords(i)
                s_next = gmem_scales(i + 1) if block_scaled else None
                x_t = x_smem.transpose((1, 0))
                new_accs = []
                for m in range(M):
                    w_mine = w_smems[m].at[:, cols]
                    if f16:
                        dst = deq_smems[m].at[wg]
                        for r in range(p.tile_d // p.deq_rows):
                            rows = pl.ds(r * p.deq_rows, p.deq_rows)
                            v = w_mine.at[rows][...]
                            if p.deq_layout == "8bit":
                                v = plgpu.layout_cast(v, plgpu.Layout.WGMMA_8BIT)
                            dst.at[rows][...] = v.astype(jnp.float16)
                        plgpu.commit_smem()
                        a_ref = dst
                    else:
                        a_ref = w_mine
                    if block_scaled:
                        new_accs.append(gpu._block_scaled_mma(accs[m], a_ref, x_smem,
                                                              [s_cur[m][rb] for rb in range(rb_per_step)], x_fac))
                    else:
                        new_accs.append(gpu._mma_accumulate(accs[m], a_ref.transpose((1, 0)), x_t, interpret))
                flush = jnp.logical_and(g < n_total, jnp.logical_or(k == k_steps - 1, i == n_per - 1))

                @pl.when(flush)
                def _flush():
                    slot = c - lax.div(j * k_steps, n_per)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for m in range(M):
                        out_smem[wg, m] = new_accs[m] * x_fac if (f16 and not block_scaled) else new_accs[m]
                    plgpu.commit_smem()
                    for m in range(M):
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg, m],
                            p_gmem.at[m, slot, pl.ds(j * p.tile_f + wg * wg_f, wg_f)])

                keep = jnp.where(flush, 0.0, 1.0).astype(jnp.float32)
                return tuple(a * keep for a in new_accs), s_next

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
    kw = dict(interpret=plgpu.InterpretGPUParams()) if interpret else {}
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((M, p.n_slots, p.f, p.tp), jnp.float32),
        scratch_types=scratch,
        grid=(p.n_ctas,),
        grid_names=("cta",),
        num_threads=n_wg + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **kw,
    )

