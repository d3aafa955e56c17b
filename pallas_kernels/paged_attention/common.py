"""Shared shape/dtype checks and small helpers for the paged attention kernels.

Every entry point (reference, Mosaic GPU, Mosaic TPU, dispatcher) validates its inputs here so that bad
input fails the same way everywhere: a ValueError/TypeError that names the argument and the problem.
The KV pool layout is `kv_pages_PGKH` = [P pages, G tokens per page, 2K, H] with K and V of kv head k
interleaved at [:, :, 2k] and [:, :, 2k + 1]; fp8 pools carry `kv_scales_PK` = f32 [P, 2K]
(real value = stored.astype(f32) * scale).
"""
from __future__ import annotations

import math

import jax.numpy as jnp

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
POOL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)) + FP8_DTYPES
Q_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


class Unsupported(ValueError):
  """A kernel cannot handle this shape/dtype; the dispatcher falls back to the reference (with a warning)."""


def is_fp8(dtype) -> bool:
  return jnp.dtype(dtype) in FP8_DTYPES


def fp8_max(dtype) -> float:
  """Largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
  return float(jnp.finfo(jnp.dtype(dtype)).max)


def default_scale(head_dim: int, scale: float | None) -> float:
  return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _need_int32(name, x, ndim):
  if jnp.ndim(x) != ndim:
    raise ValueError(f"{name} must have {ndim} dims, got shape {jnp.shape(x)}")
  if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
    raise TypeError(f"{name} must be int32, got {x.dtype}")


def check_pool(kv_pages_PGKH, kv_scales_PK):
  """Validates the pool and its scales; returns (P, G, K, H)."""
  if jnp.ndim(kv_pages_PGKH) != 4:
    raise ValueError(f"kv_pages_PGKH must be [P, G, 2K, H], got shape {jnp.shape(kv_pages_PGKH)}")
  P, G, K2, H = kv_pages_PGKH.shape
  if K2 % 2:
    raise ValueError(f"kv_pages_PGKH axis 2 holds K and V interleaved and must be even, got {K2}")
  if jnp.dtype(kv_pages_PGKH.dtype) not in POOL_DTYPES:
    raise TypeError(f"kv_pages_PGKH dtype must be one of {[str(d) for d in POOL_DTYPES]}, got {kv_pages_PGKH.dtype}")
  if is_fp8(kv_pages_PGKH.dtype):
    if kv_scales_PK is None:
      raise ValueError(f"kv_scales_PK is required for an fp8 pool ({kv_pages_PGKH.dtype})")
    if tuple(kv_scales_PK.shape) != (P, K2):
      raise ValueError(f"kv_scales_PK must have shape (P, 2K)=({P}, {K2}), got {tuple(kv_scales_PK.shape)}")
    if jnp.dtype(kv_scales_PK.dtype) != jnp.dtype(jnp.float32):
      raise TypeError(f"kv_scales_PK must be float32, got {kv_scales_PK.dtype}")
  elif kv_scales_PK is not None:
    raise ValueError(f"kv_scales_PK must be None for a {kv_pages_PGKH.dtype} pool")
  return P, G, K2 // 2, H


def check_common(q_xNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kv_scales_PK, *, soft_cap, sliding_window,
                 q_name="q"):
  """Checks shared by decode and ragged entry points; returns (S, N, K, group, P, G, H)."""
  P, G, K, H = check_pool(kv_pages_PGKH, kv_scales_PK)
  if jnp.ndim(q_xNH) != 3:
    raise ValueError(f"{q_name} must have 3 dims [rows, N, H], got shape {jnp.shape(q_xNH)}")
  if jnp.dtype(q_xNH.dtype) not in Q_DTYPES:
    raise TypeError(f"{q_name} dtype must be bfloat16, float16 or float32, got {q_xNH.dtype}")
  _, N, Hq = q_xNH.shape
  if Hq != H:
    raise ValueError(f"{q_name} head dim {Hq} != kv_pages head dim {H}")
  if N % K:
    raise ValueError(f"number of query heads N={N} must be a multiple of kv heads K={K}")
  _need_int32("block_tables_SP", block_tables_SP, 2)
  _need_int32("kv_lens_S", kv_lens_S, 1)
  S = block_tables_SP.shape[0]
  if kv_lens_S.shape[0] != S:
    raise ValueError(f"kv_lens_S has {kv_lens_S.shape[0]} entries but block_tables_SP has {S} rows")
  if soft_cap is not None and not (float(soft_cap) > 0):
    raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")
  if sliding_window is not None and (int(sliding_window) != sliding_window or int(sliding_window) < 1):
    raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
  return S, N, K, N // K, P, G, H


def check_ragged(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, kv_scales_PK, *, soft_cap,
                 sliding_window):
  dims = check_common(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kv_scales_PK, soft_cap=soft_cap,
                      sliding_window=sliding_window, q_name="q_TNH")
  _need_int32("cu_q_lens_S1", cu_q_lens_S1, 1)
  if cu_q_lens_S1.shape[0] != dims[0] + 1:
    raise ValueError(f"cu_q_lens_S1 must have S+1={dims[0] + 1} entries, got {cu_q_lens_S1.shape[0]}")
  return dims


def check_decode(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kv_scales_PK, *, soft_cap, sliding_window):
  dims = check_common(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kv_scales_PK, soft_cap=soft_cap,
                      sliding_window=sliding_window, q_name="q_SNH")
  if q_SNH.shape[0] != dims[0]:
    raise ValueError(f"q_SNH has {q_SNH.shape[0]} rows but there are S={dims[0]} sequences (one query each)")
  return dims


def cdiv(a, b):
  return -(-a // b)
