"""Writing new K/V tokens into the paged pool (quantizing to fp8 with per-page scales when the pool is fp8).

Why it exists: the engine appends each step's K/V to the pool; for fp8 pools the per-(page, kv head, K/V)
scale may have to grow, and then the page's existing entries are requantized so that stored * scale stays
the real value. Only touched pages are gathered/scattered (no full-pool copy), so under `jax.jit` with the
pool donated the update happens in place.

Rules (fp8):
- scale_new = max(scale_old, amax(new values of this page/head/K-or-V) / fp8_max).
- A write at page offset 0 starts the page afresh: its scale is reset to 0 first (so a recycled page does not
  inherit a stale, too large scale). A page whose old scale is 0 needs no requantization.
- Pages whose scale grew are requantized in chunks of `REQUANT_CHUNK` pages inside a while loop, so memory
  stays bounded whatever the number of tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import common

REQUANT_CHUNK = 16


def _check(kv_pages_PGKH, kv_scales_PK, k_TKH, v_TKH, slot_mapping_T):
  P, G, K, H = common.check_pool(kv_pages_PGKH, kv_scales_PK)
  for name, x in (("k_TKH", k_TKH), ("v_TKH", v_TKH)):
    if jnp.ndim(x) != 3 or tuple(x.shape[1:]) != (K, H):
      raise ValueError(f"{name} must be [T, K={K}, H={H}], got shape {jnp.shape(x)}")
  if k_TKH.shape != v_TKH.shape:
    raise ValueError(f"k_TKH {k_TKH.shape} and v_TKH {v_TKH.shape} differ")
  if jnp.ndim(slot_mapping_T) != 1 or slot_mapping_T.shape[0] != k_TKH.shape[0]:
    raise ValueError(f"slot_mapping_T must be [T={k_TKH.shape[0]}], got shape {jnp.shape(slot_mapping_T)}")
  if jnp.dtype(slot_mapping_T.dtype) != jnp.dtype(jnp.int32):
    raise TypeError(f"slot_mapping_T must be int32, got {slot_mapping_T.dtype}")
  return P, G, K, H


def _interleave(k_TKH, v_TKH):
  T, K, H = k_TKH.shape
  return jnp.stack([k_TKH, v_TKH], axis=2).reshape(T, 2 * K, H)


def quantize(x_f32, scale, dtype):
  """stored = x / scale rounded to fp8 (0 where scale is 0), clipped to the finite range."""
  fmax = common.fp8_max(dtype)
  q = jnp.where(scale > 0, x_f32 / jnp.where(scale > 0, scale, 1.0), 0.0)
  return jnp.clip(q, -fmax, fmax).astype(dtype)


@jax.jit
def write_kv(kv_pages_PGKH, kv_scales_PK, k_TKH, v_TKH, slot_mapping_T):
  """Writes token t's K/V at slot slot_mapping_T[t] = page * G + offset (slot < 0: skipped).

  Returns (kv_pages_PGKH, kv_scales_PK); kv_scales_PK is None for bf16/f32 pools. Jittable; donate the pool
  (e.g. `jax.jit(write_kv, donate_argnums=(0, 1))` or inside a donating step) to update it in place.
  """
  P, G, K, H = _check(kv_pages_PGKH, kv_scales_PK, k_TKH, v_TKH, slot_mapping_T)
  T = k_TKH.shape[0]
  valid_T = (slot_mapping_T >= 0) & (slot_mapping_T < P * G)
  slot_T = jnp.where(valid_T, slot_mapping_T, P * G)  # out of range -> dropped by the scatters
  new_T2KH = _interleave(k_TKH, v_TKH)
  if not common.is_fp8(kv_pages_PGKH.dtype):
    flat = kv_pages_PGKH.reshape(P * G, 2 * K, H)
    flat = flat.at[slot_T].set(new_T2KH.astype(flat.dtype), mode="drop")
    return flat.reshape(P, G, 2 * K, H), kv_scales_PK

  dtype = kv_pages_PGKH.dtype
  page_T = jnp.where(valid_T, slot_T // G, P)
  fresh_T = valid_T & (slot_T % G == 0)
  scales = kv_scales_PK.at[jnp.where(fresh_T, page_T, P)].set(0.0, mode="drop")
  old_T2K = scales[jnp.clip(page_T, 0, P - 1)]
  amax_T2K = jnp.max(jnp.abs(new_T2KH.astype(jnp.float32)), axis=-1) / common.fp8_max(dtype)
  scales = scales.at[page_T].max(amax_T2K, mode="drop")

  # Pages whose scale grew while holding data: one entry per page (first token of that page in sorted order).
  new_of_T = scales[jnp.clip(page_T, 0, P - 1)]
  grew_T = valid_T & jnp.any((old_T2K > 0) & (new_of_T > old_T2K), axis=-1)
  order = jnp.argsort(jnp.where(grew_T, page_T, P))
  sorted_pages = jnp.where(grew_T, page_T, P)[order]
  first = jnp.concatenate([jnp.ones((1,), bool), sorted_pages[1:] != sorted_pages[:-1]]) & (sorted_pages < P)
  count = jnp.sum(first)
  n_pad = -(-T // REQUANT_CHUNK) * REQUANT_CHUNK
  todo = jnp.full((n_pad,), P, jnp.int32).at[jnp.where(first, jnp.cumsum(first) - 1, n_pad)].set(
      sorted_pages.astype(jnp.int32), mode="drop")
  # Old scales of those pages (after the offset-0 reset, before growth):
  old_scales = kv_scales_PK.at[jnp.where(fresh_T, page_T, P)].set(0.0, mode="drop")

  def requant(i, pages):
    idx = lax.dynamic_slice(todo, (i * REQUANT_CHUNK,), (REQUANT_CHUNK,))
    ok = idx < P
    safe = jnp.where(ok, idx, 0)
    data = pages[safe].astype(jnp.float32)  # [C, G, 2K, H]
    ratio = old_scales[safe] / jnp.where(ok[:, None], scales[safe], 1.0)
    ratio = jnp.where(scales[safe] > 0, ratio, 0.0)
    fmax = common.fp8_max(dtype)
    redone = jnp.clip(data * ratio[:, None, :, None], -fmax, fmax).astype(dtype)
    return pages.at[jnp.where(ok, idx, P)].set(redone, mode="drop")

  n_chunks = (count + REQUANT_CHUNK - 1) // REQUANT_CHUNK
  pages = lax.fori_loop(0, n_chunks, requant, kv_pages_PGKH)

  q_T2KH = quantize(new_T2KH.astype(jnp.float32), new_of_T[:, :, None], dtype)
  flat = pages.reshape(P * G, 2 * K, H).at[slot_T].set(q_T2KH, mode="drop")
  return flat.reshape(P, G, 2 * K, H), scales


write_kv_donated = jax.jit(write_kv, donate_argnums=(0, 1))
