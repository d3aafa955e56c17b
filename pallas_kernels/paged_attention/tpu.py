"""Mosaic TPU paged attention kernels: decode (optionally over a sparse page selection) and ragged prefill.

Why it exists: the TPU counterpart of gpu.py, same semantics. Lengths (and the ragged work list) are
scalar-prefetched into SMEM (PrefetchScalarGridSpec); the pool AND the block tables stay in HBM (memory_space=ANY):
each program walks its sequence's pages with manual async DMAs, double-buffered (block b+1 in flight while block b
is computed), and fetches the page ids of block b+2 by a small DMA into a 3-slot SMEM ring. One program =
(sequence, kv head) for decode, (kv head, work item) for ragged prefill (work_items.ragged_work_items: q tiles x
sequences with kv_len > 0); all g query heads of the kv head (and, for prefill, 64/g tokens) are the rows of one
MXU matmul.

Cost follows the real lengths, not the table width Pmax: nothing is sized by Pmax except the HBM table itself.
(Before: the whole [S, Pmax] table was scalar-prefetched into SMEM, ~1 MiB on TPUs up to v6e, so e.g. 64
sequences x 8192 pages did not fit; fp8 scales were expanded by the wrapper to [S, K, 2, Pmax * G] f32, i.e.
O(S * Pmax) bytes per call.) Ragged padding items (the static list's tail) point at the last real item's q tile
and output block, so the pipeline neither fetches nor writes back anything for them.

fp8 pools: the DMA brings fp8 pages; the kernel converts in VMEM to f32. Scales are per (page, kv head, K/V): each
page's row of kv_scales_PK (2K floats) is DMA'd into SMEM next to its K/V and applied per column group.

Status: checked by the TPU interpreter (tests) and by exporting for the tpu platform; never run on a TPU
(none available here), so Mosaic's own compiler passes (layouts of the strided page DMAs, VMEM limits) and
the speed are unverified. Needs H % 128 == 0 and a page size that divides 128 or is a multiple of 128.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import common
from .work_items import gather_item_rows, ragged_work_items, tile_major_q

Unsupported = common.Unsupported
ROWS = 64


@dataclasses.dataclass(frozen=True)
class TpuConfig:
  ragged: bool
  sparse: bool
  S: int
  K: int
  g: int
  G: int
  H: int
  Pmax: int  # entries per page-list row
  BK: int  # kv tokens per step (ppb whole pages)
  R: int  # q rows per program
  fp8: bool
  scale: float
  soft_cap: float | None
  window: int | None
  out_dtype: str

  @property
  def ppb(self):
    return self.BK // self.G


def check_supported(G, H, g):
  if not (128 % G == 0 or G % 128 == 0):
    raise Unsupported(f"page size G={G} must divide 128 or be a multiple of 128")
  if H % 128:
    raise Unsupported(f"head dim H={H} must be a multiple of 128 (TPU lanes)")


def _kernel(cfg: TpuConfig, *refs):
  it = iter(refs)
  lens_ref = next(it)
  info_ref = next(it) if cfg.ragged else None
  nsel_ref = next(it) if cfg.sparse else None
  lp_ref = next(it) if cfg.sparse else None
  q_ref, kv_hbm, bt_hbm, rowtok_ref = next(it), next(it), next(it), next(it)
  sc_hbm = next(it) if cfg.fp8 else None
  o_ref, kbuf, vbuf, ids, sems, id_sems = next(it), next(it), next(it), next(it), next(it), next(it)
  scbuf = next(it) if cfg.fp8 else None

  G, BK, ppb, R, K = cfg.G, cfg.BK, cfg.ppb, cfg.R, cfg.K
  K2 = 2 * K
  if cfg.ragged:  # grid (kv head, work item): consecutive items of one kv head run in order (see _call)
    k = pl.program_id(0)
    i0 = pl.program_id(1)
    s = info_ref[INFO * i0]
    qpos0 = info_ref[INFO * i0 + 2]
    p_lo, p_hi = info_ref[INFO * i0 + 3], info_ref[INFO * i0 + 4]
  else:
    s = pl.program_id(0)
    k = pl.program_id(1)
  kv_len = lens_ref[s]

  # The block range comes from the real lengths only (never from the table width Pmax).
  if cfg.sparse:
    nsel = nsel_ref[s * K + k]
    first, last = jnp.int32(0), lax.div(nsel + ppb - 1, ppb)
  elif cfg.ragged:
    last = jnp.where(p_hi > p_lo, lax.div(jnp.minimum(p_hi, kv_len) + BK - 1, BK), 0)
    first = jnp.int32(0) if cfg.window is None else lax.div(jnp.maximum(p_lo - cfg.window + 1, 0), BK)
  else:
    last = lax.div(jnp.maximum(kv_len, 0) + BK - 1, BK)
    first = jnp.int32(0) if cfg.window is None else lax.div(jnp.maximum(kv_len - cfg.window, 0), BK)
  n = jnp.maximum(last - first, 0)

  # Page ids are fetched on demand: the table stays in HBM (all of it in SMEM would not fit at a wide Pmax), and
  # block b's NID ids arrive by one small DMA into a 3-slot SMEM ring two blocks ahead of their use.
  NID = min(ppb, cfg.Pmax)
  row = s * K + k if cfg.sparse else s  # the page-id row of this program in the [rows, Pmax] table (HBM)

  def id_start(b):
    return jnp.clip(b * ppb, 0, cfg.Pmax - NID)

  def id_copy(b, islot):
    return pltpu.make_async_copy(bt_hbm.at[row, pl.ds(id_start(b), NID)], ids.at[pl.ds(islot * NID, NID)],
                                 id_sems.at[islot])

  def page(b, islot, j):
    return ids[islot * NID + jnp.minimum(b * ppb + j, cfg.Pmax - 1) - id_start(b)]

  def copies(b, slot, islot):
    out = []
    for j in range(ppb):
      pg = page(b, islot, j)
      out.append(pltpu.make_async_copy(kv_hbm.at[pg, :, 2 * k, :], kbuf.at[slot, pl.ds(j * G, G), :],
                                       sems.at[0, slot]))
      out.append(pltpu.make_async_copy(kv_hbm.at[pg, :, 2 * k + 1, :], vbuf.at[slot, pl.ds(j * G, G), :],
                                       sems.at[1, slot]))
      if cfg.fp8:  # the page's 2K scales (K and V of every kv head: one contiguous row) into SMEM
        out.append(pltpu.make_async_copy(sc_hbm.at[pg], scbuf.at[pl.ds((slot * ppb + j) * K2, K2)],
                                         sems.at[2, slot]))
    return out

  @pl.when(n > 0)
  def _():
    c = id_copy(first, 0)
    c.start()
    c.wait()
    for c in copies(first, 0, 0):
      c.start()

  @pl.when(n > 1)
  def _():
    id_copy(first + 1, 1).start()

  q = q_ref[...].astype(jnp.float32)  # [R, H]
  col = lax.broadcasted_iota(jnp.int32, (1, BK), 1)
  if cfg.ragged:
    qpos = qpos0 + rowtok_ref[...]  # [R, 1]

  def page_row(vals):
    """[1, BK] row whose column c holds vals[c // G] (ppb per-page scalars)."""
    if len(vals) == 1:
      return jnp.full((1, BK), vals[0], jnp.float32)
    pj = lax.shift_right_logical(col, G.bit_length() - 1)
    res = jnp.full((1, BK), vals[-1], jnp.float32)
    for j in range(len(vals) - 2, -1, -1):
      res = jnp.where(pj == j, vals[j], res)
    return res

  def body(i, carry):
    acc, m_i, l_i = carry
    b = first + i
    slot = lax.rem(i, 2)
    islot = lax.rem(i, 3)

    @pl.when(i + 1 < n)
    def _():
      nis = lax.rem(i + 1, 3)
      id_copy(b + 1, nis).wait()
      for c in copies(b + 1, 1 - slot, nis):
        c.start()

    @pl.when(i + 2 < n)
    def _():
      id_copy(b + 2, lax.rem(i + 2, 3)).start()

    for c in copies(b, slot, islot):
      c.wait()
    kk = kbuf[slot].astype(jnp.float32)  # [BK, H]
    vv = vbuf[slot].astype(jnp.float32)
    logits = lax.dot_general(q, kk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * cfg.scale
    if cfg.fp8:
      base = slot * ppb * K2
      logits = logits * page_row([scbuf[base + j * K2 + 2 * k] for j in range(ppb)])
    if cfg.soft_cap is not None:
      logits = jnp.tanh(logits / cfg.soft_cap) * cfg.soft_cap
    if cfg.sparse:
      pos = jnp.zeros((1, BK), jnp.int32)
      for j in range(ppb):
        e = b * ppb + j
        lp = jnp.where(e < nsel, lp_ref[(s * K + k) * cfg.Pmax + jnp.minimum(e, cfg.Pmax - 1)], 1 << 20)
        pos = jnp.where(lax.shift_right_logical(col, G.bit_length() - 1) == j, lp * G + col - j * G, pos) \
            if ppb > 1 else lp * G + col
    else:
      pos = b * BK + col
    valid = pos < kv_len
    if cfg.ragged:
      valid = valid & (pos <= qpos)
      if cfg.window is not None:
        valid = valid & (pos > qpos - cfg.window)
    elif cfg.window is not None:
      valid = valid & (pos > kv_len - 1 - cfg.window)
    logits = jnp.where(valid, logits, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(logits, axis=1, keepdims=True))
    alpha = jnp.exp(m_i - m_new)
    p = jnp.exp(logits - m_new)
    l_i = l_i * alpha + jnp.sum(p, axis=1, keepdims=True)
    if cfg.fp8:
      p = p * page_row([scbuf[base + j * K2 + 2 * k + 1] for j in range(ppb)])
    acc = acc * alpha + jnp.dot(p, vv, preferred_element_type=jnp.float32)
    return acc, m_new, l_i

  init = (jnp.zeros((R, cfg.H), jnp.float32), jnp.full((R, 1), -1e30, jnp.float32), jnp.zeros((R, 1), jnp.float32))
  acc, m_i, l_i = lax.fori_loop(0, n, body, init)
  inv = jnp.where(l_i > 0, 1.0 / jnp.where(l_i > 0, l_i, 1.0), 0.0)

  def write():
    o_ref[...] = (acc * inv).astype(o_ref.dtype)

  if cfg.ragged:  # an empty item leaves the resident output block (its predecessor's) untouched; see _call
    pl.when(p_hi > p_lo)(write)
  else:
    write()


INFO = 6  # ragged work-item row in SMEM: work_items.ragged_work_items' 5 columns + the output block (see _call)


def _call(cfg: TpuConfig, prefetch, q, kv_pages_PGKH, bt_rows, rowtok, kv_scales_PK, *, interpret, n_out=None):
  """q: decode [S, K, R, H]; ragged [NQ, K, R, H] q tiles. Returns decode [S, K, R, H], ragged [n_out, K, R, H].

  Ragged grid (K, items) with items innermost: item i reads q tile info[i, 1] and writes output block
  info[i, 5]. The wrapper points every empty item (the static list's padding) at the last real item's tile and
  output block, so the pipeline neither fetches nor writes back anything for it (same block indices as the
  program before) and the kernel skips its store: padding items cost a grid step, no DMA.
  """
  if cfg.ragged:
    grid = (cfg.K, n_out)
    q_map = lambda k, i, *pref: (pref[1][INFO * i + 1], k, 0, 0)
    o_map = lambda k, i, *pref: (pref[1][INFO * i + 5], k, 0, 0)
    out_shape = (n_out,) + q.shape[1:]
  else:
    grid = (q.shape[0], cfg.K)
    q_map = o_map = lambda i, k, *_: (i, k, 0, 0)
    out_shape = q.shape
  in_specs = [pl.BlockSpec((None, None, cfg.R, cfg.H), q_map),
              pl.BlockSpec(memory_space=pl.ANY),
              pl.BlockSpec(memory_space=pl.ANY),
              pl.BlockSpec((cfg.R, 1), lambda *_: (0, 0))]
  inputs = [q, kv_pages_PGKH, bt_rows, rowtok]
  if cfg.fp8:
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    inputs.append(kv_scales_PK)
  pool_dt = kv_pages_PGKH.dtype
  nid = min(cfg.ppb, cfg.Pmax)
  scratch = [pltpu.VMEM((2, cfg.BK, cfg.H), pool_dt), pltpu.VMEM((2, cfg.BK, cfg.H), pool_dt),
             pltpu.SMEM((3 * nid,), jnp.int32), pltpu.SemaphoreType.DMA((3 if cfg.fp8 else 2, 2)),
             pltpu.SemaphoreType.DMA((3,))]
  if cfg.fp8:
    scratch.append(pltpu.SMEM((2 * cfg.ppb * 2 * cfg.K,), jnp.float32))
  return pl.pallas_call(
      functools.partial(_kernel, cfg),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch), grid=grid, in_specs=in_specs,
          out_specs=pl.BlockSpec((None, None, cfg.R, cfg.H), o_map),
          scratch_shapes=scratch),
      out_shape=jax.ShapeDtypeStruct(out_shape, jnp.dtype(cfg.out_dtype)),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
  )(*prefetch, *inputs)


def _block(G):
  return max(G, 256)


def _make_cfg(q_shape_SNH, kv_pages_PGKH, Pmax, *, ragged, sparse, scale, soft_cap, sliding_window, out_dtype, R):
  S, N, H = q_shape_SNH
  P, G, K2, _ = kv_pages_PGKH.shape
  K = K2 // 2
  check_supported(G, H, N // K)
  return TpuConfig(ragged=ragged, sparse=sparse, S=S, K=K, g=N // K, G=G, H=H, Pmax=Pmax, BK=_block(G), R=R,
                   fp8=common.is_fp8(kv_pages_PGKH.dtype), scale=common.default_scale(H, scale),
                   soft_cap=None if soft_cap is None else float(soft_cap),
                   window=None if sliding_window is None else int(sliding_window), out_dtype=out_dtype)


def decode_core(q_SNH, kv_pages_PGKH, pages, kv_lens_S, kv_scales_PK, nsel_SK=None, lp=None, *, scale=None,
                soft_cap=None, sliding_window=None, interpret=False):
  """Shared by dense decode (pages = block tables [S, Pmax]) and sparse decode (pages [S, K, U] + lp, nsel)."""
  S, N, H = q_SNH.shape
  sparse = nsel_SK is not None
  Pmax = pages.shape[-1]
  K = kv_pages_PGKH.shape[2] // 2
  g = N // K
  cfg = _make_cfg(q_SNH.shape, kv_pages_PGKH, Pmax, ragged=False, sparse=sparse, scale=scale, soft_cap=soft_cap,
                  sliding_window=sliding_window, out_dtype=jnp.dtype(q_SNH.dtype).name, R=g)
  q = q_SNH.reshape(S, K, g, H)
  prefetch = [kv_lens_S]
  if sparse:
    prefetch += [nsel_SK.reshape(-1).astype(jnp.int32), lp.reshape(-1).astype(jnp.int32)]
  rowtok = jnp.zeros((g, 1), jnp.int32)
  out = _call(cfg, prefetch, q, kv_pages_PGKH, pages.reshape(-1, Pmax).astype(jnp.int32), rowtok, kv_scales_PK,
              interpret=interpret)
  return out.reshape(S, N, H)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret"))
def paged_decode_attention_tpu(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, *, scale=None, soft_cap=None,
                               sliding_window=None, kv_scales_PK=None, interpret=False):
  """Mosaic TPU decode attention. Raises Unsupported for shapes it cannot run."""
  common.check_decode(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kv_scales_PK, soft_cap=soft_cap,
                      sliding_window=sliding_window)
  return decode_core(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kv_scales_PK, scale=scale,
                     soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret"))
def paged_attention_tpu(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, *, scale=None,
                        soft_cap=None, sliding_window=None, kv_scales_PK=None, interpret=False):
  """Mosaic TPU ragged (prefill / mixed) paged attention (work list: work_items.ragged_work_items)."""
  S, N, K, g, P, G, H = common.check_ragged(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1,
                                            kv_scales_PK, soft_cap=soft_cap, sliding_window=sliding_window)
  T = q_TNH.shape[0]
  tq = max(1, ROWS // g)
  R = tq * g
  Pmax = block_tables_SP.shape[1]
  cfg = _make_cfg((S, N, H), kv_pages_PGKH, Pmax, ragged=True, sparse=False, scale=scale, soft_cap=soft_cap,
                  sliding_window=sliding_window, out_dtype=jnp.dtype(q_TNH.dtype).name, R=R)
  info, item_T, has_T, _, NI, NQ = ragged_work_items(cu_q_lens_S1, kv_lens_S, T, tq)
  # Empty items (packed at the end) take the last real item's q tile and output block: see _call.
  real = info[:, 4] > info[:, 3]
  last = jnp.maximum(jnp.sum(real.astype(jnp.int32)) - 1, 0)
  i = jnp.arange(NI, dtype=jnp.int32)
  info = jnp.concatenate([info[:, :1], jnp.where(real, info[:, 1], info[last, 1])[:, None], info[:, 2:],
                          jnp.where(real, i, last)[:, None]], axis=1)
  q = tile_major_q(q_TNH, K, tq, NQ, R, q_TNH.dtype)  # [NQ, K, R, H]
  rowtok = jnp.asarray((np.arange(R) // g).reshape(R, 1), jnp.int32)
  prefetch = [kv_lens_S, info.reshape(-1)]
  o_items = _call(cfg, prefetch, q, kv_pages_PGKH, block_tables_SP, rowtok, kv_scales_PK,
                  interpret=interpret, n_out=NI)  # [NI, K, R, H]
  return gather_item_rows(o_items, item_T, has_T, tq, g, q_TNH.dtype)
