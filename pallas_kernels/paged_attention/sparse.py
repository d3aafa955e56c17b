"""Paged sparse decode attention (Quest-style): read only sink pages + the recent window + top-k scored pages.

Why it exists: at long contexts decode attention reads every KV page every step; most attention mass sits in a
few pages. Per sequence and per kv head we pick a small page set and run the same paged kernels over it.

Design
- Page summaries: per page and kv head, elementwise min and max of the keys written so far
  (`kmin_PKH`, `kmax_PKH`, [P, K, H]); kept up to date by `update_page_summaries` next to `write_kv`
  (a write at page offset 0 starts the page afresh and resets its summary).
- Score of page j for kv head k: the Quest upper bound of q.k over the page, maximized over the g query heads
  of the group: max_n sum_h max(q_nh * min_jh, q_nh * max_jh). Written as q.c + |q|.r with
  c = (max+min)/2 and r = (max-min)/2, i.e. two small matmuls on page-level data (nothing token-level is
  materialized: the largest intermediate is [S, K, g, pages]).
- Selection (per sequence and kv head): if the sequence has <= U = sinks + window + top_k pages, all of them;
  else pages [0, sinks), the last `window` pages (the partial last page included) and the top_k best of
  the rest. The list is sorted by logical page; unused entries carry the sentinel logical page Pmax (so every
  token position they would produce is >= kv_len and masked) and a valid physical page (0).
- Attention over the selection: `paged_sparse_decode_attention` hands (physical pages [S, K, U], logical pages
  [S, K, U], counts [S, K]) to the GPU/TPU kernels, which mask by logical token position; the reference is dense
  attention restricted to the selected pages.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax

from . import common, gpu, reference, tpu, tuning
from .dispatch import resolve_impl

log = logging.getLogger("pallas_kernels.paged_attention")


def init_page_summaries(num_pages: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32):
  """Empty summaries: min = +inf, max = -inf for every page (identity of min/max)."""
  shape = (num_pages, num_kv_heads, head_dim)
  return jnp.full(shape, jnp.inf, dtype), jnp.full(shape, -jnp.inf, dtype)


def update_page_summaries(kmin_PKH, kmax_PKH, k_TKH, slot_mapping_T, *, page_size: int):
  """Folds new keys into the per-page min/max (slot < 0 skipped; offset-0 writes reset the page first)."""
  return _update(kmin_PKH, kmax_PKH, k_TKH, slot_mapping_T, page_size=page_size)


@functools.partial(jax.jit, static_argnames=("page_size",))
def _update(kmin_PKH, kmax_PKH, k_TKH, slot_mapping_T, *, page_size):
  if kmin_PKH.shape != kmax_PKH.shape or jnp.ndim(kmin_PKH) != 3:
    raise ValueError(f"kmin_PKH/kmax_PKH must both be [P, K, H], got {kmin_PKH.shape} and {kmax_PKH.shape}")
  P, K, H = kmin_PKH.shape
  if jnp.ndim(k_TKH) != 3 or tuple(k_TKH.shape[1:]) != (K, H):
    raise ValueError(f"k_TKH must be [T, K={K}, H={H}], got {k_TKH.shape}")
  if jnp.ndim(slot_mapping_T) != 1 or slot_mapping_T.shape[0] != k_TKH.shape[0]:
    raise ValueError(f"slot_mapping_T must be [T={k_TKH.shape[0]}], got {jnp.shape(slot_mapping_T)}")
  G = page_size
  valid = (slot_mapping_T >= 0) & (slot_mapping_T < P * G)
  page = jnp.where(valid, slot_mapping_T // G, P)
  fresh = jnp.where(valid & (slot_mapping_T % G == 0), page, P)
  kmin = kmin_PKH.at[fresh].set(jnp.inf, mode="drop").at[page].min(k_TKH.astype(kmin_PKH.dtype), mode="drop")
  kmax = kmax_PKH.at[fresh].set(-jnp.inf, mode="drop").at[page].max(k_TKH.astype(kmax_PKH.dtype), mode="drop")
  return kmin, kmax


def page_scores(q_SNH, kmin_PKH, kmax_PKH, block_tables_SP):
  """Quest upper bound per (sequence, kv head, table entry): [S, K, Pmax] f32 (max over the group's heads).

  Computed in the summaries' dtype with f32 accumulation (one gather of each summary, two matmuls). Pages
  never written (min = +inf, max = -inf) give NaN scores; callers mask pages outside the sequence anyway.
  """
  S, N, H = q_SNH.shape
  K = kmin_PKH.shape[1]
  g = N // K
  mn = kmin_PKH[block_tables_SP]  # [S, Pmax, K, H]
  mx = kmax_PKH[block_tables_SP]
  c = (mx + mn) * 0.5
  r = (mx - mn) * 0.5
  dt = kmin_PKH.dtype
  q = q_SNH.reshape(S, K, g, H)
  sc = (jnp.einsum("skgh,spkh->skgp", q.astype(dt), c, preferred_element_type=jnp.float32)
        + jnp.einsum("skgh,spkh->skgp", jnp.abs(q).astype(dt), r, preferred_element_type=jnp.float32))
  return jnp.max(sc, axis=2)


def budget(num_sink_pages, num_window_pages, top_k_pages, table_cols):
  return max(1, min(table_cols, num_sink_pages + num_window_pages + top_k_pages))


@functools.partial(jax.jit, static_argnames=("page_size", "num_sink_pages", "num_window_pages", "top_k_pages"))
def select_pages(q_SNH, kmin_PKH, kmax_PKH, block_tables_SP, kv_lens_S, *, page_size, num_sink_pages,
                 num_window_pages, top_k_pages):
  """Per (sequence, kv head): (physical pages [S, K, U], logical pages [S, K, U], count [S, K]) sorted by
  logical page; see the module docstring for the rule and the padding convention."""
  for name, v in (("num_sink_pages", num_sink_pages), ("num_window_pages", num_window_pages),
                  ("top_k_pages", top_k_pages)):
    if int(v) != v or v < 0:
      raise ValueError(f"{name} must be a non-negative int, got {v}")
  if num_window_pages < 1:
    raise ValueError("num_window_pages must be >= 1 (the page holding the query position is always read)")
  S, Pmax = block_tables_SP.shape
  K = kmin_PKH.shape[1]
  U = budget(num_sink_pages, num_window_pages, top_k_pages, Pmax)
  n_pages = (kv_lens_S + page_size - 1) // page_size  # [S]
  j = jnp.arange(Pmax, dtype=jnp.int32)[None, None, :]
  npg = n_pages[:, None, None]
  in_seq = j < npg
  fixed = in_seq & ((j < num_sink_pages) | (j >= npg - num_window_pages) | (npg <= U))
  cand = in_seq & ~fixed
  if top_k_pages > 0:
    scores = jnp.where(cand, page_scores(q_SNH, kmin_PKH, kmax_PKH, block_tables_SP), -jnp.inf)
    scores = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
    top_v, top_i = lax.top_k(scores, min(top_k_pages, Pmax))  # [S, K, min(top_k_pages, Pmax)]
    chosen = jnp.zeros((S, K, Pmax), bool)
    s_idx = jnp.arange(S)[:, None, None]
    k_idx = jnp.arange(K)[None, :, None]
    chosen = chosen.at[s_idx, k_idx, top_i].set(top_v > -jnp.inf)
    sel = fixed | (chosen & cand)
  else:
    sel = jnp.broadcast_to(fixed, (S, K, Pmax))
  logical = jnp.sort(jnp.where(sel, j, Pmax), axis=-1)[:, :, :U].astype(jnp.int32)
  count = jnp.sum(sel, axis=-1).astype(jnp.int32)
  phys = jnp.take_along_axis(block_tables_SP[:, None, :], jnp.clip(logical, 0, Pmax - 1), axis=-1)
  phys = jnp.where(logical < Pmax, phys, 0).astype(jnp.int32)
  return phys, logical, jnp.minimum(count, U)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap"))
def sparse_decode_attention_reference(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, logical_SKU, *, scale=None,
                                      soft_cap=None, kv_scales_PK=None):
  """Definition: dense decode attention where kv head k of sequence s sees only its selected logical pages."""
  S, N, K, g, P, G, H = common.check_decode(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kv_scales_PK,
                                            soft_cap=soft_cap, sliding_window=None)
  scale = common.default_scale(H, scale)
  k_SJKH, v_SJKH = reference._gather_sequences(kv_pages_PGKH, kv_scales_PK, block_tables_SP)
  J = k_SJKH.shape[1]
  q = q_SNH.astype(jnp.float32).reshape(S, K, g, H)
  logits = jnp.einsum("skgh,sjkh->skgj", q, k_SJKH, precision=lax.Precision.HIGHEST) * scale
  logits = reference._cap(logits, soft_cap)
  page_J = jnp.arange(J, dtype=jnp.int32) // G
  chosen = jnp.any(page_J[None, None, :, None] == logical_SKU[:, :, None, :], axis=-1)  # [S, K, J]
  mask = chosen & (jnp.arange(J)[None, None, :] < kv_lens_S[:, None, None])
  o, l = reference._softmax_attend(logits, mask[:, :, None, :], v_SJKH, "skgj,sjkh->skgh")
  o = o / jnp.where(l > 0, l, 1.0)
  return o.reshape(S, N, H).astype(q_SNH.dtype)


def paged_sparse_decode_attention(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kmin_PKH, kmax_PKH, *,
                                  num_sink_pages, num_window_pages, top_k_pages, scale=None, soft_cap=None,
                                  kv_scales_PK=None, impl="auto", return_selection=False):
  """Sparse decode attention: select pages per (sequence, kv head), then attend over them only."""
  S, N, K, g, P, G, H = common.check_decode(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kv_scales_PK,
                                            soft_cap=soft_cap, sliding_window=None)
  if tuple(kmin_PKH.shape) != (P, K, H) or tuple(kmax_PKH.shape) != (P, K, H):
    raise ValueError(f"kmin_PKH/kmax_PKH must be [P={P}, K={K}, H={H}], got {kmin_PKH.shape}, {kmax_PKH.shape}")
  phys, logical, count = select_pages(q_SNH, kmin_PKH, kmax_PKH, block_tables_SP, kv_lens_S, page_size=G,
                                      num_sink_pages=num_sink_pages, num_window_pages=num_window_pages,
                                      top_k_pages=top_k_pages)
  which = resolve_impl(impl)
  kw = dict(scale=scale, soft_cap=soft_cap, kv_scales_PK=kv_scales_PK)
  out = None
  try:
    if which.startswith("gpu"):
      out = _sparse_gpu(q_SNH, kv_pages_PGKH, phys, logical, count, kv_lens_S, interpret=which.endswith("interpret"),
                        tun=tuning.current(), **kw)
    elif which.startswith("tpu"):
      out = tpu.decode_core(q_SNH, kv_pages_PGKH, phys, kv_lens_S, kv_scales_PK, count, logical, scale=scale,
                            soft_cap=soft_cap, interpret=which.endswith("interpret"))
  except common.Unsupported as err:
    log.warning("paged attention: %s sparse kernel cannot run this call (%s); using the jnp reference", which, err)
  if out is None:
    out = sparse_decode_attention_reference(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, logical, **kw)
  return (out, (phys, logical, count)) if return_selection else out


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "interpret", "tun"))
def _sparse_gpu(q_SNH, kv_pages_PGKH, phys, logical, count, kv_lens_S, *, scale, soft_cap, kv_scales_PK, interpret,
                tun):
  """The GPU kernel over the selected pages; `tun`: the tuning row of this call (static: an override is never
  hidden by a cached trace)."""
  S, N, H = q_SNH.shape
  cfg = gpu.make_config(q_SNH.shape, kv_pages_PGKH.shape, kv_pages_PGKH.dtype, phys.shape[-1],
                        scale=common.default_scale(H, scale), soft_cap=soft_cap, sliding_window=None, sparse=True,
                        out_dtype=jnp.dtype(q_SNH.dtype).name, p_via_smem=interpret, tun=tun)
  return gpu._run_decode(cfg, q_SNH, kv_pages_PGKH, phys, kv_lens_S, count, logical, kv_scales_PK, interpret)
