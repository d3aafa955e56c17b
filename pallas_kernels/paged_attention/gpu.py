"""Mosaic GPU (Hopper) paged attention kernels: decode (split-K, flash-decoding) and ragged prefill.

Why it exists: no maintained paged-attention Pallas kernel exists for GPUs in JAX 0.11 (the Triton ops are
deprecated, tokamax's Mosaic GPU attention refuses paging). Decode attention is memory-bound, so the kernel
streams pages with TMA into a ring of `stages` shared-memory slots (several pages in flight), runs all query
heads of one kv head (and, for prefill, several query tokens) as the M=64 rows of a wgmma, and splits long
contexts over programs whose partial (o, m, l) are combined afterwards (one XLA fusion).

Design notes
- One program = (kv split, kv head k, sequence s) for decode. Ragged prefill: a persistent grid of (kv head,
  program) that loops over a packed work list of (q tile, sequence) items (ragged_work_items).
- Rows: the 64 wgmma rows are a window of query heads [r0, r0+64) that contains the g heads of kv head k
  (decode), or floor(64/g) query tokens x g heads (prefill: q cut into fixed tiles of 64/g rows, tile-major
  [tiles, K, 64, H]; rows of other sequences in a tile are computed and thrown away; a group that does not
  divide 64, e.g. SmolLM2's 3, leaves zero rows at the end of the tile). Extra rows are computed and thrown
  away: the tensor cores have >10x headroom in decode.
- Cost follows the real lengths, not the block table's width P nor padding slots (the engine passes [S, P]
  tables as wide as the longest allowed sequence, many slots at kv_len 0): every block range comes from kv_len
  (block_walk), a split's share of a sequence is cut at run time from its real length, programs with nothing
  to read load neither q nor pages, ragged rows of kv_len-0 sequences get no work item (their rows are 0), and
  the ragged grid only runs the real items. What still scales with S: the decode grid (an idle program costs
  its launch and a tiny store: H200, 32 x 1k in 256 slots +10 us) and the static split count, chosen as if all
  S slots were live (1 live sequence in 256 slots: 8.9x its tight time). work_list=True (tuning: work_list) picks the
  split count at run time (decode_work_list) and fixes that case (to 2.9x), but its XLA glue (work list + merge,
  ~15-25 us on the H200) makes it slower everywhere else, so it is opt-in.
- A step covers BK kv tokens: ppb whole pages (G <= BK) or a 1/spp slice of one page (G > BK). K and V of
  one page arrive by two TMAs each ([G, H] boxes of the interleaved pool) on the slot's barrier.
- fp8 pools: TMA brings fp8 bytes; the kernel converts them to f16 (exact, and the only conversion Hopper
  has in hardware) through registers into an f16 staging tile, runs the wgmmas in f16 (q is cast to f16:
  |q| must stay below 65504), and applies the per-(page, head) scales to the logits (K) and to the
  probabilities (V). With fp8_qk (opt-in) only V is converted: QK^T is an fp8 wgmma on the ring's K bytes
  and an e4m3 copy of q (per-row scales, folded into the logit scale).
- Masking uses logical token positions (sparse attention passes a per-(s, k) list of selected pages and
  their logical page numbers); masked logits are -inf, m starts finite, so empty programs give l = 0.
- Pool content at positions >= kv_len must be finite (a zero-initialized pool and write_kv ensure it): a
  masked probability is 0, but 0 * NaN would still poison the PV product.

Measured on one H200 (benchmarks/RESULTS.md "Paged attention"; 8 kv heads x 128, page 16, GQA 4): bf16 decode with the
current defaults (64-token steps x 2 stages, two CTAs per SM, "waves" split-K) reads KV at 78-105% of the copy ceiling
from batch 8 x 1k up (batch 32 x 1k: 91%, 0.035 ms; batch 8 x 8k: 94%), 1.0-1.33x faster than 128-token steps x 2
stages with "sms2" splits and 1.6-1.9x faster than JAX's deprecated Triton paged_attention. Batch 1 stays
latency-bound (14-77%). fp8 pools run in gpu_fp8.py's warp-specialized kernel: 0.64x the time of inline conversion
with "sms2" splits, but 1.09-1.38x the bf16 time (goal <= 0.6x NOT met; see gpu_fp8.py for what limits it). Not
measured on a GPU: fp8_qk=True (tuning: fp8_qk, default off) runs QK^T as an fp8 wgmma with q quantized per row to
e4m3, widening only V, in both fp8 kernels (see gpu_fp8.py); the default stays the exact f16 path until a measurement
shows it faster.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import common, gpu_fp8, tuning
from .work_items import gather_item_rows, ragged_work_items, tile_major_q  # noqa: F401 (gpu.* names)
from .gpu_blocks import (M_INIT, ROWS, block_walk, column_positions, decode_program, issue_block_tmas,
                         online_softmax_step, page_columns, q_scratch, store_work_item, tiles, work_list_out_types)



Unsupported = common.Unsupported


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static description of one kernel instance (decode or ragged)."""
  ragged: bool
  S: int
  N: int  # query heads as laid out in q (decode: possibly padded to a multiple of 8)
  K: int
  g: int
  G: int
  H: int
  P: int
  Pmax: int  # entries per block-table row
  BK: int  # kv tokens per step
  stages: int
  splits: int
  steps_per_split: int
  sparse: bool
  fp8: str | None  # pool dtype name when fp8
  scale: float
  soft_cap: float | None
  window: int | None
  out_dtype: str
  p_via_smem: bool = False  # probabilities reach the PV wgmma through smem (required by the interpreter)
  NT: int = 0  # ragged: work items in the static list (gpu.ragged_work_items)
  programs: int = 0  # ragged: persistent programs per kv head (each loops over every programs-th real item)
  converters: int = 0  # fp8 decode: > 0 runs the warp-specialized kernel (gpu_fp8.py) with this many converter WGs
  fp8_bits: bool = False  # warp-specialized kernel: widen fp8 with integer bit ops (H-permuted tiles, gpu_fp8.py)
  compute_wgs: int = 1  # warp-specialized kernel: compute warpgroups on alternate steps (each one split-K partial)
  qk8: bool = False  # fp8 decode: QK^T as an fp8 wgmma (q quantized per row to e4m3 by the wrapper); only V widened
  worklist: bool = False  # dense decode: programs = (kv head, work item) from a run-time work list (decode_work_list)
  extra: int = 0  # worklist: extra chunk programs per kv head (items 0..extra-1; items extra.. are the S homes)
  wave: int = 0  # worklist: programs per kv head that fill one wave (the run-time chunking target)
  forced: int = 0  # worklist: > 0 cuts every live sequence into min(forced, its blocks) chunks (tests, tuning)
  detect_races: bool = False  # interpret mode: the GPU interpreter's race detector (tuning.py detect_races)

  @property
  def R(self):  # q rows loaded per program (decode)
    return min(ROWS, self.N)

  @property
  def ppb(self):  # pages per step
    return max(1, self.BK // self.G)

  @property
  def spp(self):  # steps per page
    return max(1, self.G // self.BK)

  @property
  def compute_dtype(self):
    """wgmma operand dtype: f16 for fp8 pools (the hardware converts e4m3/e5m2 -> f16 exactly), else bf16."""
    return jnp.dtype(jnp.float16) if self.fp8 else jnp.dtype(jnp.bfloat16)

  @property
  def final(self):  # the kernel writes the normalized output itself (no split-K combine)
    return self.ragged or (not self.worklist and self.splits == 1 and self.compute_wgs == 1)


def ring_scratch(cfg):
  """Shared-memory types of the K/V ring: (k, v, kq, vq, p); None where unused (qk8: K is read as fp8, no f16 K)."""
  cdt, H = cfg.compute_dtype, cfg.H
  ring = (cfg.stages, cfg.BK, H)
  p = plgpu.SMEM((ROWS, cfg.BK), cdt, transforms=tiles(cdt)) if cfg.p_via_smem else None
  if cfg.fp8:
    pool_dt = jnp.dtype(cfg.fp8)
    k16 = None if cfg.qk8 else plgpu.SMEM((cfg.BK, H), cdt, transforms=tiles(cdt))
    return (k16, plgpu.SMEM((cfg.BK, H), cdt, transforms=tiles(cdt)),
            plgpu.SMEM(ring, pool_dt, transforms=tiles(pool_dt, H)),
            plgpu.SMEM(ring, pool_dt, transforms=tiles(pool_dt, H)), p)
  return (plgpu.SMEM(ring, cdt, transforms=tiles(cdt)), plgpu.SMEM(ring, cdt, transforms=tiles(cdt)), None, None, p)


SMEM_LIMIT = 220 * 1024
# The tuned launch parameters (converter warpgroups, split policy, ragged waves, work list, fp8 variants) are data:
# tuning.py, one row per device kind.


def smem_bytes(BK, H, stages, fp8, p_via_smem=False, qk8=False):
  """Estimate of the kernel's shared memory: q tile + max(ring scope, output staging)."""
  staged = (1 if qk8 else 2) if fp8 else 0  # f16 staging tiles (V only with qk8)
  ring = stages * 2 * BK * H * (1 if fp8 else 2) + staged * BK * H * 2 + (ROWS * BK * 2 if p_via_smem else 0)
  out = ROWS * H * 8 + 2 * ROWS * 4  # work-list decode: output-dtype (<= f32) + f32 staging
  q = ROWS * H + ROWS * 4 if qk8 else ROWS * H * 2
  return q + max(ring, out) + 1024


def choose_block(G: int, H: int, fp8: bool, ragged: bool = False, qk8: bool = False,
                 tun: tuning.GpuAttentionTuning | None = None) -> tuple[int, int]:
  """(BK tokens per step, stages) of the one-warpgroup kernel: the tuning row's (`tun`, default the row in force;
  tuning.py: decode_block, ragged_block, fp8_inline_stages), fewer stages where they don't fit shared memory.
  fp8 (inline conversion; decode normally runs the warp-specialized kernel, see gpu_fp8.choose_block_ws):
  64-token steps up to pages of 64, then one page (at most 128 tokens) per step.
  """
  tun = tuning.current() if tun is None else tun
  if fp8:
    BK, stages = (64 if G <= 64 else min(G, 128)), tun.fp8_inline_stages
  elif ragged:
    BK, stages = tun.ragged_block
  else:
    BK, stages = tun.decode_block
  while stages > 2 and smem_bytes(BK, H, stages, fp8, qk8=qk8) > SMEM_LIMIT:
    stages -= 1
  return BK, stages


def check_supported(N, K, G, H, q_dtype, pool_dtype):
  """Raises Unsupported naming the constraint this kernel cannot meet."""
  g = N // K
  if jnp.dtype(pool_dtype) == jnp.dtype(jnp.float32):
    raise Unsupported("float32 pools are not supported by the Mosaic GPU kernel (wgmma would run in tf32)")
  if H % 64 or H > 256:
    raise Unsupported(f"head dim H={H} must be a multiple of 64 and <= 256")
  if G % 8:
    raise Unsupported(f"page size G={G} must be a multiple of 8 (TMA boxes land on 8-row smem tiles)")
  if G > 128 and G % 128:
    raise Unsupported(f"page size G={G} > 128 must be a multiple of 128")
  if 64 % G and G < 64:
    raise Unsupported(f"page size G={G} must divide 64")
  if g > ROWS - 8:
    raise Unsupported(f"GQA group {g} > {ROWS - 8} query heads per kv head")


def _kernel(cfg: KernelConfig, *refs):
  it = iter(refs)
  q_ref, kv_ref, bt_ref, lens_ref = next(it), next(it), next(it), next(it)
  tile_ref = next(it) if cfg.ragged else None
  wl_ref = next(it) if cfg.worklist else None
  nsel_ref = next(it) if cfg.sparse else None
  lp_ref = next(it) if cfg.sparse else None
  sc_ref = next(it) if cfg.fp8 else None
  qs_ref = next(it) if cfg.qk8 else None
  o_ref = next(it)
  m_ref = None if cfg.final else next(it)
  l_ref = None if cfg.final else next(it)
  ext_refs = (next(it), next(it), next(it)) if cfg.worklist else None  # o_ext, m_ext, l_ext
  q_smem, bars, q_bar = next(it), next(it), next(it)
  qs_smem = next(it) if cfg.qk8 else None

  G, BK, spp, g = cfg.G, cfg.BK, cfg.spp, cfg.g
  cdt = cfg.compute_dtype
  k = lax.axis_index("kvh")
  # Ragged: a persistent grid; program p of kv head k runs work items p, p + NP, ... of the packed list (only the
  # real ones: the list's padding costs nothing). Decode: one program = one (split, kv head, sequence).
  def one_item(item):
    if cfg.ragged:
      s = tile_ref[item, 0]
      qtile = tile_ref[item, 1]  # the q tile this item reads (64/g consecutive query rows)
      qpos0 = tile_ref[item, 2]  # position of the tile's first query row (rows of other sequences: thrown away)
      p_lo, p_hi = tile_ref[item, 3], tile_ref[item, 4]  # positions of this sequence's rows in the tile
      sp, nsp = 0, None
    else:
      w, s, sp, nsp = decode_program(cfg, wl_ref)
    kv_len = lens_ref[s]
    b_lo, n_steps, block_pages, logical_page = block_walk(
        cfg, s, k, sp, kv_len, bt_ref, lp_ref, nsel_ref, (p_lo, p_hi) if cfg.ragged else None, nsp)
    busy = n_steps > 0  # False: kv_len 0 / a split past the real length / an empty item: no TMA at all

    # q rows. Decode: a 64-row window of heads containing kv head k's group. Ragged: 64/g tokens x g heads.
    if cfg.ragged:
      local = 0

      @pl.when(busy)
      def _():
        plgpu.copy_gmem_to_smem(q_ref.at[qtile, k], q_smem, q_bar)
    else:
      # TMA into 8-row smem tiles needs an 8-aligned gmem row: N is padded to a multiple of 8 and the window
      # starts at the group's first head rounded down to 8 (g <= 56 keeps the whole group inside).
      r0 = jnp.minimum((k * g) // 8 * 8, cfg.N - ROWS) if cfg.N > ROWS else 0  # python int: static slice
      local = k * g - r0

      @pl.when(busy)
      def _():
        if cfg.R == ROWS:
          plgpu.copy_gmem_to_smem(q_ref.at[s, pl.ds(r0, ROWS)], q_smem, q_bar)
        else:
          plgpu.copy_gmem_to_smem(q_ref.at[s, pl.ds(0, cfg.R)], q_smem.at[pl.ds(0, cfg.R)], q_bar)
        if cfg.qk8:  # per-row q scales (x softmax scale), padded by the wrapper to >= 64 entries
          plgpu.copy_gmem_to_smem(qs_ref.at[s, pl.ds(r0, ROWS)], qs_smem, q_bar)

    # The K/V ring (and fp8/p staging) lives in a scope that closes before the output staging is allocated, so
    # the two share shared memory.
    ring_types = ring_scratch(cfg)

    def pipeline(*allocated):
      got = iter(allocated)
      k_smem, v_smem, kq_smem, vq_smem, p_smem = (next(got) if t is not None else None for t in ring_types)
      kdst = kq_smem if cfg.fp8 else k_smem
      vdst = vq_smem if cfg.fp8 else v_smem

      def issue(b, slot, pages=None):
        """Starts the TMAs of block b (K and V of ppb pages, or a 1/spp slice of one page) into ring slot."""
        pages = block_pages(b) if pages is None else pages
        issue_block_tmas(cfg, kv_ref, k, b, pages, kdst.at[slot], vdst.at[slot], bars.at[slot])

      for i in range(cfg.stages):
        @pl.when(i < n_steps)
        def _():
          issue(b_lo + i, i)

      @pl.when(busy)
      def _():
        plgpu.barrier_wait(q_bar)
      if cfg.qk8:
        qs_row = plgpu.load(qs_smem, layout=plgpu.Layout.WGMMA.reduce(1))  # only used when busy

      col = plgpu.broadcasted_iota(jnp.int32, (ROWS, BK), 1, layout=plgpu.Layout.WGMMA)
      if cfg.ragged:
        row = plgpu.broadcasted_iota(jnp.int32, (ROWS, BK), 0, layout=plgpu.Layout.WGMMA)
        qpos = qpos0 + row // g  # [ROWS, BK]: position of each row's query token

      def body(step, carry):
        acc, m_i, l_i = carry
        b = b_lo + step
        slot = lax.rem(step, cfg.stages)
        # Scalar loads first, so their latency hides behind the barrier wait and the matmuls: the page ids of the
        # block this step will prefetch, and (fp8) the scales of the pages being computed now.
        next_pages = block_pages(b + cfg.stages)
        if cfg.fp8:
          cur_pages = block_pages(b)
          k_scales = [sc_ref[pg, 2 * k] for pg in cur_pages]
          v_scales = [sc_ref[pg, 2 * k + 1] for pg in cur_pages]
        plgpu.barrier_wait(bars.at[slot])

        if cfg.qk8:  # K stays fp8 (the wgmma reads the ring slot); V is widened while the QK wgmma runs
          kslot, vslot = kq_smem.at[slot], v_smem
        elif cfg.fp8:
          kslot, vslot = k_smem, v_smem
          kslot[...] = kq_smem[slot].astype(cdt)
          vslot[...] = vq_smem[slot].astype(cdt)
          plgpu.commit_smem()
        else:
          kslot, vslot = k_smem.at[slot], v_smem.at[slot]

        def qk_fn(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, kslot.transpose((1, 0)))
          if cfg.qk8:
            vslot[...] = vq_smem[slot].astype(cdt)
            plgpu.commit_smem()
          return acc_ref[...]
        logits = pl.run_scoped(qk_fn, plgpu.ACC((ROWS, BK), jnp.float32))

        # Per-column page data: logical token positions and fp8 scales.
        pos = column_positions(cfg, b, col, logical_page)
        if cfg.fp8:
          ksc, vsc = page_columns(k_scales, col, G), page_columns(v_scales, col, G)

        if cfg.qk8:  # the wrapper folded the softmax scale into the per-row q scales
          logits = logits * lax.broadcast_in_dim(qs_row, logits.shape, [0]) * ksc
        else:
          logits = logits * cfg.scale
          if cfg.fp8:
            logits = logits * ksc
        p, m_new, l_i, acc = online_softmax_step(cfg, logits, pos, kv_len, m_i, l_i, acc,
                                                 qpos if cfg.ragged else None)
        if cfg.fp8:
          p = p * vsc
        p16 = p.astype(cdt)
        if p_smem is not None:  # wgmma A operand from shared memory (the interpreter needs refs)
          p_smem[...] = p16
          plgpu.commit_smem()
          p_op = p_smem
        else:
          p_op = p16

        def pv_fn(acc_ref):
          plgpu.wgmma(acc_ref, p_op, vslot)
          return acc_ref[...]
        acc = acc + pl.run_scoped(pv_fn, plgpu.ACC((ROWS, cfg.H), jnp.float32))

        @pl.when(step + cfg.stages < n_steps)
        def _():
          issue(b + cfg.stages, slot, next_pages)
        return acc, m_new, l_i

      acc = plgpu.layout_cast(jnp.zeros((ROWS, cfg.H), jnp.float32), plgpu.Layout.WGMMA)
      m_i = plgpu.layout_cast(jnp.full((ROWS,), M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      l_i = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      return lax.fori_loop(0, n_steps, body, (acc, m_i, l_i))

    acc, m_i, l_i = pl.run_scoped(pipeline, *[t for t in ring_types if t is not None])

    out_dtype = jnp.dtype(cfg.out_dtype) if cfg.final else jnp.dtype(jnp.float32)

    def store(o_smem, ml_smem):
      if cfg.final:
        inv = jnp.where(l_i > 0, 1.0 / jnp.where(l_i > 0, l_i, 1.0), 0.0)
        o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(out_dtype)
      else:
        o_smem[...] = acc
        ml_smem[0] = m_i
        ml_smem[1] = l_i
      plgpu.commit_smem()
      if cfg.ragged:
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[item, k])
      elif cfg.final:
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(local, g)], o_ref.at[s, pl.ds(k * g, g)])
      else:
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(local, g)], o_ref.at[sp, s, pl.ds(k * g, g)])
        plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[sp, s, k])
        plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[sp, s, k])
      plgpu.wait_smem_to_gmem(0)

    if cfg.worklist:  # idle items write nothing (decode_work_list / combine_work_list never read them)
      pl.when(busy)(lambda: pl.run_scoped(
          functools.partial(store_work_item, cfg, w, s, k, local, acc, m_i, l_i, o_ref, m_ref, l_ref, ext_refs),
          plgpu.SMEM((ROWS, cfg.H), jnp.dtype(cfg.out_dtype)), plgpu.SMEM((ROWS, cfg.H), jnp.float32),
          plgpu.SMEM((2, ROWS), jnp.float32)))
    elif cfg.ragged:  # an item with no query rows (the static work list's padding) writes nothing: nobody reads it
      pl.when(p_hi > p_lo)(lambda: pl.run_scoped(store, plgpu.SMEM((ROWS, cfg.H), out_dtype),
                                                 plgpu.SMEM((2, ROWS), jnp.float32)))
    else:  # every (split, sequence) writes its (neutral, when idle) result: the output has no other initialization
      pl.run_scoped(store, plgpu.SMEM((ROWS, cfg.H), out_dtype), plgpu.SMEM((2, ROWS), jnp.float32))


  if cfg.ragged:
    p, NP = lax.axis_index("prog"), cfg.programs
    n_items = tile_ref[cfg.NT, 0]  # the work list's last row holds the number of real items

    def loop_body(j, carry):
      one_item(p + j * NP)
      return carry
    lax.fori_loop(0, jnp.maximum(n_items - p + NP - 1, 0) // NP, loop_body, 0)
  else:
    one_item(None)


def decode_work_list(cfg, kv_lens_S):
  """Run-time work list of the work-list decode kernel: [extra + S, 3] int32 rows (sequence, chunk, chunks).

  Each live sequence s (blocks nb_s > 0 of BK tokens) is cut into c_s near-equal chunks: c_s ~ nb_s * wave /
  sum(nb) (so one wave of programs shares out the REAL work, long sequences getting more chunks), at least 1,
  at most nb_s, and rounded so that no chunk is empty; cfg.forced overrides it. Chunk 0 runs in the sequence's
  home item (row extra + s), chunks 1.. in the extra items (rows 0.., packed). sum(c_s - 1) <= extra always, so
  nothing is dropped. Idle rows (kv_len 0, unused extras) have chunks = 0 and do nothing.
  Returns (work list, chunks per sequence [S]).
  """
  S, C, BK = cfg.S, cfg.extra, cfg.BK
  lens = jnp.maximum(kv_lens_S, 0)
  last = (lens + BK - 1) // BK
  first = 0 if cfg.window is None else jnp.maximum(lens - cfg.window, 0) // BK
  nb = jnp.maximum(last - first, 0)
  live = nb > 0
  if cfg.forced:
    c_raw = jnp.full_like(nb, cfg.forced)
  else:
    c_raw = nb * cfg.wave // jnp.maximum(jnp.sum(nb), 1)
  c_raw = jnp.clip(c_raw, 1, jnp.maximum(nb, 1))
  c = jnp.where(live, (nb + (nb + c_raw - 1) // c_raw - 1) // ((nb + c_raw - 1) // c_raw), 0)  # no empty chunk
  seq = jnp.arange(S, dtype=jnp.int32)
  home = jnp.stack([seq, jnp.zeros_like(seq), c], axis=-1)
  if not C:
    return home.astype(jnp.int32), c
  n_ext = jnp.maximum(c - 1, 0)
  ext_end = jnp.cumsum(n_ext)
  e = jnp.arange(C, dtype=jnp.int32)
  es = jnp.clip(jnp.searchsorted(ext_end, e, side="right", method="compare_all").astype(jnp.int32), 0, S - 1)
  ev = e < ext_end[-1]
  ej = 1 + e - (ext_end - n_ext)[es]
  ext = jnp.stack([jnp.where(ev, es, 0), jnp.where(ev, ej, 0), jnp.where(ev, c[es], 0)], axis=-1)
  return jnp.concatenate([ext, home], axis=0).astype(jnp.int32), c


def combine_work_list(res, wl, c, cfg):
  """Output of the work-list decode kernel -> [S, N, H] in the output dtype.

  Sequences with one chunk: their home rows as written; kv_len-0 sequences: zeros (their rows are never written);
  split sequences (at most cfg.extra of them): the softmax merge of the home chunk and its extra chunks, done on
  O(extra) rows only (segment reductions over the extra items), then scattered into the output."""
  o_home, m_home, l_home, o_ext, m_ext, l_ext = res
  S, N = o_home.shape[0], o_home.shape[1]
  out = jnp.where((c > 0)[:, None, None], o_home, jnp.zeros((), o_home.dtype))
  C = cfg.extra
  if not C:
    return out
  k_of_n, row_of_n = _row_maps(N, cfg.K, cfg.g)
  split = c > 1
  group = jnp.cumsum(split.astype(jnp.int32)) - 1  # group of each split sequence: 0 .. <= C - 1
  home_of = jnp.full((C,), S, jnp.int32).at[jnp.where(split, group, C)].set(jnp.arange(S, dtype=jnp.int32),
                                                                             mode="drop")
  hs = jnp.clip(home_of, 0, S - 1)
  ext_seq, ext_live = wl[:C, 0], wl[:C, 2] > 0
  seg = jnp.where(ext_live, group[ext_seq], C)  # extras of idle rows go to a dropped segment
  me = jnp.where(ext_live[:, None], m_ext[:, k_of_n, row_of_n], -jnp.inf)  # [C, N]
  le = jnp.where(ext_live[:, None], l_ext[:, k_of_n, row_of_n], 0.0)
  mh = m_home[hs][:, k_of_n, row_of_n]  # [C groups, N]
  lh = l_home[hs][:, k_of_n, row_of_n]
  M = jnp.maximum(mh, jax.ops.segment_max(me, seg, num_segments=C))
  we = jnp.where(ext_live[:, None], jnp.exp2(me - M[jnp.clip(seg, 0, C - 1)]) * le, 0.0)
  wh = jnp.exp2(mh - M) * lh
  oe = jnp.where(ext_live[:, None, None], o_ext, 0.0)
  num = wh[..., None] * o_home[hs].astype(jnp.float32) + jax.ops.segment_sum(we[..., None] * oe, seg,
                                                                             num_segments=C)
  den = wh + jax.ops.segment_sum(we, seg, num_segments=C)
  merged = num * jnp.where(den > 0, 1.0 / jnp.where(den > 0, den, 1.0), 0.0)[..., None]
  return out.at[home_of].set(merged.astype(out.dtype), mode="drop")


def kernel_call(cfg: KernelConfig, q, kv_pages_PGKH, bt, kv_lens_S, extra=(), scales=None, *, interpret=False,
                q_scales=None):
  """Runs the kernel. Decode returns [S, N, H] (splits == 1) or partials (o [Sp, S, N, H], m, l [Sp, S, K, 64]);
  ragged (q = [NT, K, 64, H] tile-major, extra = (tile_info,)) returns per-tile outputs [NT, K, 64, H].
  qk8: q is e4m3 [S, N, H] and q_scales f32 [S, >= max(N, 64)] (per-row scale x softmax scale)."""
  if cfg.converters:
    return gpu_fp8.kernel_call_ws(cfg, q, kv_pages_PGKH, bt, kv_lens_S, extra, scales, converters=cfg.converters,
                                  interpret=interpret, q_scales=q_scales)
  H = cfg.H
  arrivals = 2 * cfg.ppb if cfg.spp == 1 else 2
  scratch = [q_scratch(cfg),
             plgpu.Barrier(num_arrivals=arrivals, num_barriers=cfg.stages),
             plgpu.Barrier(num_arrivals=2 if cfg.qk8 else 1)]
  if cfg.qk8:
    scratch.append(plgpu.SMEM((ROWS,), jnp.float32))

  S, N, K = cfg.S, cfg.N, cfg.K
  if cfg.ragged:
    out_type = [jax.ShapeDtypeStruct((cfg.NT, K, ROWS, H), jnp.dtype(cfg.out_dtype))]
    grid, names = (K, cfg.programs), ("kvh", "prog")
  elif cfg.worklist:
    out_type = work_list_out_types(cfg)
    grid, names = (K, cfg.extra + S), ("kvh", "work")
  else:
    grid, names = (cfg.splits, K, S), ("split", "kvh", "seq")
    if cfg.final:
      out_type = [jax.ShapeDtypeStruct((S, N, H), jnp.dtype(cfg.out_dtype))]
    else:
      out_type = [jax.ShapeDtypeStruct((cfg.splits, S, N, H), jnp.float32),
                  jax.ShapeDtypeStruct((cfg.splits, S, K, ROWS), jnp.float32),
                  jax.ShapeDtypeStruct((cfg.splits, S, K, ROWS), jnp.float32)]
  inputs = [q, kv_pages_PGKH, bt, kv_lens_S, *extra]
  if cfg.fp8:
    inputs.append(scales)
  if cfg.qk8:
    inputs.append(q_scales)
  call = plgpu.kernel(
      functools.partial(_kernel, cfg),
      out_type=out_type,
      scratch_types=scratch,
      grid=grid,
      grid_names=names,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  res = call(*inputs)
  return res[0] if cfg.final else res


def _row_maps(N, K, g):
  """For each query head n: (kv head, its row within the 64-row window the kernel loaded)."""
  k_of_n = np.arange(N) // g
  r0 = np.minimum(k_of_n * g // 8 * 8, N - ROWS) if N > ROWS else np.zeros(N, np.int64)
  return k_of_n, np.arange(N) - r0


def combine_splits(o_part, m_part, l_part, K, g):
  """Merges split-K partials: o [Sp, S, N, H] f32, m/l [Sp, S, K, 64] (m in log2 units) -> f32 [S, N, H]."""
  N = o_part.shape[2]
  k_of_n, row_of_n = _row_maps(N, K, g)
  m = m_part[:, :, k_of_n, row_of_n]  # [Sp, S, N]
  l = l_part[:, :, k_of_n, row_of_n]
  m_max = jnp.max(m, axis=0)
  w = jnp.exp2(m - m_max[None])
  l_tot = jnp.sum(w * l, axis=0)
  o = jnp.sum(w[..., None] * o_part, axis=0)
  return o * jnp.where(l_tot > 0, 1.0 / jnp.where(l_tot > 0, l_tot, 1.0), 0.0)[..., None]


def make_config(q_shape, pool_shape, pool_dtype, table_cols, *, scale, soft_cap, sliding_window,
                sparse=False, out_dtype, splits=None, block_kv=None, stages=None, p_via_smem=False, ragged_tiles=0,
                fp8_converters=None, split_policy=None, fp8_convert=None, fp8_compute_wgs=None, fp8_qk=None,
                max_kv_len=None, work_list=None, ragged_waves=None, tun=None):
  """Static kernel description. Tuned fields left None take the tuning row `tun` (default: the row in force,
  tuning.current()).

  work_list (dense decode with one compute warpgroup; None = tuning.current().work_list): the split count is chosen at run time
  from the real lengths (decode_work_list); `splits` then forces every live sequence into that many chunks.
  Otherwise (sparse decode, fp8_compute_wgs=2, work_list=False) the split count is static (choose_splits from
  the table width, or from max_kv_len: an optional static bound on the kv lengths, a hint that only steers that
  count; longer sequences still run correctly) and the real blocks are divided over the splits at run time."""
  S, N, H = q_shape
  P, G, K2, _ = pool_shape
  K = K2 // 2
  g = N // K
  fp8 = common.is_fp8(pool_dtype)
  check_supported(N, K, G, H, out_dtype, pool_dtype)
  tun = tuning.current() if tun is None else tun
  sms = tuning.num_sms(tun)
  fp8_converters = tun.fp8_converters if fp8_converters is None else fp8_converters
  split_policy = tun.split_policy if split_policy is None else split_policy
  converters = int(fp8_converters) if (fp8 and not ragged_tiles) else 0
  compute_wgs = (tun.fp8_compute_wgs if fp8_compute_wgs is None else int(fp8_compute_wgs)) if converters else 1
  qk8 = bool(tun.fp8_qk if fp8_qk is None else fp8_qk) and fp8 and not ragged_tiles
  if converters and block_kv is None and stages is None:
    bk_ws, st_ws = gpu_fp8.choose_block_ws(G, H, converters, compute_wgs, qk8)
    if gpu_fp8.smem_bytes_ws(bk_ws, H, st_ws, converters, compute_wgs, qk8) > SMEM_LIMIT:
      converters, compute_wgs = 0, 1  # e.g. H = 256: the f16 staging does not fit; the inline kernel does
  fp8_convert = tun.fp8_convert if fp8_convert is None else fp8_convert
  if fp8_convert not in ("cvt", "bits"):
    raise ValueError(f"fp8_convert must be 'cvt' or 'bits', got {fp8_convert!r}")
  fp8_bits = bool(converters) and fp8_convert == "bits" and H % 128 == 0 and not qk8  # halves = whole swizzle tiles
  if converters:
    BK, st = gpu_fp8.choose_block_ws(G, H, converters, compute_wgs, qk8)
  else:
    BK, st = choose_block(G, H, fp8, ragged=bool(ragged_tiles), qk8=qk8, tun=tun)
  BK = block_kv or BK
  stages = stages or st
  if BK % 64 or (G <= BK and BK % G) or (G > BK and G % BK):
    raise Unsupported(f"block_kv={BK} must be a multiple of 64 that divides or is divided by page size {G}")
  need = (gpu_fp8.smem_bytes_ws(BK, H, stages, converters, compute_wgs, qk8) if converters
          else smem_bytes(BK, H, stages, fp8, qk8=qk8))
  if need > SMEM_LIMIT:
    raise Unsupported(f"block_kv={BK} x stages={stages} needs ~{need} bytes of shared memory (limit {SMEM_LIMIT})")
  N_pad = N + (-N % 8)
  if sparse:
    n_blocks = table_cols * G // BK if G > BK else common.cdiv(table_cols, BK // G)
  else:
    tokens = table_cols * G
    if max_kv_len is not None:
      if int(max_kv_len) != max_kv_len or max_kv_len < 1:
        raise ValueError(f"max_kv_len must be a positive int or None, got {max_kv_len}")
      tokens = min(tokens, int(max_kv_len))
    if sliding_window is not None:
      tokens = min(tokens, sliding_window + BK)  # the window spans at most this many blocks
    n_blocks = common.cdiv(tokens, BK) + (1 if sliding_window is not None else 0)
  n_blocks = max(1, n_blocks)
  programs = 0
  work_list = tun.work_list if work_list is None else bool(work_list)
  worklist = work_list and not sparse and not ragged_tiles and compute_wgs == 1
  extra = wave = forced = 0
  if worklist:  # the split count is chosen at run time (decode_work_list); static: one wave's worth of extras
    if splits is not None and int(splits) < 1:
      raise ValueError(f"splits must be >= 1, got {splits}")
    wave = max(1, sms * max(1, min(8, (228 * 1024) // (need + 1024))) // K)
    forced = 0 if splits is None else int(splits)
    extra = wave if not forced else (forced - 1) * S
    splits = 1
  elif ragged_tiles:
    splits = 1
    # Persistent ragged grid: up to `ragged_waves` (tuning.py) waves of programs (enough slack for the hardware scheduler to even
    # out unequal items), never more than the list holds.
    slots = sms * max(1, min(8, (228 * 1024) // (need + 1024)))
    waves = tun.ragged_waves if ragged_waves is None else ragged_waves
    programs = max(1, min(ragged_tiles, common.cdiv(waves * slots, K)))
  elif splits is None:
    splits = choose_splits(S * K, n_blocks, split_policy, need, sms)
  steps = common.cdiv(n_blocks, splits)
  splits = common.cdiv(n_blocks, steps)
  if ragged_tiles:
    N_pad = N
  return KernelConfig(worklist=worklist, extra=extra, wave=wave, forced=forced, programs=programs, ragged=bool(ragged_tiles), NT=ragged_tiles, S=S, N=N_pad, K=K, g=g, G=G, H=H, P=P, Pmax=table_cols, BK=BK, stages=stages,
                      splits=splits, steps_per_split=steps, sparse=sparse,
                      fp8=jnp.dtype(pool_dtype).name if fp8 else None, scale=scale,
                      soft_cap=None if soft_cap is None else float(soft_cap),
                      window=None if sliding_window is None else int(sliding_window), out_dtype=out_dtype,
                      p_via_smem=p_via_smem, converters=converters, fp8_bits=fp8_bits, compute_wgs=compute_wgs,
                      qk8=qk8, detect_races=bool(tun.detect_races))


def choose_splits(work: int, n_blocks: int, policy: str, smem: int, sms: int | None = None) -> int:
  """Split-K programs per (sequence, kv head).

  "sms2": enough programs for two per SM (the original heuristic). "waves": the split count minimizing
  waves x steps per program, where a wave is num_sms x CTAs per SM (from the shared memory estimate), so the
  last wave is not a sliver (e.g. batch 8 x 8 kv heads on 132 SMs: 2 splits = 128 programs = one wave, where
  "sms2" picked 5 = 320 programs = 2.4 waves of one CTA per SM).
  """
  sms = tuning.num_sms() if sms is None else sms
  if policy == "sms2":
    return max(1, min(common.cdiv(2 * sms, work), n_blocks))
  if policy != "waves":
    raise ValueError(f"split_policy must be 'sms2' or 'waves', got {policy!r}")
  slots = sms * max(1, min(8, (228 * 1024) // (smem + 1024)))
  best, best_cost = 1, None
  # Beyond 16 waves of programs the +2 per program outweighs any rounding gain: a wide block table (n_blocks ~ P)
  # does not make the search long (nor can the split count exceed that).
  for sp in range(1, min(n_blocks, max(1, 16 * slots // max(1, work))) + 1):
    steps = common.cdiv(n_blocks, sp)
    if common.cdiv(n_blocks, steps) != sp:  # same steps as a smaller count: not a distinct choice
      continue
    cost = common.cdiv(work * sp, slots) * (steps + 2)  # +2: per-program prologue/epilogue, in steps
    if best_cost is None or cost < best_cost:
      best, best_cost = sp, cost
  return best


E4M3_MAX = 448.0


def quantize_q_rows(q_SNH):
  """Per-row (sequence, head) e4m3 quantization of q for the fp8 QK^T wgmma: q ~= q8 * s.

  s = max|q_row| / 448 (1 for an all-zero row), q8 = round-to-nearest-even(q / s) in e4m3fn. The e4m3 rounding
  (3 mantissa bits: relative error <= 2^-4 per element) is the accuracy cost of fp8_qk; the kernel's result
  equals the fp8-aware reference evaluated at q8 * s (tests/kernels/test_paged_attention_gpu.py).
  Returns (q8 [S, N, H] float8_e4m3fn, s [S, N] float32).
  """
  q = q_SNH.astype(jnp.float32)
  amax = jnp.max(jnp.abs(q), axis=-1)
  s = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
  q8 = jnp.clip(q / s[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
  return q8, s


def _run_decode(cfg, q_SNH, kv_pages_PGKH, bt, kv_lens_S, nsel, lp, kv_scales_PK, interpret):
  S, N, H = q_SNH.shape
  q_scales = None
  if cfg.qk8:
    q, s_q = quantize_q_rows(q_SNH)
    q_scales = jnp.pad(s_q * cfg.scale, ((0, 0), (0, max(cfg.N, ROWS) - N)))  # the kernel loads 64-row windows
  else:
    q = q_SNH.astype(cfg.compute_dtype)
  if cfg.N != N:
    q = jnp.pad(q, ((0, 0), (0, cfg.N - N), (0, 0)))
  extra = (nsel, lp) if cfg.sparse else ()
  if cfg.fp8_bits:  # the kernel's f16 K/V tiles hold the head dim in widen_permutation order
    perm = gpu_fp8.widen_permutation(H)
    q = q[..., perm]
  if cfg.worklist:
    wl, chunks = decode_work_list(cfg, kv_lens_S)
    extra = (wl,)
  res = kernel_call(cfg, q, kv_pages_PGKH, bt, kv_lens_S, extra, kv_scales_PK, interpret=interpret,
                    q_scales=q_scales)
  if cfg.worklist:
    out = combine_work_list(res, wl, chunks, cfg)
  elif cfg.final:
    out = res
  else:
    o_part, m_part, l_part = res
    out = combine_splits(o_part, m_part, l_part, cfg.K, cfg.g)
  if cfg.fp8_bits:
    out = out[..., np.argsort(perm)]
  return out[:, :N].astype(q_SNH.dtype)


def paged_decode_attention_gpu(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, *, scale=None, soft_cap=None,
                               sliding_window=None, kv_scales_PK=None, splits=None, block_kv=None, stages=None,
                               interpret=False, fp8_converters=None, split_policy=None, fp8_convert=None,
                               fp8_compute_wgs=None, fp8_qk=None, max_kv_len=None, work_list=None):
  """Mosaic GPU decode attention (one query per sequence). Raises Unsupported for shapes it cannot run.
  Tuned fields left None take the row in force (tuning.current()); the row, with the fields given here replaced,
  is a static argument of the jitted kernel call, so a `tuning.override` is never hidden by a cached trace.

  Cost follows kv_lens, not the table width nor the number of slots: by default (work_list, tuning.current().work_list) each live
  sequence is cut at run time into chunks in proportion to its real length so that one wave of programs shares
  out the real work (decode_work_list), a kv_len-0 slot's program exits at once (no q, no pages, no store), and
  only split sequences are merged afterwards (combine_work_list). `splits` forces that many chunks per sequence.
  work_list=False (and fp8_compute_wgs=2): a static split count (choose_splits / split_policy, from the
  table width or the static hint max_kv_len), still with the real blocks divided over the splits at run time
  and idle programs skipping q and pages.

  fp8_converters: fp8 pools only; 0 = conversion inline in the one warpgroup, > 0 = warp-specialized kernel
  (gpu_fp8.py) with that many converter warpgroups; None = the tuning row's (tuning.py), as for the others. split_policy: see choose_splits;
  fp8_convert: "cvt" | "bits" widening in the warp-specialized kernel.
  fp8_compute_wgs: 1 | 2 compute warpgroups in the warp-specialized kernel.
  fp8_qk: fp8 pools only; True = QK^T as an fp8 wgmma with q quantized per row to e4m3 (quantize_q_rows; only V
  is widened), False = exact f16 path.
  """
  tun = row_with(fp8_converters=fp8_converters, split_policy=split_policy, fp8_convert=fp8_convert,
                 fp8_compute_wgs=fp8_compute_wgs, fp8_qk=fp8_qk, work_list=work_list)
  return _paged_decode_attention_gpu(
      q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
      kv_scales_PK=kv_scales_PK, splits=splits, block_kv=block_kv, stages=stages, interpret=interpret,
      max_kv_len=max_kv_len, tun=tun)


def row_with(**fields) -> tuning.GpuAttentionTuning:
  """The tuning row in force with the fields given (not None) replaced: the static row of one kernel call."""
  given = {k: v for k, v in fields.items() if v is not None}
  return dataclasses.replace(tuning.current(), **given) if given else tuning.current()


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "splits", "block_kv", "stages",
                                             "interpret", "max_kv_len", "tun"))
def _paged_decode_attention_gpu(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, *, scale, soft_cap,
                                sliding_window, kv_scales_PK, splits, block_kv, stages, interpret, max_kv_len, tun):
  S, N, K, g, P, G, H = common.check_decode(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kv_scales_PK,
                                            soft_cap=soft_cap, sliding_window=sliding_window)
  cfg = make_config(q_SNH.shape, kv_pages_PGKH.shape, kv_pages_PGKH.dtype, block_tables_SP.shape[1],
                           scale=common.default_scale(H, scale), soft_cap=soft_cap, sliding_window=sliding_window,
                           out_dtype=jnp.dtype(q_SNH.dtype).name, splits=splits, block_kv=block_kv, stages=stages,
                           p_via_smem=interpret, max_kv_len=max_kv_len, tun=tun)
  return _run_decode(cfg, q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, None, None, kv_scales_PK, interpret)


def paged_attention_gpu(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, *, scale=None,
                        soft_cap=None, sliding_window=None, kv_scales_PK=None, block_kv=None, stages=None,
                        interpret=False, ragged_waves=None):
  """Mosaic GPU ragged (prefill / mixed) paged attention. Raises Unsupported for shapes it cannot run.

  Cost follows the work: rows of sequences at kv_len 0 (and padding rows) get no work item (zeros); an item
  reads only the kv blocks its rows can see; the tile-major copy of q is O(T) (ragged_work_items).
  ragged_waves: persistent programs in waves; None = the tuning row's (the row is a static argument of the jitted
  call)."""
  return _paged_attention_gpu(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, scale=scale,
                              soft_cap=soft_cap, sliding_window=sliding_window, kv_scales_PK=kv_scales_PK,
                              block_kv=block_kv, stages=stages, interpret=interpret,
                              tun=row_with(ragged_waves=ragged_waves))


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "block_kv", "stages",
                                             "interpret", "tun"))
def _paged_attention_gpu(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, *, scale, soft_cap,
                         sliding_window, kv_scales_PK, block_kv, stages, interpret, tun):
  S, N, K, g, P, G, H = common.check_ragged(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1,
                                            kv_scales_PK, soft_cap=soft_cap, sliding_window=sliding_window)
  T = q_TNH.shape[0]
  tq = ROWS // g  # tokens per tile; a group that does not divide 64 leaves 64 - tq * g zero rows (discarded)
  info, item_T, has_T, n_items, NI, NQ = ragged_work_items(cu_q_lens_S1, kv_lens_S, T, tq)
  info = jnp.concatenate([info, jnp.zeros((1, info.shape[1]), jnp.int32).at[0, 0].set(n_items)])  # + the count
  cfg = make_config((S, N, H), kv_pages_PGKH.shape, kv_pages_PGKH.dtype, block_tables_SP.shape[1],
                    scale=common.default_scale(H, scale), soft_cap=soft_cap, sliding_window=sliding_window,
                    out_dtype=jnp.dtype(q_TNH.dtype).name, block_kv=block_kv, stages=stages, p_via_smem=interpret,
                    ragged_tiles=NI, tun=tun)
  q = tile_major_q(q_TNH, K, tq, NQ, ROWS, cfg.compute_dtype)  # [NQ, K, 64, H]: aligned TMA boxes
  o_items = kernel_call(cfg, q, kv_pages_PGKH, block_tables_SP, kv_lens_S, (info,), kv_scales_PK,
                        interpret=interpret)  # [NI, K, 64, H]; items without rows are never written
  return gather_item_rows(o_items, item_T, has_T, tq, g, q_TNH.dtype)
