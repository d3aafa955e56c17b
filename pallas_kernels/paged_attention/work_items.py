"""The ragged attention kernels' work list, shared by the Mosaic GPU and Mosaic TPU versions (pure jnp, no kernel):
the (q tile, sequence) items that have work (`ragged_work_items`), q laid out tile-major for them (`tile_major_q`),
and the per-item outputs gathered back into rows (`gather_item_rows`)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import common

__all__ = ["ragged_work_items", "tile_major_q", "gather_item_rows"]


def _count_le(vals, n: int):
  """[n] int32: for i in 0..n-1, the number of entries of (sorted) vals that are <= i = searchsorted(vals, i,
  "right"). compare_all: one fused comparison; the default "scan" method is a while loop (~log2 launches on a GPU;
  an all-empty ragged call took 60 us on the H200 with it, 20 us without). A histogram + cumsum was slower
  still on the H200 (18 vs 4 us for the whole work list at S = 4)."""
  return jnp.searchsorted(vals, jnp.arange(n, dtype=vals.dtype), side="right", method="compare_all").astype(jnp.int32)


def ragged_work_items(cu_q_lens_S1, kv_lens_S, T: int, tq: int):
  """The ragged kernels' work list: one item per (q tile, sequence) pair that has work.

  q is cut into NQ = cdiv(T, tq) fixed tiles of tq consecutive rows (so the tile-major q costs O(T), whatever S
  is); a sequence with query rows AND kv_len > 0 gets one item per tile its rows touch. Sequences at kv_len 0
  (padding slots, decode rows handled by the decode kernel) and rows past cu_q_lens[S] get no item: their output
  rows are zeros (the wrapper masks them). Items are packed at the front; the rest of the static list (NI =
  NQ + min(S, T) - 1 bounds the count: neighbouring sequences share at most one tile) is empty (p_lo = p_hi).

  Returns (info [NI, 5] int32 = (sequence, q tile, position of the tile's first row, p_lo, p_hi) with [p_lo, p_hi)
  the positions of the item's own rows (rows of other sequences in the tile are computed and thrown away),
  item_T [T] = the item holding each row (clipped; meaningful where has_T), has_T [T] = row has an item,
  n_items = the number of real items (int32 scalar), NI, NQ).
  """
  S = kv_lens_S.shape[0]
  NQ = max(1, common.cdiv(T, tq))
  NI = max(1, NQ + min(S, T) - 1)
  cu = cu_q_lens_S1.astype(jnp.int32)
  q_lens = cu[1:] - cu[:-1]
  lo = jnp.clip(cu[:-1], 0, T)
  hi = jnp.clip(cu[1:], lo, T)
  work = (hi > lo) & (kv_lens_S > 0)
  ft = lo // tq
  n_items = jnp.where(work, (hi - 1) // tq - ft + 1, 0)
  item_end = jnp.cumsum(n_items)
  item_start = item_end - n_items
  i = jnp.arange(NI, dtype=jnp.int32)
  seq = jnp.clip(_count_le(item_end, NI), 0, S - 1)
  valid = i < item_end[-1]
  tile = ft[seq] + i - item_start[seq]
  base = kv_lens_S[seq] - q_lens[seq] - cu[:-1][seq]  # position of row t of sequence seq = base + t
  row0 = tile * tq
  p_lo = base + jnp.maximum(lo[seq], row0)
  p_hi = base + jnp.minimum(hi[seq], row0 + tq)
  info = jnp.stack([jnp.where(valid, seq, 0), jnp.where(valid, jnp.clip(tile, 0, NQ - 1), 0),
                    jnp.where(valid, base + row0, 0), jnp.where(valid, p_lo, 0), jnp.where(valid, p_hi, 0)],
                   axis=-1).astype(jnp.int32)
  t = jnp.arange(T, dtype=jnp.int32)  # the sequence of each row, as reference.query_positions defines it
  seg_T = jnp.clip(_count_le(cu, T) - 1, 0, S - 1)
  has_T = work[seg_T] & (t >= lo[seg_T]) & (t < hi[seg_T])
  item_T = jnp.clip(item_start[seg_T] + t // tq - ft[seg_T], 0, NI - 1)
  # Materialized once (small): left fusible, XLA recomputed them inside the [T, N, H] output gather (H200: +33 us
  # at S = 256).
  info, item_T, has_T, n_items = lax.optimization_barrier((info, item_T, has_T, item_end[-1].astype(jnp.int32)))
  return info, item_T, has_T, n_items, NI, NQ


def tile_major_q(q_TNH, K, tq, NQ, rows, dtype):
  """q [T, N, H] -> [NQ, K, rows, H]: tile j, kv head k holds rows j*tq .. j*tq+tq-1, each as its g query heads
  (row = token-in-tile * g + head-in-group), zero rows past T and past tq * g."""
  T, N, H = q_TNH.shape
  g = N // K
  q = q_TNH.astype(dtype)
  if NQ * tq != T:
    q = jnp.pad(q, ((0, NQ * tq - T), (0, 0), (0, 0)))
  q = q.reshape(NQ, tq, K, g, H).transpose(0, 2, 1, 3, 4).reshape(NQ, K, tq * g, H)
  if tq * g != rows:
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - tq * g), (0, 0)))
  return q


def gather_item_rows(o_items, item_T, has_T, tq, g, dtype):
  """Per-item outputs [NI, K, >= tq*g, H] -> [T, N, H]: row t from its item, zeros where has_T is False."""
  NI, K, _, H = o_items.shape
  T = item_T.shape[0]
  t = jnp.arange(T, dtype=jnp.int32)
  o = o_items[:, :, :tq * g].reshape(NI, K, tq, g, H)[item_T, :, t % tq]  # [T, K, g, H]
  o = jnp.where(has_T[:, None, None, None], o, 0)
  return o.reshape(T, K * g, H).astype(dtype)
