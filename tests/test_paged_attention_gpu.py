"""Mosaic GPU paged attention kernels: run by the GPU interpreter on CPU against the jnp reference, and lowered
for cuda (so a kernel that only works in the interpreter fails here).

The interpreter allocates kernel outputs NaN-filled (InterpretGPUParams(uninitialized_memory="nan")), so an
output row the kernel forgets to write shows up as NaN, which max_err rejects.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels.paged_attention import common, gpu, gpu_fp8, sparse
from test_paged_attention_oracle import fresh_rng, max_err, random_decode, random_ragged

TOL = 2e-2  # bf16 probabilities in the PV matmul and a bf16 output


@pytest.mark.parametrize("shape,kw", [
    # page 16, GQA 4, forced split-K (combine path), an empty and a full sequence
    (dict(S=4, K=2, g=4, H=64, G=16, Pmax=9), dict(splits=3)),
    # GQA 8 at H=128, sliding window + soft cap, single split (normalized in-kernel)
    (dict(S=3, K=2, g=8, H=128, G=16, Pmax=10), dict(sliding_window=45, soft_cap=3.0, splits=1)),
    # pages larger than a step (a page is read in two 128-token slices); N=9 heads (padded to 16 rows)
    (dict(S=3, K=3, g=3, H=64, G=256, Pmax=2), {}),
    # MHA-like group of 1 and 72 heads (> 64 rows: the row window moves with the kv head), page 8
    (dict(S=2, K=12, g=6, H=64, G=8, Pmax=20), {}),
])
def test_gpu_decode_matches_reference(shape, kw):
  rng, seed = fresh_rng()
  q, kv, bt, lens, _ = random_decode(rng, **shape)
  out = gpu.paged_decode_attention_gpu(q, kv, bt, lens, interpret=True, **kw)
  kw.pop("splits", None)
  ref = pa.paged_decode_attention_reference(q, kv, bt, lens, **kw)
  assert max_err(out, ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("dtype,G", [(jnp.float8_e4m3fn, 16), (jnp.float8_e5m2, 128)])
def test_gpu_decode_fp8_matches_fp8_aware_reference(dtype, G):
  rng, seed = fresh_rng()
  q, kv, bt, lens, sc = random_decode(rng, S=3, K=2, g=4, H=64, G=G, Pmax=max(2, 192 // G), dtype=dtype)
  out = gpu.paged_decode_attention_gpu(q, kv, bt, lens, kv_scales_PK=sc, splits=2, interpret=True)
  ref = pa.paged_decode_attention_reference(q, kv, bt, lens, kv_scales_PK=sc)
  assert max_err(out, ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("converters,dtype,G,kw", [
    # one converter (2 staging slots it alternates), forced split-K
    (1, jnp.float8_e4m3fn, 16, dict(splits=2)),
    # two converters, wave-aware split policy, window + soft cap
    (2, jnp.float8_e4m3fn, 16, dict(split_policy="waves", sliding_window=150, soft_cap=5.0)),
    # three converters (register rebalancing), e5m2, pages of 32 (two pages per 64-token step), single split
    (3, jnp.float8_e5m2, 32, dict(splits=1)),
    # two compute warpgroups on alternate steps (each writes one split-K partial), window
    (1, jnp.float8_e4m3fn, 16, dict(fp8_compute_wgs=2, splits=2, sliding_window=170)),
    (1, jnp.float8_e5m2, 32, dict(fp8_compute_wgs=2, splits=1, soft_cap=5.0)),
])
def test_gpu_fp8_warp_specialized_matches_fp8_aware_reference(monkeypatch, converters, dtype, G, kw):
  """The converter/compute warpgroup kernel (gpu_fp8.py), run with the interpreter's race detector on."""
  monkeypatch.setattr(gpu_fp8, "DETECT_RACES", True)
  rng, seed = fresh_rng()
  q, kv, bt, lens, sc = random_decode(rng, S=3, K=2, g=4, H=64, G=G, Pmax=max(2, 320 // G), dtype=dtype)
  out = gpu.paged_decode_attention_gpu(q, kv, bt, lens, kv_scales_PK=sc, interpret=True, fp8_converters=converters,
                                       **kw)
  for key in ("splits", "split_policy", "fp8_compute_wgs"):
    kw.pop(key, None)
  ref = pa.paged_decode_attention_reference(q, kv, bt, lens, kv_scales_PK=sc, **kw)
  assert max_err(out, ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("converters,dtype,G,kw", [
    # one warpgroup: fp8 QK^T wgmma straight from the TMA ring, V widened while it runs; window + soft cap, split-K
    (0, jnp.float8_e4m3fn, 16, dict(splits=2, sliding_window=150, soft_cap=5.0)),
    # warp-specialized, 1 converter widening V only; a ring slot is refilled after its QK (the kread barriers)
    (1, jnp.float8_e5m2, 32, dict(splits=1)),
    # two compute warpgroups sharing the kread / ready / free protocol
    (1, jnp.float8_e4m3fn, 16, dict(fp8_compute_wgs=2, splits=2)),
])
def test_gpu_fp8_qk_matches_reference_at_quantized_q(monkeypatch, converters, dtype, G, kw):
  """fp8_qk=True quantizes q per row to e4m3 (gpu.quantize_q_rows): the kernel must equal the fp8-aware reference
  evaluated at that quantized q (to the usual f16/bf16 tolerance), so its distance from the reference at the
  original q is the q rounding's own effect (bounded by |ref(q8) - ref(q)|) plus that tolerance."""
  monkeypatch.setattr(gpu_fp8, "DETECT_RACES", converters > 0)
  rng, seed = fresh_rng()
  q, kv, bt, lens, sc = random_decode(rng, S=3, K=2, g=4, H=64, G=G, Pmax=max(2, 256 // G), dtype=dtype)
  out = gpu.paged_decode_attention_gpu(q, kv, bt, lens, kv_scales_PK=sc, interpret=True, fp8_converters=converters,
                                       fp8_qk=True, **kw)
  for key in ("splits", "fp8_compute_wgs"):
    kw.pop(key, None)
  q8, s_q = gpu.quantize_q_rows(q)
  ref_q8 = pa.paged_decode_attention_reference(q8.astype(jnp.float32) * s_q[..., None], kv, bt, lens,
                                               kv_scales_PK=sc, **kw)
  ref = pa.paged_decode_attention_reference(q, kv, bt, lens, kv_scales_PK=sc, **kw)
  assert max_err(out, ref_q8) < TOL, f"seed {seed}"
  assert max_err(out, ref) <= max_err(ref_q8, ref) + TOL, f"seed {seed}"


def test_quantize_q_rows_is_e4m3_rounding():
  """q ~= q8 * s with s = max|row| / 448: each element within half an e4m3 step (2^-4 relative for normals,
  2^-10 * s absolute for subnormals), the row maximum exact, all-zero rows kept at zero."""
  rng, seed = fresh_rng()
  q = rng.standard_normal((3, 5, 64)) * rng.uniform(0.01, 100, (3, 5, 1))
  q[1, 2] = 0.0
  q = jnp.asarray(q, jnp.float32)
  q8, s = gpu.quantize_q_rows(q)
  assert q8.dtype == jnp.float8_e4m3fn and s.shape == (3, 5)
  deq = np.asarray(q8.astype(jnp.float32), np.float64) * np.asarray(s, np.float64)[..., None]
  qn = np.asarray(q, np.float64)
  bound = np.maximum(np.abs(qn) * 2.0 ** -4, np.asarray(s, np.float64)[..., None] * 2.0 ** -10) * (1 + 1e-6)
  assert np.all(np.abs(deq - qn) <= bound), f"seed {seed}"
  np.testing.assert_allclose(np.max(np.abs(deq), -1), np.max(np.abs(qn), -1), rtol=1e-6)
  assert np.all(deq[1, 2] == 0)


def test_gpu_fp8_warp_specialized_refuses_bad_stage_count():
  rng, _ = fresh_rng()
  q, kv, bt, lens, sc = random_decode(rng, S=2, K=2, g=2, H=64, G=16, Pmax=8, dtype=jnp.float8_e4m3fn)
  with pytest.raises(common.Unsupported, match="multiple of converters"):
    gpu.paged_decode_attention_gpu(q, kv, bt, lens, kv_scales_PK=sc, interpret=True, fp8_converters=2, stages=3)
  with pytest.raises(common.Unsupported, match="compute_wgs=2 with converters=2"):
    gpu.paged_decode_attention_gpu(q, kv, bt, lens, kv_scales_PK=sc, interpret=True, fp8_converters=2,
                                   fp8_compute_wgs=2)
  with pytest.raises(common.Unsupported, match="fp8_qk with compute_wgs=2"):
    gpu.paged_decode_attention_gpu(q, kv, bt, lens, kv_scales_PK=sc, interpret=True, fp8_converters=1,
                                   fp8_compute_wgs=2, fp8_qk=True, stages=3)


def test_wave_split_policy_fills_whole_waves():
  """132 SMs, one CTA each: 64 (seq, kv head) pairs x 128 blocks -> 2 splits (one wave of 128 programs);
  the older policy picks 5 (320 programs = 2.4 waves)."""
  smem = 150 * 1024
  assert gpu.choose_splits(64, 128, "waves", smem) == 2
  assert gpu.choose_splits(64, 128, "sms2", smem) == 5
  assert gpu.choose_splits(1024, 8, "waves", smem) == 1  # more work than slots: no split
  with pytest.raises(ValueError, match="split_policy"):
    gpu.choose_splits(8, 8, "bogus", smem)


@pytest.mark.parametrize("dtype,g,kw", [
    (jnp.bfloat16, 4, dict(sliding_window=23)),
    (jnp.float8_e4m3fn, 8, dict(soft_cap=4.0)),
    # SmolLM2's group of 3: 21 tokens x 3 heads = 63 rows of a 64-row tile (one zero row)
    (jnp.bfloat16, 3, {}),
])
def test_gpu_ragged_matches_reference(dtype, g, kw):
  rng, seed = fresh_rng()
  q, kv, bt, lens, cu, sc = random_ragged(rng, q_lens=[19, 0, 1, 40], extra=[70, 0, 150, 3], K=2, g=g, H=64, G=16,
                                          Pmax=12, dtype=dtype)
  out = gpu.paged_attention_gpu(q, kv, bt, lens, cu, kv_scales_PK=sc, interpret=True, **kw)
  ref = pa.paged_attention_reference(q, kv, bt, lens, cu, kv_scales_PK=sc, **kw)
  assert max_err(out, ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("converters", [0, 2])
def test_gpu_sparse_decode_matches_reference_on_its_selection(monkeypatch, converters):
  monkeypatch.setattr(gpu, "FP8_CONVERTERS", converters)  # sparse follows the module default
  rng, seed = fresh_rng()
  q, kv, bt, lens, sc = random_decode(rng, S=2, K=2, g=4, H=64, G=16, Pmax=14, dtype=jnp.float8_e4m3fn,
                                      lens=[220, 100])
  kmin = jnp.asarray(rng.standard_normal((kv.shape[0], 2, 64)), jnp.float32)
  kmax = kmin + jnp.asarray(rng.uniform(0, 1, kmin.shape), jnp.float32)
  out, (_, logical, count) = pa.paged_sparse_decode_attention(
      q, kv, bt, lens, kmin, kmax, num_sink_pages=1, num_window_pages=1, top_k_pages=3, kv_scales_PK=sc,
      impl="gpu_interpret", return_selection=True)
  assert np.all(np.asarray(count) == 5)
  ref = pa.sparse_decode_attention_reference(q, kv, bt, lens, logical, kv_scales_PK=sc)
  assert max_err(out, ref) < TOL, f"seed {seed}"


def _lower_cuda(f, *args):
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_gpu_kernels_lower_for_cuda(dtype):
  """Decode (split and unsplit), ragged and sparse kernels at production-like shapes lower through Mosaic GPU."""
  S, K, g, H, G, Pmax, P = 4, 8, 4, 128, 16, 512, 4096
  sd = jax.ShapeDtypeStruct
  q = sd((S, K * g, H), jnp.bfloat16)
  kv = sd((P, G, 2 * K, H), dtype)
  bt, lens = sd((S, Pmax), jnp.int32), sd((S,), jnp.int32)
  sc = None if dtype == jnp.bfloat16 else jnp.ones((P, 2 * K), jnp.float32)
  for splits in (1, 8):
    txt = _lower_cuda(lambda q, kv, bt, lens: gpu.paged_decode_attention_gpu(q, kv, bt, lens, kv_scales_PK=sc,
                                                                           splits=splits), q, kv, bt, lens).as_text()
    assert "mosaic_gpu" in txt
  if dtype != jnp.bfloat16:  # the warp-specialized fp8 kernel (1-3 converter warpgroups)
    for conv, splits, cw, qk8 in ((1, 8, 1, False), (2, 1, 1, False), (3, 8, 1, False), (1, 1, 2, False),
                                  (1, 8, 2, False), (0, 8, 1, True), (1, 8, 1, True),
                                  (2, 1, 1, True), (1, 8, 2, True)):
      txt = _lower_cuda(lambda q, kv, bt, lens: gpu.paged_decode_attention_gpu(
          q, kv, bt, lens, kv_scales_PK=sc, splits=splits, fp8_converters=conv, fp8_compute_wgs=cw, fp8_qk=qk8),
          q, kv, bt, lens).as_text()
      assert "mosaic_gpu" in txt
  qT, cu = sd((300, K * g, H), jnp.bfloat16), sd((S + 1,), jnp.int32)
  _lower_cuda(lambda *a: gpu.paged_attention_gpu(*a, kv_scales_PK=sc, sliding_window=512), qT, kv, bt, lens, cu)
  B = 20
  phys, cnt = sd((S, K, B), jnp.int32), sd((S, K), jnp.int32)
  _lower_cuda(lambda q, kv, p, l, c, lens: sparse._sparse_gpu(q, kv, p, l, c, lens, scale=None, soft_cap=None,
                                                              kv_scales_PK=sc, interpret=False),
              q, kv, phys, phys, cnt, lens)


@pytest.mark.parametrize("dtype,H,G,why", [
    (jnp.float32, 64, 16, "float32 pools"),
    (jnp.bfloat16, 96, 16, "head dim"),
    (jnp.bfloat16, 64, 12, "page size"),
])
def test_gpu_kernel_refuses_shapes_it_cannot_run(dtype, H, G, why):
  rng, _ = fresh_rng()
  q, kv, bt, lens, _ = random_decode(rng, S=2, K=2, g=2, H=H, G=G, Pmax=2, dtype=dtype)
  with pytest.raises(common.Unsupported, match=why):
    gpu.paged_decode_attention_gpu(q, kv, bt, lens, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_bit_widening_is_exact_for_every_byte(dtype):
  """The integer-op widening (fp8_convert="bits") against JAX's own fp8 -> f32 conversion, for all 256 bytes in
  every position of a 32-bit word, including the head-dim permutation the kernel's f16 tiles use.
  (The interpreter cannot run the bits kernel: it does not alias RefUnion views.)"""
  H = 128
  bytes_ = np.stack([np.roll(np.arange(256, dtype=np.uint8), r) for r in range(H)], axis=1)[:, :H]  # [256, H]
  vals = np.asarray(jnp.asarray(bytes_.view(jnp.dtype(dtype)), jnp.float32), np.float64)
  finite = np.isfinite(vals)
  words = jnp.asarray(bytes_.view(np.uint32))  # [256, H / 4]
  lo, hi = gpu_fp8.widen_words(words, jnp.dtype(dtype).name)
  f16 = np.concatenate([np.asarray(lo), np.asarray(hi)], axis=1).view(np.float16).astype(np.float64)
  factor = gpu_fp8.E4M3_BITS_FACTOR if dtype == jnp.float8_e4m3fn else 1.0
  perm = gpu_fp8.widen_permutation(H)
  np.testing.assert_array_equal((f16 * factor)[finite[:, perm]], vals[:, perm][finite[:, perm]])
  assert sorted(perm.tolist()) == list(range(H))


def test_fp8_decode_default_kernel_choice():
  """fp8 decode runs the warp-specialized kernel by default (1 converter, 128-token steps), except where its f16
  staging cannot fit in shared memory (head dim 256): there the inline-conversion kernel runs, not the
  reference fallback. bf16 decode: 64-token steps x 2 stages; ragged prefill keeps 128 x 2."""
  kw = dict(scale=1.0, soft_cap=None, sliding_window=None, out_dtype="bfloat16")
  c128 = gpu.make_config((8, 32, 128), (4096, 16, 16, 128), jnp.float8_e4m3fn, 512, **kw)
  assert (c128.converters, c128.BK, c128.stages) == (1, 128, 2)
  c256 = gpu.make_config((8, 32, 256), (4096, 16, 16, 256), jnp.float8_e4m3fn, 512, **kw)
  assert c256.converters == 0
  b = gpu.make_config((8, 32, 128), (4096, 16, 16, 128), jnp.bfloat16, 512, **kw)
  assert (b.converters, b.BK, b.stages) == (0, 64, 2)
  r = gpu.make_config((8, 32, 128), (4096, 16, 16, 128), jnp.bfloat16, 512, ragged_tiles=10, **kw)
  assert (r.BK, r.stages, r.splits) == (128, 2, 1)
