"""Pure-jnp paged attention: the definition every kernel is tested against, and the portable fallback.

Semantics (shared with the kernels):
- Query rows cu_q_lens[s]:cu_q_lens[s+1] belong to sequence s and sit at positions kv_len - q_len .. kv_len - 1.
- A query at position p sees kv positions j with j <= p and j < kv_len (and j > p - sliding_window if set).
- logits = scale * q.k (scale defaults to 1/sqrt(H)); soft_cap: logits = cap * tanh(logits / cap).
- Query head n uses kv head n // group. fp8 pools dequantize as stored.astype(f32) * kv_scales_PK[page, 2k(+1)].
- A query row that sees no kv position (padding rows past cu_q_lens[S], empty sequences) outputs zeros.
Everything is computed in float32; the output has q's dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import common


def dequantize_pages(kv_pages_PGKH, kv_scales_PK):
  """Real values of (a gather of) pages as float32: stored * scale for fp8, a cast otherwise."""
  x = kv_pages_PGKH.astype(jnp.float32)
  if kv_scales_PK is not None:
    x = x * kv_scales_PK[:, None, :, None]
  return x


def _gather_sequences(kv_pages_PGKH, kv_scales_PK, block_tables_SP):
  """f32 K and V of every sequence: [S, J = pages*G, K, H] each (padding pages included; masked later)."""
  S, Pmax = block_tables_SP.shape
  _, G, K2, H = kv_pages_PGKH.shape
  pages = kv_pages_PGKH[block_tables_SP]  # [S, Pmax, G, 2K, H]
  scales = None if kv_scales_PK is None else kv_scales_PK[block_tables_SP]  # [S, Pmax, 2K]
  x = pages.astype(jnp.float32)
  if scales is not None:
    x = x * scales[:, :, None, :, None]
  x = x.reshape(S, Pmax * G, K2 // 2, 2, H)
  return x[..., 0, :], x[..., 1, :]


def _softmax_attend(logits, mask, v, out_spec):
  """Masked softmax over the last axis of logits, then weights @ v; fully masked rows give 0."""
  logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(logits - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum(out_spec, p, v, precision=lax.Precision.HIGHEST)
  return o, l


def _cap(logits, soft_cap):
  if soft_cap is None:
    return logits
  return soft_cap * jnp.tanh(logits / soft_cap)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window"))
def paged_decode_attention_reference(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, *, scale=None,
                                     soft_cap=None, sliding_window=None, kv_scales_PK=None):
  """Decode: one query per sequence at position kv_len - 1. q_SNH [S, N, H] -> [S, N, H]."""
  S, N, K, g, P, G, H = common.check_decode(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kv_scales_PK,
                                            soft_cap=soft_cap, sliding_window=sliding_window)
  scale = common.default_scale(H, scale)
  k_SJKH, v_SJKH = _gather_sequences(kv_pages_PGKH, kv_scales_PK, block_tables_SP)
  J = k_SJKH.shape[1]
  q = q_SNH.astype(jnp.float32).reshape(S, K, g, H)
  logits = jnp.einsum("skgh,sjkh->skgj", q, k_SJKH, precision=lax.Precision.HIGHEST) * scale
  logits = _cap(logits, soft_cap)
  pos_J = jnp.arange(J, dtype=jnp.int32)
  kv_len = kv_lens_S[:, None]
  mask = pos_J[None, :] < kv_len
  if sliding_window is not None:
    mask &= pos_J[None, :] > kv_len - 1 - sliding_window
  o, l = _softmax_attend(logits, mask[:, None, None, :], v_SJKH, "skgj,sjkh->skgh")
  o = o / jnp.where(l > 0, l, 1.0)
  return o.reshape(S, N, H).astype(q_SNH.dtype)


def query_positions(cu_q_lens_S1, kv_lens_S, T):
  """For each query row t: (sequence id, position), and whether the row belongs to any sequence."""
  t = jnp.arange(T, dtype=jnp.int32)
  seg_T = jnp.searchsorted(cu_q_lens_S1, t, side="right").astype(jnp.int32) - 1
  S = kv_lens_S.shape[0]
  valid_T = (t < cu_q_lens_S1[S]) & (seg_T >= 0) & (seg_T < S)
  seg_T = jnp.clip(seg_T, 0, S - 1)
  q_lens = cu_q_lens_S1[1:] - cu_q_lens_S1[:-1]
  pos_T = kv_lens_S[seg_T] - q_lens[seg_T] + (t - cu_q_lens_S1[seg_T])
  return seg_T, pos_T, valid_T


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window"))
def paged_attention_reference(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, *, scale=None,
                              soft_cap=None, sliding_window=None, kv_scales_PK=None):
  """Ragged (prefill / mixed) paged attention. q_TNH [T, N, H] -> [T, N, H].

  Loops over sequences (lax.scan) so memory stays O(T * N * J) instead of a per-token gather of the KV.
  """
  S, N, K, g, P, G, H = common.check_ragged(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1,
                                            kv_scales_PK, soft_cap=soft_cap, sliding_window=sliding_window)
  T = q_TNH.shape[0]
  scale = common.default_scale(H, scale)
  seg_T, pos_T, valid_T = query_positions(cu_q_lens_S1, kv_lens_S, T)
  q = q_TNH.astype(jnp.float32).reshape(T, K, g, H)
  J = block_tables_SP.shape[1] * G
  pos_J = jnp.arange(J, dtype=jnp.int32)

  def one_sequence(acc_TKgH, s):
    k_JKH, v_JKH = _gather_sequences(kv_pages_PGKH, kv_scales_PK, block_tables_SP[s][None])
    logits = jnp.einsum("tkgh,jkh->tkgj", q, k_JKH[0], precision=lax.Precision.HIGHEST) * scale
    logits = _cap(logits, soft_cap)
    mask = (pos_J[None, :] <= pos_T[:, None]) & (pos_J[None, :] < kv_lens_S[s])
    if sliding_window is not None:
      mask &= pos_J[None, :] > pos_T[:, None] - sliding_window
    mask &= (valid_T & (seg_T == s))[:, None]
    o, l = _softmax_attend(logits, mask[:, None, None, :], v_JKH[0], "tkgj,jkh->tkgh")
    return acc_TKgH + o / jnp.where(l > 0, l, 1.0), None

  out, _ = lax.scan(one_sequence, jnp.zeros((T, K, g, H), jnp.float32), jnp.arange(S, dtype=jnp.int32))
  return out.reshape(T, N, H).astype(q_TNH.dtype)
