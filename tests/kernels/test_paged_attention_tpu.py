"""Mosaic TPU paged attention kernels: run by the TPU interpreter on CPU against the jnp reference, and exported
for the tpu platform (jax.export), so lowering-rule failures show up without a TPU.

The TPU interpreter is slow (seconds per call), so shapes are small; it allocates outputs NaN-filled
(InterpretParams(uninitialized_memory="nan")), so unwritten rows fail max_err.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels.paged_attention import common, tpu
from test_paged_attention_oracle import (fresh_rng, max_err, poison_unread_pages, random_decode, random_pool,
                                         random_ragged)

TOL = 2e-2


@pytest.mark.parametrize("dtype,G,kw", [
    (jnp.bfloat16, 128, dict(sliding_window=150)),
    (jnp.float8_e4m3fn, 64, dict(soft_cap=3.0)),
])
def test_tpu_decode_matches_reference(dtype, G, kw):
  rng, seed = fresh_rng()
  q, kv, bt, lens, sc = random_decode(rng, S=3, K=1, g=4, H=128, G=G, Pmax=512 // G, dtype=dtype)
  out = tpu.paged_decode_attention_tpu(q, kv, bt, lens, kv_scales_PK=sc, interpret=True, **kw)
  ref = pa.paged_decode_attention_reference(q, kv, bt, lens, kv_scales_PK=sc, **kw)
  assert max_err(out, ref) < TOL, f"seed {seed}"


def test_tpu_ragged_matches_reference():
  rng, seed = fresh_rng()
  q, kv, bt, lens, cu, sc = random_ragged(rng, q_lens=[21, 0, 1], extra=[60, 0, 200], K=2, g=2, H=128, G=128,
                                          Pmax=3, dtype=jnp.float8_e5m2)
  out = tpu.paged_attention_tpu(q, kv, bt, lens, cu, kv_scales_PK=sc, sliding_window=40, interpret=True)
  ref = pa.paged_attention_reference(q, kv, bt, lens, cu, kv_scales_PK=sc, sliding_window=40)
  assert max_err(out, ref) < TOL, f"seed {seed}"


def test_tpu_sparse_decode_matches_reference_on_its_selection():
  rng, seed = fresh_rng()
  q, kv, bt, lens, _ = random_decode(rng, S=2, K=2, g=2, H=128, G=32, Pmax=12, lens=[380, 90])
  kmin = jnp.asarray(rng.standard_normal((kv.shape[0], 2, 128)), jnp.float32)
  kmax = kmin + 0.5
  out, (_, logical, count) = pa.paged_sparse_decode_attention(
      q, kv, bt, lens, kmin, kmax, num_sink_pages=1, num_window_pages=1, top_k_pages=2, impl="tpu_interpret",
      return_selection=True)
  assert np.asarray(count).tolist() == [[4, 4], [3, 3]]  # 90 tokens = 3 pages <= the budget of 4
  ref = pa.sparse_decode_attention_reference(q, kv, bt, lens, logical)
  assert max_err(out, ref) < TOL, f"seed {seed}"


def _export_tpu(f, *args):
  return jax.export.export(jax.jit(f), platforms=["tpu"])(*args)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_tpu_kernels_export_for_tpu(dtype):
  S, K, g, H, G, Pmax, P = 4, 8, 4, 128, 16, 256, 2048
  sd = jax.ShapeDtypeStruct
  q, kv = sd((S, K * g, H), jnp.bfloat16), sd((P, G, 2 * K, H), dtype)
  bt, lens = sd((S, Pmax), jnp.int32), sd((S,), jnp.int32)
  sc = None if dtype == jnp.bfloat16 else sd((P, 2 * K), jnp.float32)
  exp = _export_tpu(lambda q, kv, bt, lens, sc: tpu.paged_decode_attention_tpu(q, kv, bt, lens, kv_scales_PK=sc,
                                                                               sliding_window=1000),
                    q, kv, bt, lens, sc)
  assert "tpu_custom_call" in exp.mlir_module()
  qT, cu = sd((200, K * g, H), jnp.bfloat16), sd((S + 1,), jnp.int32)
  _export_tpu(lambda *a: tpu.paged_attention_tpu(*a[:5], kv_scales_PK=a[5]), qT, kv, bt, lens, cu, sc)
  U = 16
  phys, cnt = sd((S, K, U), jnp.int32), sd((S, K), jnp.int32)
  _export_tpu(lambda q, kv, p, lens, sc, c, l: tpu.decode_core(q, kv, p, lens, sc, c, l),
              q, kv, phys, lens, sc, cnt, phys)


def test_tpu_kernel_refuses_shapes_it_cannot_run():
  rng, _ = fresh_rng()
  q, kv, bt, lens, _ = random_decode(rng, S=2, K=2, g=2, H=64, G=16, Pmax=2)
  with pytest.raises(common.Unsupported, match="head dim"):
    tpu.paged_decode_attention_tpu(q, kv, bt, lens, interpret=True)


# ---------------------------------------------------------------- wide block tables and padding slots
WIDE = 64  # table entries per sequence; real lengths stay <= 3 pages


def _poison_unread(kv, sc, bt, lens, G):
  """The TPU kernel's block is max(G, 256) tokens (G <= 256 here)."""
  return poison_unread_pages(kv, sc, bt, lens, G, block=256)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_tpu_decode_wide_table_padding_slots_read_nothing(dtype):
  """Page ids come on demand from the HBM table (no [S, Pmax] SMEM copy), scales per page by DMA: padding slots
  and pages past each length are never read (they are NaN here)."""
  rng, seed = fresh_rng()
  q, kv, bt, _, sc = random_decode(rng, S=4, K=1, g=4, H=128, G=16, Pmax=WIDE, dtype=dtype)
  lens = jnp.asarray([0, 48, 0, 300], jnp.int32)  # 300 tokens: two 256-token blocks (the id ring turns over)
  kv_bad, sc_bad = _poison_unread(kv, sc, bt, lens, 16)
  out = tpu.paged_decode_attention_tpu(q, kv_bad, bt, lens, kv_scales_PK=sc_bad, interpret=True)
  ref = pa.paged_decode_attention_reference(q, kv, bt, lens, kv_scales_PK=sc)
  assert max_err(out, ref) < TOL, f"seed {seed}"
  assert np.all(np.asarray(out, np.float32)[[0, 2]] == 0)


def test_tpu_ragged_wide_table_with_decode_rows_at_kv_len_zero():
  """A mixed step's ragged call: prefill chunks sharing a q tile, q_len-1 rows at kv_len 0 (exactly 0), padding."""
  rng, seed = fresh_rng()
  q_lens, kv_lens = [1, 20, 1, 0, 9], [0, 20 + 17, 0, 0, 9 + 300]
  S, G = len(q_lens), 16
  P = S * WIDE + 3
  kv, sc = random_pool(rng, P, G, 2, 128, jnp.float8_e5m2)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  q = jnp.asarray(rng.standard_normal((int(cu[-1]) + 4, 4, 128)), jnp.bfloat16)
  bt = jnp.asarray(rng.permutation(P)[: S * WIDE].reshape(S, WIDE), jnp.int32)
  lens = jnp.asarray(kv_lens, jnp.int32)
  kv_bad, sc_bad = _poison_unread(kv, sc, bt, lens, G)
  out = tpu.paged_attention_tpu(q, kv_bad, bt, lens, cu, kv_scales_PK=sc_bad, interpret=True)
  ref = pa.paged_attention_reference(q, kv, bt, lens, cu, kv_scales_PK=sc)
  assert max_err(out, ref) < TOL, f"seed {seed}"
  out = np.asarray(out, np.float32)
  assert np.all(out[[0, 21]] == 0) and np.all(out[int(cu[-1]):] == 0)


def test_tpu_kernels_export_with_a_wide_table():
  """64 slots x 8192 pages (a 2 MiB table: more than a TPU's SMEM if it were prefetched) still export."""
  S, K, g, H, G, Pmax, P = 64, 8, 4, 128, 16, 8192, 16384
  sd = jax.ShapeDtypeStruct
  q, kv = sd((S, K * g, H), jnp.bfloat16), sd((P, G, 2 * K, H), jnp.float8_e4m3fn)
  bt, lens, sc = sd((S, Pmax), jnp.int32), sd((S,), jnp.int32), sd((P, 2 * K), jnp.float32)
  exp = _export_tpu(lambda q, kv, bt, lens, sc: tpu.paged_decode_attention_tpu(q, kv, bt, lens, kv_scales_PK=sc),
                    q, kv, bt, lens, sc)
  assert "tpu_custom_call" in exp.mlir_module()
  qT, cu = sd((256, K * g, H), jnp.bfloat16), sd((S + 1,), jnp.int32)
  _export_tpu(lambda *a: tpu.paged_attention_tpu(*a[:5], kv_scales_PK=a[5]), qT, kv, bt, lens, cu, sc)
