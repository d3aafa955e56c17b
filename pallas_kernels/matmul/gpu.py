"""Mosaic GPU (Hopper) weight-streaming matmul for decode: y[T, F] = x[T, D] @ w[D, F].

Why it exists: at decode T is 1..256, so every weight byte is used T times at most and the
matmul is bound by how fast the weights stream out of HBM. XLA's paths reach 1.0-2.7 TB/s of
the H200's ~4.3 (issue 9). This kernel is built only to stream:

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
  partial_products take `fused=` ("default" = FUSED_DEFAULT = "auto"): there the kernel itself
  finishes each F tile and writes the final [T, F] (cast, gate/up SiLU*mul, transposed in the
  kernel). "direct" (no split over D, whole F tiles per CTA) is taken where it measured faster
  (gpu_fused.auto_mode); "sem" (this stream-K split, partials combined by the tile's owner CTA
  through global semaphores) is opt-in: it measured no faster than partials + epilogue.

The plan (tile sizes, runs, slots) is static Python computed from the shapes. Options
(TileConfig): ctas_per_sm, n_wg > 1 (warp-specialized kernel in gpu_ws.py: a TMA producer
warpgroup and n_wg compute warpgroups splitting the F tile), deq_layout="8bit" (fp8 tiles loaded
4 bytes per lane), deq_rows.

Measured on an H200 (benchmarks/RESULTS.md, copy ceiling 4.26 TB/s in the same run, git 4dfb16d):
bf16 whole op 3.3-3.4 TB/s on the 117-235 MB Llama-8B matrices at T <= 8 (78-80%), 2.3-2.5 on
the <= 50 MB ones, falling with T; a fit over shapes gives a stream rate of 3.7 TB/s (87%) at
T <= 8 plus a fixed ~6 us per call, which is what holds the small matrices back. fp8 with block
scales (f16 path) 1.2-2.1 TB/s of fp8 bytes, up to 2.75 with the defaults chosen after that run.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.matmul.reference import BLOCK, is_fp8

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
    return max(8, -(-t // 8) * 8)


def _stage_bytes(tp, tile_d, tile_f, n_mats, w_itemsize):
    return tp * tile_d * 2 + n_mats * tile_d * tile_f * w_itemsize


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
    first = [(j * k_steps) // n_per for j in range(f_tiles)]
    last = [((j + 1) * k_steps - 1) // n_per for j in range(f_tiles)]
    n_slots = max(l - fi + 1 for fi, l in zip(first, last))
    mask = tuple(tuple(s <= last[j] - first[j] for j in range(f_tiles)) for s in range(n_slots))
    fixed = n_mats * tile_f * tp * 4                              # out staging
    if w_itemsize == 1:
        fixed += n_mats * tile_d * tile_f * 2                     # bf16 dequant buffers
    per_stage = _stage_bytes(tp, tile_d, tile_f, n_mats, w_itemsize)
    budget = min(cfg.smem_budget, SMEM_LIMIT // cfg.ctas_per_sm) - fixed
    stages = int(min(cfg.max_stages, n_per, max(0, budget // per_stage)))
    return Plan(d, f, tp, n_mats, tile_d, tile_f, k_steps, f_tiles, n_total, n_per, n_ctas,
                n_slots, stages, mask, cfg.fp8_via, min(cfg.deq_rows, tile_d), cfg.n_wg, cfg.deq_layout)


def unsupported_reason(x_TD, ws, scales, cfg: TileConfig) -> str | None:
    """Why the kernel can't take these operands (None if it can)."""
    t = x_TD.shape[0]
    stacked, d, f, block_scaled = _split(ws, scales)
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


def _tiled(minor_bytes_per_row: int, itemsize: int):
    swizzle = plgpu.find_swizzle(minor_bytes_per_row * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _mma_accumulate(acc, a_ref, b_ref, interpret: bool):
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


def _mma_fresh(shape, a_ref, b_ref):
    """a @ b with wgmma into a fresh float32 accumulator; returns the product (waited for)."""
    def mma(acc_ref):
        plgpu.wgmma(acc_ref, a_ref, b_ref)
        return acc_ref[...]
    return pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))


def _block_scaled_mma(acc, a_ref, x_smem, scales, x_fac: float):
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
        prod = _mma_fresh(acc.shape, a_blk.transpose((1, 0)), x_blk.transpose((1, 0)))
        acc = acc + prod * (scales[rb] * x_fac)
    return acc


def _stream_k_maps(cta, n_per: int, n_total: int, k_steps: int):
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


def _kernel_call(plan: Plan, w_dtype, block_scaled: bool, stacked: bool, interpret: bool):
    """Builds the plgpu.kernel computing partials P[M, slots, F, Tp] from x [Tp, D], M weights (+ scales).

    stacked: the weights (and scales) carry a leading layer axis and the kernel's second input
    is an int32 [1] layer index; the kernel reads that layer's tiles in place (no slice copy).
    block_scaled: each step's 128x128-block scales are read from GMEM one step ahead and carried
    through the pipeline, so the load latency hides behind a step. (Staging scales in SMEM by TMA
    was tried: per-step 16-byte tiles gave misaligned TMA destinations, a per-CTA scale window
    raised an illegal instruction on the H200; plain scalar loads work.)
    """
    p = plan
    M = p.n_mats
    fp8 = is_fp8(w_dtype)
    f16 = fp8 and p.fp8_via == "f16"
    deq_dtype = jnp.float16 if f16 else jnp.bfloat16
    x_fac = float(2 ** X_SHIFT) if f16 else 1.0
    w_item = jnp.dtype(w_dtype).itemsize
    x_tr = _tiled(min(p.tile_d, 64) * 2, 2)
    w_tr = _tiled(min(p.tile_f, 128 // w_item) * w_item, w_item)
    deq_tr = _tiled(64 * 2, 2)
    n_per, n_total, k_steps = p.n_per, p.n_total, p.k_steps

    def body(x_gmem, *refs):
        if stacked:
            layer_gmem, *refs = refs
            layer = layer_gmem[0]
            refs = [r.at[layer] for r in refs[:M * (2 if block_scaled else 1)]] + refs[M * (2 if block_scaled else 1):]
        w_gmems = refs[:M]
        s_gmems = refs[M:2 * M] if block_scaled else ()
        rest = refs[2 * M:] if block_scaled else refs[M:]
        p_gmem, out_smem, *rest = rest
        deq_smems = rest[:M] if fp8 else ()          # one bf16 dequant buffer per matrix
        c = lax.axis_index("cta")
        coords, w_map, x_map = _stream_k_maps(c, n_per, n_total, k_steps)

        def fb_of(j):  # the F scale block of F tile j
            return lax.div(j * p.tile_f, BLOCK)

        rb_per_step = p.tile_d // BLOCK

        def gmem_scales(i):  # block scales of step i (clamped), read straight from GMEM
            _, j, k = coords(jnp.minimum(i, n_per - 1))
            return tuple(tuple(s_gmems[m][k * rb_per_step + rb, fb_of(j)] for rb in range(rb_per_step))
                         for m in range(M))

        in_specs = [plgpu.BlockSpec((p.tp, p.tile_d), x_map, transforms=x_tr)]
        in_specs += [plgpu.BlockSpec((p.tile_d, p.tile_f), w_map, transforms=w_tr)] * M

        def step(idx, x_smem, *smems_and_carry):
            (i,) = idx
            *smems, (accs, s_cur) = smems_and_carry
            g, j, k = coords(i)
            s_next = gmem_scales(i + 1) if s_cur is not None else None
            w_smems = smems[:M]
            x_t = x_smem.transpose((1, 0))
            new_accs = []
            for m in range(M):
                if f16:
                    a_ref = widen_fp8_tile(w_smems[m], deq_smems[m], p)
                elif fp8:
                    dst = deq_smems[m]
                    for r in range(p.tile_d // 64):
                        rows = pl.ds(r * 64, 64)
                        # fp8 -> bf16 goes through f32: this ptxas has no direct e4m3 -> bf16 cvt
                        v = w_smems[m].at[rows][...].astype(jnp.float32)
                        if block_scaled:
                            # one scale per 128x128 block; tile_f <= 128 (checked by unsupported_reason)
                            v = v * s_cur[m][(r * 64) // BLOCK]
                        dst.at[rows][...] = v.astype(jnp.bfloat16)
                    plgpu.commit_smem()
                    a_ref = dst
                else:
                    a_ref = w_smems[m]

                if f16 and block_scaled:
                    # one fresh float32 product per 128-row scale block, scaled in registers
                    new_accs.append(_block_scaled_mma(accs[m], a_ref, x_smem,
                                                      [s_cur[m][rb] for rb in range(rb_per_step)], x_fac))
                else:
                    new_accs.append(_mma_accumulate(accs[m], a_ref.transpose((1, 0)), x_t, interpret))
            flush = jnp.logical_and(g < n_total,
                                    jnp.logical_or(k == k_steps - 1, i == n_per - 1))

            @pl.when(flush)
            def _flush():
                slot = c - lax.div(j * k_steps, n_per)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for m in range(M):
                    # x_fac: the unscaled/per-channel f16 path still carries x's 2^-X_SHIFT
                    out_smem[m] = new_accs[m] * x_fac if (f16 and not block_scaled) else new_accs[m]
                plgpu.commit_smem()
                for m in range(M):
                    plgpu.copy_smem_to_gmem(
                        out_smem.at[m], p_gmem.at[m, slot, pl.ds(j * p.tile_f, p.tile_f)])

            keep = jnp.where(flush, 0.0, 1.0).astype(jnp.float32)
            return tuple(a * keep for a in new_accs), s_next

        zeros = tuple(jnp.zeros((p.tile_f, p.tp), jnp.float32) for _ in range(M))
        s0 = gmem_scales(0) if block_scaled else None
        plgpu.emit_pipeline(step, grid=(n_per,), in_specs=in_specs, max_concurrent_steps=p.stages,
                            init_carry=(zeros, s0))(x_gmem, *w_gmems)
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((M, p.tile_f, p.tp), jnp.float32)]
    if fp8:
        scratch += [plgpu.SMEM((p.tile_d, p.tile_f), deq_dtype, transforms=deq_tr) for _ in range(M)]
    kw = dict(interpret=plgpu.InterpretGPUParams()) if interpret else {}
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((M, p.n_slots, p.f, p.tp), jnp.float32),
        scratch_types=scratch,
        grid=(p.n_ctas,),
        grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **kw,
    )


def num_sms_default() -> int:
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            return int(dev.core_count)
    except Exception:  # noqa: BLE001 - no device info: fall back to the H100/H200 count
        pass
    return 132


def auto_config(t: int, d: int, f: int, n_mats: int, w_itemsize: int, block_scaled: bool,
                num_sms: int) -> TileConfig | None:
    """Tile sizes for a problem, or None if no tiling fits (registers, SMEM, divisibility).

    The running sums live in registers: n_mats * tile_f * Tp / 128 float32 per thread, kept
    <= 128. Among the D steps that divide D, pick the one with the most weight bytes in flight
    ((stages - 1) * weight bytes per stage), preferring larger steps on ties.

    bf16 at 32 <= Tp <= 64 prefers tile_f = 64: each CTA then covers twice the D range per F
    tile, so its float32 partials (n_CTAs x tile_f x Tp x 4 bytes, written then re-read by the
    epilogue) halve; measured +5-12% on the <= 50 MB matrices at T = 32/64 in one run (RESULTS.md),
    neutral on 4096x28672; at T = 128 it was slower (not preferred there). fp8 goes through f16
    (TileConfig defaults: 128-row conversion rounds, 8-bit load layout), 1.25-1.5x the bf16-folding
    path in one run, and exact. fp8 with block scales at Tp = 8 (T <= 8), one matrix, F % 256 == 0
    takes the warp-specialized kernel with two compute warpgroups over a 256-row F tile (+5-13%
    over the single warpgroup in the same run on 4096x4096 and 4096x28672).
    """
    tp = padded_t(t)
    fp8 = w_itemsize == 1
    if fp8 and block_scaled and n_mats == 1 and tp == 8 and f % 256 == 0 and d % 128 == 0:
        ws = TileConfig(tile_d=128, tile_f=256, n_wg=2, smem_budget=224 * 1024)
        plan = make_plan(d, f, t, n_mats, w_itemsize, ws, num_sms)
        if plan.stages >= min(2, plan.n_per):
            return ws
    pref_f = 64 if (not fp8 and 32 <= tp <= 64) else None
    best, best_key = None, None
    for tile_f in (128, 64):
        if f % tile_f or n_mats * tile_f * tp // 128 > 128:
            continue
        for tile_d in (256, 128, 64):
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


def _split(ws, scales):
    stacked = ws[0].ndim == 3
    d, f = ws[0].shape[-2:]
    block_scaled = scales[0] is not None and scales[0].ndim == (3 if stacked else 2)
    return stacked, d, f, block_scaled


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


def plan_for(x_TD, ws, scales, cfg: TileConfig | None = None, num_sms: int | None = None):
    """(cfg, plan) for these operands, or (None, reason) when the kernel can't take them."""
    t = x_TD.shape[0]
    stacked, d, f, block_scaled = _split(ws, scales)
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
        from pallas_kernels.matmul import gpu_fused
        mode, _, opt = fused.partition("+")
        y = gpu_fused.fused_products(x_TD, ws, scales, layer=layer, cfg=cfg, num_sms=num_sms,
                                     interpret=interpret, mode=mode, out_dtype=out_dtype, silu_mul=silu_mul,
                                     pdl=opt == "pdl")
        return y, None
    t = x_TD.shape[0]
    stacked, d, f, block_scaled = _split(ws, scales)
    if stacked != (layer is not None):
        raise ValueError("pass layer= exactly when the weights are stacked [L, D, F]")
    cfg, plan = plan_for(x_TD, ws, scales, cfg, num_sms)
    if cfg is None:
        raise ValueError(f"decode matmul kernel can't take these operands: {plan}")
    if x_padded and t != plan.tp:
        raise ValueError(f"x_padded=True but x has {t} rows, kernel wants Tp={plan.tp}")
    x_pad = x_TD if plan.tp == t else jnp.pad(x_TD, ((0, plan.tp - t), (0, 0)))
    if is_fp8(ws[0].dtype) and plan.fp8_via == "f16" and x_pad.dtype != jnp.float16:
        x_pad = (x_pad.astype(jnp.float32) * (2.0 ** -X_SHIFT)).astype(jnp.float16)
    args = [x_pad]
    if stacked:
        args.append(jnp.asarray(layer, jnp.int32).reshape(1))
    args += list(ws)
    if block_scaled:
        args += list(scales)
    return _jitted_kernel(plan, jnp.dtype(ws[0].dtype), block_scaled, stacked, interpret)(*args), plan


@functools.lru_cache(maxsize=None)
def _jitted_kernel(plan: Plan, w_dtype, block_scaled: bool, stacked: bool, interpret: bool):
    """One jitted callable per static configuration. A decode step calls the kernel with identical operand shapes
    once per layer (the layer index is an operand); through one jitted function JAX lowers the Mosaic module once
    and emits a call per layer, instead of re-lowering it per call site: measured on a CPU lowering of an 8-layer
    Llama-8B decode step for cuda, 10 s of lowering and a 4.4 MB module before this (a 32-layer step spent 35 s
    lowering on the H200)."""
    if plan.n_wg > 1:
        from pallas_kernels.matmul.gpu_ws import kernel_call_ws
        return jax.jit(kernel_call_ws(plan, w_dtype, block_scaled, stacked, interpret))
    return jax.jit(_kernel_call(plan, w_dtype, block_scaled, stacked, interpret))


def reduce_partials(part, plan: Plan, t: int):
    """Sum the written slots of P[M, slots, F, Tp] (a static mask) -> float32 y[M, t, F]."""
    mask = np.repeat(np.asarray(plan.slot_mask, bool), plan.tile_f, axis=1)          # [S, F]
    y = jnp.where(mask[None, :, :, None], part, 0.0).sum(axis=1)                     # [M, F, Tp]
    return jnp.swapaxes(y, 1, 2)[:, :t, :]


def fused_mode(x_TD, ws, scales, cfg: TileConfig | None, num_sms: int | None, interpret: bool,
               fused="default", silu_mul: bool = False, out_dtype=None) -> str | None:
    """The one-launch kernel mode (gpu_fused.py) to use for these operands, or None for the partials + XLA
    epilogue path. fused: "default" (FUSED_DEFAULT), None/"off", "direct", "sem" or "auto". A mode the fused
    kernel can't take (per-channel scales, n_wg > 1, a tiling that doesn't fit, "sem" in interpret mode,
    which has no global semaphores) falls back: "sem" -> "direct" -> None."""
    from pallas_kernels.matmul import gpu_fused
    if fused == "default":
        fused = FUSED_DEFAULT
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


# The one-launch kernel (gpu_fused.py) for decode_matmul_gpu / gate_up_silu_gpu / partial_products when the
# caller passes no `fused=`: "auto" = gpu_fused.auto_mode's measured per-shape choice between its "direct"
# mode and the float32 partials + XLA epilogue kernel above (None would always take the latter).
FUSED_DEFAULT: str | None = "auto"


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
