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
from pallas_kernels.paged_attention import common, gpu, gpu_fp8, sparse, tuning
from test_paged_attention_oracle import (fresh_rng, max_err, poison_unread_pages, random_decode, random_pool,
                                         random_ragged)

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
def test_gpu_fp8_warp_specialized_matches_fp8_aware_reference(converters, dtype, G, kw):
  """The converter/compute warpgroup kernel (gpu_fp8.py), run with the interpreter's race detector on."""
  with tuning.override(detect_races=True):
    _warp_specialized_matches_reference(converters, dtype, G, kw)


def _warp_specialized_matches_reference(converters, dtype, G, kw):
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
def test_gpu_fp8_qk_matches_reference_at_quantized_q(converters, dtype, G, kw):
  """fp8_qk=True quantizes q per row to e4m3 (gpu.quantize_q_rows): the kernel must equal the fp8-aware reference
  evaluated at that quantized q (to the usual f16/bf16 tolerance), so its distance from the reference at the
  original q is the q rounding's own effect (bounded by |ref(q8) - ref(q)|) plus that tolerance."""
  rng, seed = fresh_rng()
  q, kv, bt, lens, sc = random_decode(rng, S=3, K=2, g=4, H=64, G=G, Pmax=max(2, 256 // G), dtype=dtype)
  with tuning.override(detect_races=converters > 0):
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
def test_gpu_sparse_decode_matches_reference_on_its_selection(converters):
  with tuning.override(fp8_converters=converters):  # sparse follows the tuning row
    _sparse_decode_matches_reference()


def _sparse_decode_matches_reference():
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


def _lowering_operands(dtype, S, *, Pmax, P, K=8, g=4, H=128, G=16):
  """(q, kv, bt, lens, kv scales) for a decode lowering: shapes only (ShapeDtypeStruct), scales for fp8 pools."""
  sd = jax.ShapeDtypeStruct
  q = sd((S, K * g, H), jnp.bfloat16)
  kv = sd((P, G, 2 * K, H), dtype)
  bt, lens = sd((S, Pmax), jnp.int32), sd((S,), jnp.int32)
  sc = None if dtype == jnp.bfloat16 else jnp.ones((P, 2 * K), jnp.float32)
  return q, kv, bt, lens, sc


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_gpu_kernels_lower_for_cuda(dtype):
  """Decode (split and unsplit), ragged and sparse kernels at production-like shapes lower through Mosaic GPU."""
  S, K, g, H = 4, 8, 4, 128
  sd = jax.ShapeDtypeStruct
  q, kv, bt, lens, sc = _lowering_operands(dtype, S, Pmax=512, P=4096)
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
  U = 20
  phys, cnt = sd((S, K, U), jnp.int32), sd((S, K), jnp.int32)
  _lower_cuda(lambda q, kv, p, l, c, lens: sparse._sparse_gpu(q, kv, p, l, c, lens, scale=None, soft_cap=None,
                                                              kv_scales_PK=sc, interpret=False,
                                                              tun=tuning.current()),
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


# ---------------------------------------------------------------- wide block tables and padding slots
# The engine passes block tables as wide as the longest allowed sequence ([S, max_pages_per_seq]) with many slots at
# kv_len 0. The kernels must read only what the real lengths need. These tests poison (NaN) every pool page that a
# padding slot's table row names, and every page past the 128-token block holding a sequence's last token: any read
# of one would reach the PV product (0 * NaN = NaN) and fail max_err. The reference runs on the clean pool.

WIDE = 32  # table entries per sequence (512 tokens at page 16) while real lengths stay <= 3 pages


def _poison_unread_pages(kv, sc, bt, lens, G):
  """The GPU kernels read KV in blocks of at most 128 tokens."""
  return poison_unread_pages(kv, sc, bt, lens, G, block=128)


def _wide_decode_problem(rng, dtype, S=6, K=2, g=4, H=64, G=16):
  q, kv, bt, _, sc = random_decode(rng, S=S, K=K, g=g, H=H, G=G, Pmax=WIDE, dtype=dtype)
  lens = np.zeros(S, np.int32)
  lens[1::2] = rng.integers(1, 3 * G + 1, len(lens[1::2]))  # real sequences (<= 3 pages) between padding slots
  lens[1] = 3 * G
  lens = jnp.asarray(lens)
  kv_bad, sc_bad = _poison_unread_pages(kv, sc, bt, lens, G)
  return q, kv, kv_bad, bt, lens, sc, sc_bad


@pytest.mark.parametrize("dtype,kw", [
    (jnp.bfloat16, {}),  # static split count from the table width (the default)
    (jnp.bfloat16, dict(splits=4, sliding_window=20)),  # static splits: those past the length idle
    (jnp.bfloat16, dict(work_list=True)),  # run-time work list
    (jnp.float8_e4m3fn, dict(fp8_converters=1, splits=3)),  # warp-specialized fp8 kernel, idle splits
    (jnp.float8_e5m2, dict(fp8_converters=0, work_list=True)),  # inline-conversion fp8 kernel, work list
    (jnp.float8_e4m3fn, dict(fp8_converters=1, fp8_compute_wgs=2, splits=2)),  # two compute warpgroups
])
def test_gpu_decode_wide_table_padding_slots_read_nothing(dtype, kw):
  rng, seed = fresh_rng()
  q, kv, kv_bad, bt, lens, sc, sc_bad = _wide_decode_problem(rng, dtype)
  out = gpu.paged_decode_attention_gpu(q, kv_bad, bt, lens, kv_scales_PK=sc_bad, interpret=True, **kw)
  sem = {k: v for k, v in kw.items() if k in ("sliding_window", "soft_cap")}
  ref = pa.paged_decode_attention_reference(q, kv, bt, lens, kv_scales_PK=sc, **sem)
  assert max_err(out, ref) < TOL, f"seed {seed}"
  assert np.all(np.asarray(out, np.float32)[np.asarray(lens) == 0] == 0), f"seed {seed}"


@pytest.mark.parametrize("dtype,kw", [
    (jnp.bfloat16, dict(work_list=True)),
    (jnp.float8_e4m3fn, dict(work_list=True, fp8_converters=1, sliding_window=150, soft_cap=5.0)),
])
def test_gpu_decode_work_list_splits_the_live_sequences_of_a_padded_batch(dtype, kw):
  """One long and two short sequences among kv_len-0 slots, wide table: the run-time work list cuts the long one
  into several chunks (merged afterwards) and the short ones not at all; padding pages stay unread."""
  rng, seed = fresh_rng()
  q, kv, bt, _, sc = random_decode(rng, S=5, K=2, g=4, H=64, G=16, Pmax=WIDE, dtype=dtype)
  lens = jnp.asarray([0, 330, 0, 40, 7], jnp.int32)
  kv_bad, sc_bad = _poison_unread_pages(kv, sc, bt, lens, 16)
  cfg = gpu.make_config(q.shape, kv.shape, kv.dtype, WIDE, scale=1.0, soft_cap=None, sliding_window=None,
                        out_dtype="bfloat16", fp8_converters=kw.get("fp8_converters"), work_list=True)
  _, chunks = gpu.decode_work_list(cfg, lens)
  assert np.asarray(chunks)[[0, 2, 3, 4]].tolist() == [0, 0, 1, 1] and np.asarray(chunks)[1] > 1
  out = gpu.paged_decode_attention_gpu(q, kv_bad, bt, lens, kv_scales_PK=sc_bad, interpret=True, **kw)
  sem = {k: v for k, v in kw.items() if k in ("sliding_window", "soft_cap")}
  ref = pa.paged_decode_attention_reference(q, kv, bt, lens, kv_scales_PK=sc, **sem)
  assert max_err(out, ref) < TOL, f"seed {seed}"
  assert np.all(np.asarray(out, np.float32)[[0, 2]] == 0), f"seed {seed}"


def _chunk_ranges(total, chunks):
  """The block ranges gpu.block_walk gives chunk j of `chunks` over `total` blocks (numpy mirror)."""
  per = -(-total // max(chunks, 1))
  return [(j * per, j * per + int(np.clip(total - j * per, 0, per))) for j in range(chunks)]


def test_decode_work_list_shares_out_the_real_blocks():
  """Chunks follow the real lengths (one wave's worth in all), none is empty, every block is covered exactly once,
  the extras never overflow their static count, and idle slots get nothing."""
  import dataclasses
  kw = dict(scale=1.0, soft_cap=None, sliding_window=None, out_dtype="bfloat16")
  base = gpu.make_config((6, 32, 128), (4096, 16, 16, 128), jnp.bfloat16, 8192, work_list=True, **kw)
  cfg = dataclasses.replace(base, wave=8, extra=8)
  lens = np.array([0, 8192, 1024, 0, 64, 0])  # 64-token blocks: 0, 128, 16, 0, 1, 0
  wl, chunks = gpu.decode_work_list(cfg, jnp.asarray(lens, jnp.int32))
  wl, chunks = np.asarray(wl), np.asarray(chunks)
  assert chunks.tolist() == [0, 7, 1, 0, 1, 0] and wl.shape == (8 + 6, 3)
  assert wl[:6].tolist() == [[1, j, 7] for j in range(1, 7)] and np.all(wl[6:8, 2] == 0)  # extras, then idle
  assert wl[8:].tolist() == [[s, 0, int(c)] for s, c in enumerate(chunks)]  # the homes
  nb = -(-lens // 64)
  for s in range(6):
    ranges = _chunk_ranges(nb[s], chunks[s])
    assert all(b > a for a, b in ranges) and sum(b - a for a, b in ranges) == nb[s]
  rng = np.random.default_rng(0)
  for _ in range(20):  # random batches: the extras always fit
    lens = rng.integers(0, 20000, 6) * rng.integers(0, 2, 6)
    _, chunks = gpu.decode_work_list(cfg, jnp.asarray(lens, jnp.int32))
    assert int(np.maximum(np.asarray(chunks) - 1, 0).sum()) <= cfg.extra


def test_gpu_decode_all_slots_empty_gives_zeros():
  """A mixed step's decode call where no slot decodes: every slot at kv_len 0, all pages poisoned."""
  rng, seed = fresh_rng()
  q, kv, bt, _, _ = random_decode(rng, S=3, K=2, g=4, H=64, G=16, Pmax=WIDE)
  lens = jnp.zeros((3,), jnp.int32)
  kv_bad, _ = _poison_unread_pages(kv, None, bt, lens, 16)
  for splits in (1, 3):
    out = gpu.paged_decode_attention_gpu(q, kv_bad, bt, lens, splits=splits, interpret=True)
    assert np.all(np.asarray(out, np.float32) == 0), f"seed {seed}"


def _wide_ragged_problem(rng, dtype, q_lens, kv_lens, K=2, g=4, H=64, G=16, pad_rows=5):
  S = len(q_lens)
  P = S * WIDE + 3
  kv, sc = random_pool(rng, P, G, K, H, dtype)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  T = int(cu[-1]) + pad_rows
  q = jnp.asarray(rng.standard_normal((T, K * g, H)), jnp.bfloat16)
  bt = jnp.asarray(rng.permutation(P)[: S * WIDE].reshape(S, WIDE), jnp.int32)
  lens = jnp.asarray(kv_lens, jnp.int32)
  kv_bad, sc_bad = _poison_unread_pages(kv, sc, bt, lens, G)
  return q, kv, kv_bad, bt, lens, cu, sc, sc_bad


@pytest.mark.parametrize("dtype,g,kw", [
    (jnp.bfloat16, 4, {}),
    (jnp.bfloat16, 3, dict(sliding_window=9)),  # 21 tokens x 3 heads per tile (one zero row)
    (jnp.float8_e4m3fn, 4, dict(soft_cap=4.0)),
])
def test_gpu_ragged_wide_table_with_decode_rows_at_kv_len_zero(dtype, g, kw):
  """A mixed step's ragged call: prefill chunks (several sharing a q tile) next to decode sequences that the
  ragged kernel sees at kv_len 0 (q_len 1: their rows must be exactly 0) and empty padding slots."""
  rng, seed = fresh_rng()
  q_lens = [1, 7, 1, 0, 12, 1, 0, 3]
  kv_lens = [0, 7 + 30, 0, 0, 12, 0, 0, 3 + 41]  # <= 3 pages; q_len 1 at kv_len 0 = a decode row elsewhere
  q, kv, kv_bad, bt, lens, cu, sc, sc_bad = _wide_ragged_problem(rng, dtype, q_lens, kv_lens, g=g)
  out = gpu.paged_attention_gpu(q, kv_bad, bt, lens, cu, kv_scales_PK=sc_bad, interpret=True, **kw)
  ref = pa.paged_attention_reference(q, kv, bt, lens, cu, kv_scales_PK=sc, **kw)
  assert max_err(out, ref) < TOL, f"seed {seed}"
  out = np.asarray(out, np.float32)
  cu_np = np.asarray(cu)
  zero_rows = [cu_np[s] for s in range(len(q_lens)) if q_lens[s] == 1 and kv_lens[s] == 0]
  assert np.all(out[zero_rows] == 0) and np.all(out[cu_np[-1]:] == 0), f"seed {seed}"


def test_gpu_ragged_decode_only_step_every_sequence_at_kv_len_zero():
  """In a decode-only step the ragged kernel sees every sequence at kv_len 0: all rows 0, nothing read."""
  rng, seed = fresh_rng()
  q_lens = [1, 1, 0, 1]
  q, kv, kv_bad, bt, lens, cu, _, _ = _wide_ragged_problem(rng, jnp.bfloat16, q_lens, [0, 0, 0, 0])
  out = gpu.paged_attention_gpu(q, kv_bad, bt, lens, cu, interpret=True)
  assert np.all(np.asarray(out, np.float32) == 0), f"seed {seed}"


def test_ragged_work_items_follow_the_work():
  """One item per (q tile, sequence with rows and kv_len > 0); kv_len-0 sequences and padding rows get none."""
  q_lens = np.array([1, 20, 0, 1, 5, 40])
  kv_lens = np.array([0, 25, 0, 9, 0, 40])
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  T, tq = int(cu[-1]) + 3, 16  # 70 rows -> 5 q tiles
  info, item_T, has_T, n_items, NI, NQ = gpu.ragged_work_items(cu, jnp.asarray(kv_lens, jnp.int32), T, tq)
  assert (NQ, NI, int(n_items)) == (5, 5 + 6 - 1, 7)
  info = np.asarray(info)
  real = info[info[:, 4] > info[:, 3]]
  # seq 1: rows 1..20 (tiles 0, 1); seq 3: row 21 (tile 1); seq 5: rows 27..66 (tiles 1..4)
  assert real[:, :2].tolist() == [[1, 0], [1, 1], [3, 1], [5, 1], [5, 2], [5, 3], [5, 4]]
  assert np.all(info[len(real):, 3] == info[len(real):, 4])  # the rest: empty
  assert real[0, 3:].tolist() == [5, 20] and real[1, 3:].tolist() == [20, 25]  # positions 5..24 of seq 1
  has = np.asarray(has_T)
  assert has.sum() == 20 + 1 + 40 and not has[0] and not has[21 + 1:27].any()


def test_split_choice_does_not_follow_the_table_width():
  """Static-split path (the default): the split count stays bounded for a 128k-token table (8192 pages) and
  follows a max_kv_len hint. The work-list path has one wave of extra chunk programs, whatever the table width."""
  kw = dict(scale=1.0, soft_cap=None, sliding_window=None, out_dtype="bfloat16")
  wl = gpu.make_config((8, 32, 128), (4096, 16, 16, 128), jnp.bfloat16, 8192, work_list=True, **kw)
  assert wl.worklist and wl.extra == wl.wave and wl.extra == gpu.make_config(
      (8, 32, 128), (4096, 16, 16, 128), jnp.bfloat16, 16, work_list=True, **kw).extra
  wide = gpu.make_config((8, 32, 128), (4096, 16, 16, 128), jnp.bfloat16, 8192, **kw)
  tight = gpu.make_config((8, 32, 128), (4096, 16, 16, 128), jnp.bfloat16, 8192, max_kv_len=1024, **kw)
  assert 1 <= wide.splits <= 8 and tight.splits <= wide.splits
  many = gpu.make_config((512, 32, 128), (4096, 16, 16, 128), jnp.bfloat16, 8192, **kw)
  assert many.splits == 1  # 512 x 8 (sequence, kv head) programs fill the GPU already
  with pytest.raises(ValueError, match="max_kv_len"):
    gpu.make_config((8, 32, 128), (4096, 16, 16, 128), jnp.bfloat16, 8192, max_kv_len=0, **kw)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_gpu_kernels_lower_for_cuda_with_a_wide_table(dtype):
  """128k-token block tables (8192 pages) and 64 slots: decode (default splits, a hint) and ragged lower."""
  S, K, g, H = 64, 8, 4, 128
  sd = jax.ShapeDtypeStruct
  q, kv, bt, lens, sc = _lowering_operands(dtype, S, Pmax=8192, P=16384)
  for kw in (dict(), dict(max_kv_len=2048), dict(work_list=True), dict(work_list=True, splits=3)):
    txt = _lower_cuda(lambda q, kv, bt, lens: gpu.paged_decode_attention_gpu(q, kv, bt, lens, kv_scales_PK=sc, **kw),
                      q, kv, bt, lens).as_text()
    assert "mosaic_gpu" in txt
  qT, cu = sd((256, K * g, H), jnp.bfloat16), sd((S + 1,), jnp.int32)
  _lower_cuda(lambda *a: gpu.paged_attention_gpu(*a, kv_scales_PK=sc), qT, kv, bt, lens, cu)


@pytest.mark.parametrize("dtype,kw", [(jnp.bfloat16, dict(sliding_window=30)), (jnp.float8_e5m2, {})])
def test_gpu_ragged_persistent_programs_loop_over_items(dtype, kw):
  """The ragged grid is persistent: with one "SM" and one wave there are 2-3 programs per kv head, each looping
  over several work items (q tiles of several sequences, one tile shared by 3), reusing barriers and smem."""
  with tuning.override(num_sms=1, ragged_waves=1):
    _ragged_persistent_programs(dtype, kw)


def _ragged_persistent_programs(dtype, kw):
  rng, seed = fresh_rng()
  q_lens = [9, 1, 30, 0, 5, 1, 17]
  kv_lens = [9 + 20, 0, 30 + 3, 0, 5, 38, 17]
  q, kv, kv_bad, bt, lens, cu, sc, sc_bad = _wide_ragged_problem(rng, dtype, q_lens, kv_lens, pad_rows=7)
  T = q.shape[0]
  info, _, _, n_items, NI, _ = gpu.ragged_work_items(cu, lens, T, 16)
  cfg = gpu.make_config((7, 8, 64), kv.shape, kv.dtype, WIDE, scale=1.0, soft_cap=None, sliding_window=None,
                        out_dtype="bfloat16", ragged_tiles=NI)
  assert cfg.programs <= 3 and int(n_items) == 8  # (8 items over <= 3 programs per kv head)
  out = gpu.paged_attention_gpu(q, kv_bad, bt, lens, cu, kv_scales_PK=sc_bad, interpret=True, **kw)
  ref = pa.paged_attention_reference(q, kv, bt, lens, cu, kv_scales_PK=sc, **kw)
  assert max_err(out, ref) < TOL, f"seed {seed}"
  assert np.all(np.asarray(out, np.float32)[np.asarray(cu)[1]] == 0)  # q_len 1 at kv_len 0


def test_tuning_rows_are_data_and_override_is_scoped():
  """The kernels' tuned defaults come from tuning.py's table (a row per device kind, "default" otherwise); an
  override replaces fields inside its block only, and make_config reads the row in force when it is called."""
  assert set(tuning.TABLE) >= {"default", "NVIDIA H200"}
  base = tuning.current()
  assert base == tuning.TABLE.get(jax.devices()[0].device_kind, tuning.TABLE["default"])
  kw = dict(scale=1.0, soft_cap=None, sliding_window=None, out_dtype="bfloat16")
  shape = ((4, 8, 64), (64, 16, 4, 64), jnp.float8_e4m3fn, 32)
  with tuning.override(fp8_converters=0, work_list=True) as row:
    assert row.fp8_converters == 0 and tuning.current() is row and row.split_policy == base.split_policy
    inline = gpu.make_config(*shape, **kw)
  assert tuning.current() == base
  ws = gpu.make_config(*shape, **kw)
  assert (inline.converters, ws.converters) == (0, base.fp8_converters)
  with pytest.raises(TypeError):
    with tuning.override(no_such_field=1):
      pass
