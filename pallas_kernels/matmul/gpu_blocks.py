"""Building blocks shared by the decode weight-streaming kernels (gpu.py, gpu_fused.py, gpu_ws.py).

Why a module of its own: the three kernels run the same pipeline (stream-K runs of (F tile, D step) steps, TMA
tiles of x and the weights, e4m3 -> f16 widening, wgmma accumulation, 128x128 block scales read one step ahead)
and differ in how a CTA finishes an F tile: the two partials kernels (gpu.py, gpu_ws.py) write their slot of the
partial buffer alike (partials_flush), the one-launch kernel (gpu_fused.py) finishes the tile itself. The pieces they
share live here; each kernel module keeps its own body, and gpu.py chooses between them. Nothing here imports a kernel
module.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.matmul.reference import BLOCK, is_fp8
from pallas_kernels.utils import device_sm_count, round_up

MAX_T = 256          # wgmma N limit
X_SHIFT = 6          # fp8 "f16" path: x enters as f16(x * 2^-6): exact for 2^-8 <= |x| <= 2^22
SMEM_LIMIT = 227 * 1024


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tunable knobs. tile_f: F rows per CTA (multiple of 64); tile_d: D per pipeline step."""
    tile_d: int = 128
    tile_f: int = 128
    max_stages: int = 8
    smem_budget: int = 200 * 1024
    ctas_per_sm: int = 1
    # fp8 weights: "bf16" converts e4m3 -> f32 -> bf16 in SMEM with the block scale folded into
    # the weights; "f16" converts e4m3 -> f16 (one cvt per pair, exact), runs the wgmma in f16
    # with x cast to f16 (pre-scaled by 2^-X_SHIFT) and applies each 128x128 block scale to a
    # per-block float32 product. Ignored for bf16 weights.
    fp8_via: str = "f16"
    deq_rows: int = 128  # rows of the fp8 tile converted per load/convert/store round (<= tile_d)
    # compute warpgroups per CTA; > 1 selects the warp-specialized kernel (gpu_ws.py): a TMA
    # producer warpgroup plus n_wg compute warpgroups, each taking tile_f / n_wg of the F rows
    n_wg: int = 1
    # "8bit": load fp8 tiles in the WGMMA_8BIT register layout (4 bytes per lane, full-width SMEM
    # loads; H200: +0-21%); "auto": Mosaic's inferred layout (the WGMMA layout, 2 bytes per lane)
    deq_layout: str = "8bit"


@dataclasses.dataclass(frozen=True)
class Plan:
    d: int
    f: int
    tp: int
    n_mats: int
    tile_d: int
    tile_f: int
    k_steps: int       # D steps per F tile
    f_tiles: int
    n_total: int       # f_tiles * k_steps
    n_per: int         # steps per CTA
    n_ctas: int
    n_slots: int
    stages: int
    slot_mask: tuple   # [n_slots][f_tiles] bools: was partial (slot, tile) written
    fp8_via: str = "bf16"
    deq_rows: int = 64
    n_wg: int = 1
    deq_layout: str = "8bit"


def padded_t(t: int) -> int:
    return max(8, round_up(t, 8))


def stage_bytes(tp, tile_d, tile_f, n_mats, w_itemsize):
    return tp * tile_d * 2 + n_mats * tile_d * tile_f * w_itemsize


def slots_of_runs(k_steps: int, f_tiles: int, n_per: int):
    """(n_slots, slot_mask) of runs of n_per steps over the F-tile-major (F tile, D step) space: the most CTAs
    that touch one F tile, and [slot][tile] whether that many touch it."""
    first = [(j * k_steps) // n_per for j in range(f_tiles)]
    last = [((j + 1) * k_steps - 1) // n_per for j in range(f_tiles)]
    n_slots = max(l - fi + 1 for fi, l in zip(first, last))
    mask = tuple(tuple(s <= last[j] - first[j] for j in range(f_tiles)) for s in range(n_slots))
    return n_slots, mask


def pipeline_stages(cfg: TileConfig, n_per: int, fixed: int, per_stage: int) -> int:
    """Pipeline depth that fits the SMEM left after `fixed` bytes, at most cfg.max_stages and n_per."""
    budget = min(cfg.smem_budget, SMEM_LIMIT // cfg.ctas_per_sm) - fixed
    return int(min(cfg.max_stages, n_per, max(0, budget // per_stage)))


def split_operands(ws, scales):
    """(stacked, D, F, block_scaled) of M weights [D, F] or [L, D, F] and their scales."""
    stacked = ws[0].ndim == 3
    d, f = ws[0].shape[-2:]
    block_scaled = scales[0] is not None and scales[0].ndim == (3 if stacked else 2)
    return stacked, d, f, block_scaled


def unsupported_reason(x_TD, ws, scales, cfg: TileConfig) -> str | None:
    """Why the stream-K kernels can't take these operands (None if they can)."""
    t = x_TD.shape[0]
    stacked, d, f, block_scaled = split_operands(ws, scales)
    if jnp.dtype(x_TD.dtype) != jnp.bfloat16:
        return f"x dtype {x_TD.dtype} (kernel takes bf16 activations)"
    wdt = {jnp.dtype(w.dtype) for w in ws}
    if len(wdt) != 1:
        return f"weights of mixed dtypes {wdt}"
    wdt = wdt.pop()
    if not (wdt == jnp.bfloat16 or is_fp8(wdt)):
        return f"weight dtype {wdt} (kernel takes bf16 or float8_e4m3fn)"
    if not 1 <= t <= MAX_T:
        return f"T={t} outside 1..{MAX_T}"
    if cfg.fp8_via not in ("bf16", "f16"):
        return f"fp8_via={cfg.fp8_via!r} (use 'bf16' or 'f16')"
    if cfg.deq_rows % 8 or cfg.tile_d % min(cfg.deq_rows, cfg.tile_d):
        return f"deq_rows={cfg.deq_rows} must be a multiple of 8 dividing tile_d={cfg.tile_d}"
    if cfg.tile_f % 64 or cfg.tile_d % 64:
        return f"tile sizes {cfg.tile_d}x{cfg.tile_f} must be multiples of 64"
    if cfg.n_wg < 1 or cfg.tile_f % (64 * cfg.n_wg):
        return f"n_wg={cfg.n_wg} warpgroups need tile_f={cfg.tile_f} to split into multiples of 64"
    if cfg.n_wg > 1 and is_fp8(wdt) and cfg.fp8_via != "f16":
        return "the warp-specialized kernel (n_wg > 1) takes fp8 weights only with fp8_via='f16'"
    if d % cfg.tile_d:
        return f"D={d} not a multiple of tile_d={cfg.tile_d}"
    if f % cfg.tile_f:
        return f"F={f} not a multiple of tile_f={cfg.tile_f}"
    if block_scaled:
        if cfg.tile_d % BLOCK or cfg.tile_f > BLOCK * cfg.n_wg:
            return f"block scales need tile_f <= {BLOCK} per warpgroup and tile_d a multiple of {BLOCK}"
    if any(s is not None for s in scales) and any(s is None for s in scales):
        return "some matrices scaled and some not"
    if len({None if s is None else s.ndim for s in scales}) > 1:
        return "mixed scale kinds"
    return None


def num_sms_default() -> int:
    return device_sm_count()


def x_to_f16(x):
    """x as the fp8 "f16" path takes it: f16(x * 2^-X_SHIFT)."""
    return (x.astype(jnp.float32) * (2.0 ** -X_SHIFT)).astype(jnp.float16)


def kernel_args(x_pad, ws, scales, layer, stacked: bool, block_scaled: bool) -> list:
    """The kernels' operands in order: x, (int32 [1] layer), weights, (block scales)."""
    args = [x_pad]
    if stacked:
        args.append(jnp.asarray(layer, jnp.int32).reshape(1))
    args += list(ws)
    if block_scaled:
        args += list(scales)
    return args


def launch(body, out_type, scratch, n_ctas: int, interpret: bool, **kernel_kw):
    """plgpu.kernel over a 1-D grid of CTAs ("cta"), warpgroup semantics; interpret mode off-GPU."""
    kw = dict(interpret=plgpu.InterpretGPUParams()) if interpret else {}
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(n_ctas,),
        grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **kernel_kw,
        **kw,
    )


# ---- inside a kernel body ----

def tiled(minor_bytes_per_row: int, itemsize: int):
    swizzle = plgpu.find_swizzle(minor_bytes_per_row * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def tile_transforms(tile_d: int, w_cols: int, w_item: int):
    """SMEM transforms of the x tile, a weight tile of w_cols F columns, and a 16-bit widened weight tile."""
    return (tiled(min(tile_d, 64) * 2, 2), tiled(min(w_cols, 128 // w_item) * w_item, w_item), tiled(64 * 2, 2))


def at_layer(refs, n_in: int, layer):
    """The first n_in refs (weights, scales) at stacked layer `layer`; the rest unchanged."""
    return [r.at[layer] for r in refs[:n_in]] + list(refs[n_in:])


def body_refs(refs, n_mats: int, block_scaled: bool, stacked: bool):
    """(weights, block scales, the remaining refs) of a kernel body's refs after x; when stacked, the leading int32
    [1] layer index is consumed and applied to the weights and scales (read in place)."""
    n_in = n_mats * (2 if block_scaled else 1)
    if stacked:
        layer_gmem, *refs = refs
        refs = at_layer(refs, n_in, layer_gmem[0])
    return refs[:n_mats], refs[n_mats:n_in], list(refs[n_in:])


def in_specs(p: Plan, x_map, w_map, x_tr, w_tr) -> list:
    """Pipeline inputs: the x tile [Tp, tile_d] and one [tile_d, tile_f] tile of each of the M weights."""
    return ([plgpu.BlockSpec((p.tp, p.tile_d), x_map, transforms=x_tr)]
            + [plgpu.BlockSpec((p.tile_d, p.tile_f), w_map, transforms=w_tr)] * p.n_mats)


def stream_k_maps(cta, n_per: int, n_total: int, k_steps: int):
    """Index maps of one CTA's stream-K run: coords(i) -> (global step, F tile, D step), w_map, x_map."""
    def coords(i):
        g = cta * n_per + i
        gc = jnp.minimum(g, n_total - 1)
        return g, lax.div(gc, k_steps), lax.rem(gc, k_steps)

    def w_map(i):
        _, j, k = coords(i)
        return (k, j)

    def x_map(i):
        _, _, k = coords(i)
        return (0, k)
    return coords, w_map, x_map


def block_scale_reader(s_gmems, coords, p: Plan, row0=0):
    """gmem_scales(i): the 128x128-block scales of step i (clamped to the run), per matrix and 128-row block of the
    step, read straight from GMEM (scalar loads) for the F rows starting at j * tile_f + row0."""
    rb_per_step = p.tile_d // BLOCK

    def gmem_scales(i):
        _, j, k = coords(jnp.minimum(i, p.n_per - 1))
        fb = lax.div(j * p.tile_f + row0, BLOCK)
        return tuple(tuple(s[k * rb_per_step + rb, fb] for rb in range(rb_per_step)) for s in s_gmems)
    return gmem_scales


def tile_done(p: Plan, g, k, i):
    """Whether step i (global step g, D step k) ends this CTA's work on its F tile: last D step or end of run."""
    return jnp.logical_and(g < p.n_total, jnp.logical_or(k == p.k_steps - 1, i == p.n_per - 1))


def reset_if(flush, accs):
    """The accumulators, zeroed where the tile was flushed."""
    keep = jnp.where(flush, 0.0, 1.0).astype(jnp.float32)
    return tuple(a * keep for a in accs)


def mma_accumulate(acc, a_ref, b_ref, interpret: bool):
    """acc + a @ b with wgmma, both operands in SMEM; waits for the result.

    On the GPU the running sum is the wgmma accumulator itself (registers, no copy). GPU
    interpret mode cannot run that form (it supports neither pl.run_state nor stores into an
    accumulator), so there a fresh accumulator's product is added instead: the same sum.
    """
    if interpret:
        def mma(acc_ref):
            plgpu.wgmma(acc_ref, a_ref, b_ref)
            return acc_ref[...]
        return acc + pl.run_scoped(mma, plgpu.ACC(acc.shape, jnp.float32))

    def mma_in_place(acc_ref):
        plgpu.wgmma(acc_ref, a_ref, b_ref)
    return pl.run_state(mma_in_place)(plgpu.ACC.init(acc))


def mma_fresh(shape, a_ref, b_ref):
    """a @ b with wgmma into a fresh float32 accumulator; returns the product (waited for)."""
    def mma(acc_ref):
        plgpu.wgmma(acc_ref, a_ref, b_ref)
        return acc_ref[...]
    return pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))


def block_scaled_mma(acc, a_ref, x_smem, scales, x_fac: float):
    """acc + sum over the 128-row scale blocks rb of this step: (a_rb^T x_rb^T) * scales[rb] * x_fac.

    One fresh float32 product per scale block, scaled in registers (the fp8 'f16' path).
    """
    rb_per_step = len(scales)
    for rb in range(rb_per_step):
        if rb_per_step == 1:
            a_blk, x_blk = a_ref, x_smem
        else:
            ks = pl.ds(rb * BLOCK, BLOCK)
            a_blk, x_blk = a_ref.at[ks], x_smem.at[:, ks]
        prod = mma_fresh(acc.shape, a_blk.transpose((1, 0)), x_blk.transpose((1, 0)))
        acc = acc + prod * (scales[rb] * x_fac)
    return acc


def accumulate(acc, a_ref, x_smem, scales, x_fac: float, interpret: bool):
    """One step's product onto acc: per-block scaled products when `scales` (this matrix's block scales of the
    step) are given, else a plain wgmma accumulation of a^T x^T."""
    if scales is not None:
        return block_scaled_mma(acc, a_ref, x_smem, list(scales), x_fac)
    return mma_accumulate(acc, a_ref.transpose((1, 0)), x_smem.transpose((1, 0)), interpret)


def pipeline_step(p: Plan, coords, gmem_scales, operand, scaled_mma: bool, x_fac: float, interpret: bool,
                  on_flush):
    """The pipeline step every kernel runs: read the next step's block scales (carried, so their latency hides
    behind a step), accumulate each matrix m's operand(m, w_smem, s_cur) (the weight tile or its widened copy in
    SMEM) onto its running sum (per-block scaled products when scaled_mma), call on_flush(flush, sums, j) (the
    kernel's own way to finish F tile j, under pl.when(flush)), and zero the sums where the tile was flushed."""
    def step(idx, x_smem, *smems_and_carry):
        (i,) = idx
        *w_smems, (accs, s_cur) = smems_and_carry
        g, j, k = coords(i)
        s_next = gmem_scales(i + 1) if s_cur is not None else None
        new_accs = []
        for m in range(p.n_mats):
            a_ref = operand(m, w_smems[m], s_cur)
            new_accs.append(accumulate(accs[m], a_ref, x_smem, s_cur[m] if scaled_mma else None, x_fac, interpret))
        flush = tile_done(p, g, k, i)
        on_flush(flush, new_accs, j)
        return reset_if(flush, new_accs), s_next
    return step


def partials_flush(p: Plan, cta, out_smem, p_gmem, out_fac: float, at=(), col0=0, cols=None):
    """on_flush for the partials kernels (gpu.py, gpu_ws.py): under pl.when(flush), store each matrix's sum of F tile
    j (times out_fac) in out_smem[*at, m] and copy it to its slot of P[M, slots, F, Tp], rows col0 .. col0 + cols of
    the tile (cols: the whole tile_f by default). at=(wg,), col0=wg * cols: one compute warpgroup's share."""
    cols = p.tile_f if cols is None else cols

    def on_flush(flush, new_accs, j):
        @pl.when(flush)
        def _flush():
            slot = cta - lax.div(j * p.k_steps, p.n_per)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            for m in range(p.n_mats):
                # out_fac: the unscaled/per-channel f16 path still carries x's 2^-X_SHIFT
                out_smem[(*at, m)] = new_accs[m] * out_fac if out_fac != 1.0 else new_accs[m]
            plgpu.commit_smem()
            for m in range(p.n_mats):
                plgpu.copy_smem_to_gmem(out_smem.at[(*at, m)], p_gmem.at[m, slot, pl.ds(j * p.tile_f + col0, cols)])
    return on_flush


def widen_fp8_tile(w_smem, dst_smem, p):
    """Widen an e4m3 weight tile in SMEM to an f16 copy (exact, one cvt per pair; the scales stay out of the
    weights), `p.deq_rows` rows at a time; returns the copy for the wgmma. Inside a Mosaic GPU kernel body."""
    for r in range(p.tile_d // p.deq_rows):
        rows = pl.ds(r * p.deq_rows, p.deq_rows)
        v = w_smem.at[rows][...]
        if p.deq_layout == "8bit":   # 4 bytes per lane: full-width SMEM loads
            v = plgpu.layout_cast(v, plgpu.Layout.WGMMA_8BIT)
        dst_smem.at[rows][...] = v.astype(jnp.float16)
    plgpu.commit_smem()
    return dst_smem
