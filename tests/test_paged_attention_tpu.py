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
from test_paged_attention_oracle import fresh_rng, max_err, random_decode, random_ragged

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
  B = 16
  phys, cnt = sd((S, K, B), jnp.int32), sd((S, K), jnp.int32)
  _export_tpu(lambda q, kv, p, lens, sc, c, l: tpu.decode_core(q, kv, p, lens, sc, c, l),
              q, kv, phys, lens, sc, cnt, phys)


def test_tpu_kernel_refuses_shapes_it_cannot_run():
  rng, _ = fresh_rng()
  q, kv, bt, lens, _ = random_decode(rng, S=2, K=2, g=2, H=64, G=16, Pmax=2)
  with pytest.raises(common.Unsupported, match="head dim"):
    tpu.paged_decode_attention_tpu(q, kv, bt, lens, interpret=True)
