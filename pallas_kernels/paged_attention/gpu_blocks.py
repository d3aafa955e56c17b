"""Kernel-body pieces shared by the two Mosaic GPU paged-attention kernels (gpu.py, gpu_fp8.py).

Why a module of its own: the one-warpgroup kernel (gpu.py) and the warp-specialized fp8 kernel (gpu_fp8.py) walk
the same KV blocks, issue the same page TMAs, mask and update the online softmax the same way and store work-list
outputs alike; gpu.py also chooses which of the two runs. Both import these pieces from here, so neither kernel
module imports the other's internals.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # wgmma M
LOG2E = math.log2(math.e)
SENTINEL_PAGE = 1 << 20  # logical page of unused sparse-selection entries: its positions are >= any kv_len
M_INIT = -1e30  # finite start for the running max (log2 domain): empty programs stay NaN-free


def tiles(dtype, minor=128):
  """Tiling + swizzle for an smem tile whose minor dim has `minor` elements."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = min(128, minor * bits // 8)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def q_scratch(cfg):
  """Shared-memory type of the 64-row q tile: f16/bf16, or (qk8) e4m3 with the fp8 ring's tiling."""
  if cfg.qk8:
    f8 = jnp.dtype(jnp.float8_e4m3fn)
    return plgpu.SMEM((ROWS, cfg.H), f8, transforms=tiles(f8, cfg.H))
  return plgpu.SMEM((ROWS, cfg.H), cfg.compute_dtype, transforms=tiles(cfg.compute_dtype))


def work_list_out_types(cfg):
  """o_home [S, N, H] (output dtype), m/l_home [S, K, 64], o_ext [extra, N, H] f32, m/l_ext [extra, K, 64]."""
  S, N, K, H, C = cfg.S, cfg.N, cfg.K, cfg.H, max(cfg.extra, 1)
  f32 = jnp.float32
  return [jax.ShapeDtypeStruct((S, N, H), jnp.dtype(cfg.out_dtype)), jax.ShapeDtypeStruct((S, K, ROWS), f32),
          jax.ShapeDtypeStruct((S, K, ROWS), f32), jax.ShapeDtypeStruct((C, N, H), f32),
          jax.ShapeDtypeStruct((C, K, ROWS), f32), jax.ShapeDtypeStruct((C, K, ROWS), f32)]


def page_columns(values, col, G):
  """A [ROWS, BK] array whose column c holds values[c // G] (static list of per-page scalars; one: itself)."""
  if len(values) == 1:
    return values[0]
  page_col = col // G
  res = values[-1]
  for j in range(len(values) - 2, -1, -1):
    res = jnp.where(page_col == j, values[j], res)
  return res


def column_positions(cfg, b, col, logical_page):
  """Logical token position of each column of block b ([ROWS, BK] int32, col = the column iota)."""
  G, BK, ppb, spp = cfg.G, cfg.BK, cfg.ppb, cfg.spp
  if not cfg.sparse:
    return b * BK + col
  if spp == 1:
    return page_columns([logical_page(b * ppb + j) * G for j in range(ppb)], col, G) + col % G
  return logical_page(b // spp) * G + (b % spp) * BK + col


def online_softmax_step(cfg, logits, pos, kv_len, m_i, l_i, acc, qpos=None):
  """Soft cap, causal / window mask (ragged: per query position `qpos`), then one online-softmax update (base 2).

  Returns (p, m_new, l_new, acc rescaled): the caller adds p @ V to acc. Shared by both GPU kernels.
  """
  if cfg.soft_cap is not None:
    logits = jnp.tanh(logits * (1.0 / cfg.soft_cap)) * cfg.soft_cap
  valid = pos < kv_len
  if qpos is not None:
    valid = valid & (pos <= qpos)
    if cfg.window is not None:
      valid = valid & (pos > qpos - cfg.window)
  elif cfg.window is not None:
    valid = valid & (pos > kv_len - 1 - cfg.window)
  logits = jnp.where(valid, logits * LOG2E, -jnp.inf)
  m_new = jnp.maximum(m_i, logits.max(axis=1))
  alpha = jnp.exp2(m_i - m_new)
  p = jnp.exp2(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
  l_i = l_i * alpha + p.sum(axis=1)
  acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
  return p, m_new, l_i, acc


def decode_program(cfg, wl_ref):
  """(work item or None, sequence, split, run-time split count or None) of this decode program: from the work
  list (work-list decode) or from the grid."""
  if cfg.worklist:
    w = lax.axis_index("work")
    return w, wl_ref[w, 0], wl_ref[w, 1], wl_ref[w, 2]
  return None, lax.axis_index("seq"), lax.axis_index("split"), None


def block_walk(cfg, s, k, sp, kv_len, bt_ref, lp_ref, nsel_ref, ragged=None, nsplit=None):
  """Which KV blocks one program reads, shared by the kernels here and in gpu_fp8.py.

  The sequence's blocks of BK tokens form a range [first, last) (the sparse selection's entries, the causal
  prefix of a ragged work item, or the window / whole context), computed from the REAL lengths (kv_len, the
  selection count, the item's query positions): nothing here depends on the block table's width. The range is
  cut at run time into `splits` near-equal parts and split `sp` takes part sp, so the work of a sequence is
  spread over all its split programs whatever its length; a program whose part is empty (kv_len 0, or a short
  sequence with more splits than blocks) gets n_steps = 0.
  ragged: (p_lo, p_hi) = position of the item's first valid query token and one past its last one (p_hi <= p_lo:
  an empty item). nsplit: a run-time split count (work-list decode; 0 = an idle item) instead of cfg.splits.
  Returns (b_lo, n_steps, block_pages(b) -> physical page ids of block b (scalar loads),
  logical_page(i) -> logical page of entry i).
  """
  BK, ppb, spp = cfg.BK, cfg.ppb, cfg.spp
  nsel = None
  if cfg.sparse:
    nsel = nsel_ref[s, k]
    last = nsel * spp if spp > 1 else (nsel + ppb - 1) // ppb
    first = 0
  elif ragged is not None:
    p_lo, p_hi = ragged
    last = jnp.where(p_hi > p_lo, (jnp.minimum(p_hi, kv_len) + BK - 1) // BK, 0)
    first = 0 if cfg.window is None else jnp.maximum(p_lo - cfg.window + 1, 0) // BK
  else:
    last = (kv_len + BK - 1) // BK
    first = 0 if cfg.window is None else jnp.maximum(kv_len - cfg.window, 0) // BK
  total = jnp.maximum(last - first, 0)
  if nsplit is not None:
    per = (total + jnp.maximum(nsplit, 1) - 1) // jnp.maximum(nsplit, 1)
    b_lo = first + sp * per
    n_steps = jnp.where(nsplit > 0, jnp.clip(total - sp * per, 0, per), 0)
  elif cfg.splits == 1:
    b_lo, n_steps = first, total
  else:
    per = (total + cfg.splits - 1) // cfg.splits
    b_lo = first + sp * per
    n_steps = jnp.clip(total - sp * per, 0, per)

  def page_of(idx):
    idx = jnp.clip(idx, 0, cfg.Pmax - 1)
    return bt_ref[s, k, idx] if cfg.sparse else bt_ref[s, idx]

  def block_pages(b):
    """Physical page ids of block b: ppb pages, or the one page b is a slice of."""
    return [page_of(b * ppb + j) for j in range(ppb)] if spp == 1 else [page_of(b // spp)]

  def logical_page(idx):
    """Logical page of selection entry idx; entries past the count map far beyond kv_len (masked)."""
    if cfg.sparse:
      return jnp.where(idx < nsel, lp_ref[s, k, jnp.clip(idx, 0, cfg.Pmax - 1)], SENTINEL_PAGE)
    return idx
  return b_lo, n_steps, block_pages, logical_page


def issue_block_tmas(cfg, kv_ref, k, b, pages, k_dst, v_dst, bar):
  """Starts the TMAs of block b of kv head k into (k_dst, v_dst) on barrier `bar`: K and V of ppb whole pages
  ([G, H] boxes of the interleaved pool), or the (b % spp)-th BK-token slice of one page."""
  G, BK = cfg.G, cfg.BK
  if cfg.spp == 1:
    for j, pg in enumerate(pages):
      plgpu.copy_gmem_to_smem(kv_ref.at[pg, :, 2 * k, :], k_dst.at[pl.ds(j * G, G)], bar)
      plgpu.copy_gmem_to_smem(kv_ref.at[pg, :, 2 * k + 1, :], v_dst.at[pl.ds(j * G, G)], bar)
  else:
    pg, off = pages[0], (b % cfg.spp) * BK
    plgpu.copy_gmem_to_smem(kv_ref.at[pg, pl.ds(off, BK), 2 * k, :], k_dst, bar)
    plgpu.copy_gmem_to_smem(kv_ref.at[pg, pl.ds(off, BK), 2 * k + 1, :], v_dst, bar)


def store_work_item(cfg, w, s, k, local, acc, m_i, l_i, o_ref, m_ref, l_ref, ext_refs, oh_smem, of_smem, ml_smem):
  """Work-list decode output of one (item, kv head): its normalized o (1/l applied; 0 where l = 0) and (m, l).
  Items 0..extra-1 are extra chunks (f32 rows of o_ext); items extra.. are the homes of the S sequences (rows of
  the output itself, in its dtype: it is final when the sequence has one chunk). Shared with gpu_fp8.py."""
  o_ext, m_ext, l_ext = ext_refs
  g = cfg.g
  inv = jnp.where(l_i > 0, 1.0 / jnp.where(l_i > 0, l_i, 1.0), 0.0)
  o = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
  ml_smem[0] = m_i
  ml_smem[1] = l_i

  @pl.when(w >= cfg.extra)
  def _():
    oh_smem[...] = o.astype(oh_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(oh_smem.at[pl.ds(local, g)], o_ref.at[s, pl.ds(k * g, g)])
    plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[s, k])
    plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[s, k])
    plgpu.wait_smem_to_gmem(0)

  if cfg.extra:
    @pl.when(w < cfg.extra)
    def _():
      of_smem[...] = o
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(of_smem.at[pl.ds(local, g)], o_ext.at[w, pl.ds(k * g, g)])
      plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ext.at[w, k])
      plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ext.at[w, k])
      plgpu.wait_smem_to_gmem(0)
