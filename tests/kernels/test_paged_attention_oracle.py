"""Independent float64 numpy oracle and random-problem builders for the paged attention tests.

The oracle is written from the semantics in pallas_kernels/paged_attention/reference.py's docstring with
plain loops (no code shared with the package), so the jnp reference can be checked against it and the
kernels against the reference.
"""
from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np


def fresh_rng():
  """A generator with a fresh seed each run; the seed goes into assertion messages."""
  seed = int.from_bytes(os.urandom(4), "little")
  return np.random.default_rng(seed), seed


def oracle_ragged(q_TNH, kv_PGKH, bt_SP, lens_S, cu_S1, *, scale=None, soft_cap=None, window=None, scales_PK=None,
                  logical_pages_SKU=None):
  """float64 paged attention by loops. logical_pages_SKU (decode-only sparse): kv head k of sequence s only
  sees the listed logical pages."""
  q = np.asarray(jnp.asarray(q_TNH, jnp.float32), np.float64)
  kv = np.asarray(jnp.asarray(kv_PGKH, jnp.float32), np.float64)
  if scales_PK is not None:
    kv = kv * np.asarray(scales_PK, np.float64)[:, None, :, None]
  bt, lens, cu = np.asarray(bt_SP), np.asarray(lens_S), np.asarray(cu_S1)
  T, N, H = q.shape
  G, K = kv.shape[1], kv.shape[2] // 2
  g = N // K
  scale = 1.0 / np.sqrt(H) if scale is None else scale
  out = np.zeros((T, N, H))
  for s in range(len(lens)):
    q_len = cu[s + 1] - cu[s]
    for i in range(q_len):
      t = cu[s] + i
      pos = lens[s] - q_len + i
      for n in range(N):
        k = n // g
        js = [j for j in range(lens[s]) if j <= pos and (window is None or j > pos - window)]
        if logical_pages_SKU is not None:
          allowed = set(int(x) for x in np.asarray(logical_pages_SKU)[s, k])
          js = [j for j in js if j // G in allowed]
        if not js:
          continue
        keys = np.stack([kv[bt[s, j // G], j % G, 2 * k] for j in js])
        vals = np.stack([kv[bt[s, j // G], j % G, 2 * k + 1] for j in js])
        logits = keys @ q[t, n] * scale
        if soft_cap is not None:
          logits = soft_cap * np.tanh(logits / soft_cap)
        p = np.exp(logits - logits.max())
        out[t, n] = p @ vals / p.sum()
  return out


def oracle_decode(q_SNH, kv_PGKH, bt_SP, lens_S, **kw):
  S = np.asarray(lens_S).shape[0]
  cu = np.arange(S + 1, dtype=np.int32)
  lens = np.asarray(lens_S)
  # sequences with kv_len 0 have no query position: give them q_len 0
  cu = np.concatenate([[0], np.cumsum(lens > 0)]).astype(np.int32)
  q = np.asarray(jnp.asarray(q_SNH, jnp.float32))[lens > 0]
  out = oracle_ragged(q, kv_PGKH, bt_SP, lens_S, cu, **kw)
  full = np.zeros((S,) + out.shape[1:])
  full[lens > 0] = out
  return full


def random_pool(rng, P, G, K, H, dtype):
  """Pool filled with random values everywhere (also in slots past any kv_len), fp8 with random scales."""
  x = rng.standard_normal((P, G, 2 * K, H)).astype(np.float32)
  if jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
    scales = rng.uniform(0.02, 0.2, (P, 2 * K)).astype(np.float32)
    return jnp.asarray(x / scales[:, None, :, None] / 3).astype(dtype), jnp.asarray(scales)
  return jnp.asarray(x, dtype), None


def random_decode(rng, *, S, K, g, H, G, Pmax, dtype=jnp.bfloat16, lens=None, extra_pages=3):
  P = S * Pmax + extra_pages
  kv, sc = random_pool(rng, P, G, K, H, dtype)
  q = jnp.asarray(rng.standard_normal((S, K * g, H)), jnp.bfloat16)
  bt = jnp.asarray(rng.permutation(P)[: S * Pmax].reshape(S, Pmax), jnp.int32)
  if lens is None:
    lens = rng.integers(0, Pmax * G + 1, S)
    lens[0] = 0  # an empty (padding) sequence
    if S > 2:
      lens[1] = Pmax * G  # a full one
  return q, kv, bt, jnp.asarray(lens, jnp.int32), sc


def random_ragged(rng, *, q_lens, extra, K, g, H, G, Pmax, dtype=jnp.bfloat16, pad_rows=5):
  S = len(q_lens)
  P = S * Pmax + 3
  kv, sc = random_pool(rng, P, G, K, H, dtype)
  lens = np.minimum(np.asarray(q_lens) + np.asarray(extra), Pmax * G)
  q_lens = np.minimum(q_lens, lens)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  T = int(cu[-1]) + pad_rows
  q = jnp.asarray(rng.standard_normal((T, K * g, H)), jnp.bfloat16)
  bt = jnp.asarray(rng.permutation(P)[: S * Pmax].reshape(S, Pmax), jnp.int32)
  return q, kv, bt, jnp.asarray(lens, jnp.int32), jnp.asarray(cu), sc


def poison_unread_pages(kv, sc, bt, lens, G, block):
  """(kv, sc) with NaN in every page no kernel may read: table entries at or past the `block`-token boundary after
  each sequence's kv_len (all entries of a kv_len-0 row). Reading one would reach the PV product (0 * NaN = NaN)."""
  bt, lens = np.asarray(bt), np.asarray(lens)
  need = -(-np.maximum(lens, 0) // block) * block // G  # table entries a kernel may touch
  dead = np.concatenate([bt[s, need[s]:] for s in range(bt.shape[0])])
  kv32 = np.asarray(jnp.asarray(kv, jnp.float32)).copy()
  kv32[dead] = np.nan
  out_sc = None
  if sc is not None:
    out_sc = np.asarray(sc).copy()
    out_sc[dead] = np.nan
    out_sc = jnp.asarray(out_sc)
  return jnp.asarray(kv32).astype(kv.dtype), out_sc


def max_err(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  assert a.shape == b.shape, (a.shape, b.shape)
  assert not np.isnan(a).any(), "NaN in output (unwritten rows are NaN-poisoned by the interpreters)"
  return float(np.max(np.abs(a - b))) if a.size else 0.0


# Self-checks of the oracle on cases with closed-form answers (so a bug in the oracle cannot hide).
def test_oracle_single_key_returns_its_value():
  rng, seed = fresh_rng()
  G, K, H = 4, 1, 8
  kv = rng.standard_normal((2, G, 2 * K, H)).astype(np.float32)
  q = rng.standard_normal((1, 2, H)).astype(np.float32)
  out = oracle_ragged(q, kv, np.array([[1, 0]]), np.array([1]), np.array([0, 1]))
  np.testing.assert_allclose(out[0, 0], kv[1, 0, 1], rtol=1e-12, atol=1e-12, err_msg=f"seed {seed}")
  np.testing.assert_allclose(out[0, 1], kv[1, 0, 1], rtol=1e-12, atol=1e-12, err_msg=f"seed {seed}")


def test_oracle_equal_keys_average_values_and_window_limits():
  rng, seed = fresh_rng()
  G, K, H = 2, 1, 4
  kv = rng.standard_normal((3, G, 2 * K, H)).astype(np.float32)
  kv[:, :, 0] = 1.0  # all keys equal -> uniform weights
  q = np.ones((1, 1, H), np.float32)
  bt = np.array([[2, 0, 1]])
  vals = np.stack([kv[bt[0, j // G], j % G, 1] for j in range(5)]).astype(np.float64)
  out = oracle_ragged(q, kv, bt, np.array([5]), np.array([0, 1]))
  np.testing.assert_allclose(out[0, 0], vals.mean(0), rtol=1e-12, atol=1e-12, err_msg=f"seed {seed}")
  out = oracle_ragged(q, kv, bt, np.array([5]), np.array([0, 1]), window=2)
  np.testing.assert_allclose(out[0, 0], vals[3:].mean(0), rtol=1e-12, atol=1e-12, err_msg=f"seed {seed}")
