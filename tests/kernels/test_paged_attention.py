"""Paged attention: the jnp reference vs a float64 numpy oracle, write_kv, the dispatcher, sparse selection.

Every test draws fresh random inputs (the seed is in the failure message). Kernel tests live in
test_paged_attention_gpu.py / test_paged_attention_tpu.py.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels.paged_attention import common
from pallas_kernels.utils import next_pow2
from test_paged_attention_oracle import (fresh_rng, max_err, oracle_decode, oracle_ragged, random_decode,
                                         random_ragged)

FP8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)


@pytest.mark.parametrize("dtype,kw", [
    (jnp.bfloat16, {}),
    (jnp.float32, dict(sliding_window=21, soft_cap=2.0, scale=0.3)),
    (jnp.float8_e4m3fn, {}),
    (jnp.float8_e5m2, dict(sliding_window=9)),
])
def test_reference_decode_matches_oracle(dtype, kw):
  rng, seed = fresh_rng()
  q, kv, bt, lens, sc = random_decode(rng, S=4, K=2, g=3, H=16, G=8, Pmax=6, dtype=dtype)
  out = pa.paged_decode_attention_reference(q, kv, bt, lens, kv_scales_PK=sc, **kw)
  want = oracle_decode(q, kv, bt, lens, scales_PK=sc, window=kw.get("sliding_window"), soft_cap=kw.get("soft_cap"),
                       scale=kw.get("scale"))
  assert max_err(out, want) < 2e-2, f"seed {seed}"  # output is bf16


@pytest.mark.parametrize("dtype,kw", [
    (jnp.bfloat16, {}),
    (jnp.float32, dict(sliding_window=7, soft_cap=3.0)),
    (jnp.float8_e4m3fn, dict(sliding_window=30)),
])
def test_reference_ragged_matches_oracle(dtype, kw):
  rng, seed = fresh_rng()
  q, kv, bt, lens, cu, sc = random_ragged(rng, q_lens=[3, 0, 1, 12, 0], extra=[5, 0, 30, 0, 7], K=2, g=2, H=16, G=4,
                                          Pmax=10, dtype=dtype)
  out = pa.paged_attention_reference(q, kv, bt, lens, cu, kv_scales_PK=sc, **kw)
  want = oracle_ragged(q, kv, bt, lens, cu, scales_PK=sc, window=kw.get("sliding_window"),
                       soft_cap=kw.get("soft_cap"))
  assert max_err(out, want) < 2e-2, f"seed {seed}"
  assert np.all(np.asarray(out[int(cu[-1]):], np.float32) == 0), "padding rows must be zeros"


def test_ragged_with_max_q_len_1_uses_decode_path_and_agrees():
  rng, seed = fresh_rng()
  q, kv, bt, lens, cu, _ = random_ragged(rng, q_lens=[1, 0, 1, 1], extra=[9, 4, 0, 20], K=2, g=2, H=16, G=4, Pmax=8)
  ragged = pa.paged_attention(q, kv, bt, lens, cu, impl="reference")
  decode = pa.paged_attention(q, kv, bt, lens, cu, impl="reference", max_q_len=1)
  assert max_err(decode, ragged) < 1e-2, f"seed {seed}"


def test_bad_inputs_raise_clear_errors():
  rng, _ = fresh_rng()
  q, kv, bt, lens, sc = random_decode(rng, S=2, K=2, g=2, H=16, G=4, Pmax=3)
  with pytest.raises(ValueError, match="kv_pages_PGKH"):
    pa.paged_decode_attention(q, kv[0], bt, lens)
  with pytest.raises(TypeError, match="block_tables_SP must be int32"):
    pa.paged_decode_attention(q, kv, bt.astype(jnp.float32), lens)
  with pytest.raises(ValueError, match="multiple of kv heads"):
    pa.paged_decode_attention(q[:, :3], kv, bt, lens)
  with pytest.raises(ValueError, match="head dim"):
    pa.paged_decode_attention(q[..., :8], kv, bt, lens)
  with pytest.raises(ValueError, match="kv_scales_PK is required"):
    pa.paged_decode_attention(q, kv.astype(jnp.float8_e4m3fn), bt, lens)
  with pytest.raises(ValueError, match="kv_scales_PK must be None"):
    pa.paged_decode_attention(q, kv, bt, lens, kv_scales_PK=jnp.ones((kv.shape[0], 4)))
  with pytest.raises(ValueError, match="cu_q_lens_S1 must have S\\+1"):
    pa.paged_attention(q, kv, bt, lens, jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="sliding_window"):
    pa.paged_decode_attention(q, kv, bt, lens, sliding_window=0)
  with pytest.raises(ValueError, match="impl must be one of"):
    pa.paged_decode_attention(q, kv, bt, lens, impl="cuda")
  with pytest.raises(ValueError, match="k_TKH must be"):
    pa.write_kv(kv, None, jnp.zeros((3, 2, 8)), jnp.zeros((3, 2, 8)), jnp.zeros((3,), jnp.int32))


def test_dispatcher_falls_back_with_a_warning(caplog):
  rng, seed = fresh_rng()
  # float32 pools are outside the Mosaic GPU kernel (it would run wgmma in tf32): reference + warning.
  q, kv, bt, lens, _ = random_decode(rng, S=2, K=2, g=2, H=64, G=8, Pmax=3, dtype=jnp.float32)
  with caplog.at_level(logging.WARNING, logger="pallas_kernels.paged_attention"):
    out = pa.paged_decode_attention(q, kv, bt, lens, impl="gpu_interpret")
  assert "float32 pools" in caplog.text
  assert max_err(out, pa.paged_decode_attention_reference(q, kv, bt, lens)) == 0.0, f"seed {seed}"
  assert pa.resolve_impl("auto") == "reference"  # these tests run on CPU


def _np_fp8(x, dtype):
  return np.asarray(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_write_kv_appends_like_the_rule(dtype):
  """Appends tokens to 3 sequences over several steps; checks stored values, scales and untouched slots."""
  rng, seed = fresh_rng()
  P, G, K, H = 14, 4, 2, 8
  fp8 = jnp.dtype(dtype) in map(jnp.dtype, FP8)
  poison = rng.standard_normal((P, G, 2 * K, H)).astype(np.float32) * 7
  pool = jnp.asarray(poison).astype(dtype)
  scales = jnp.asarray(rng.uniform(0, 5, (P, 2 * K)), jnp.float32) if fp8 else None  # stale scales of freed pages
  pool0 = np.asarray(pool.astype(jnp.float32))
  real = np.zeros((P, G, 2 * K, H))
  written = np.zeros((P, G), bool)
  want_scale = np.zeros((P, 2 * K)) if not fp8 else np.asarray(scales, np.float64).copy()
  pages = rng.permutation(P)[:12].reshape(3, 4)
  lens = [0, 0, 0]
  fmax = common.fp8_max(dtype) if fp8 else 1.0
  for step in range(4):
    slots, ks, vs = [], [], []
    for s in range(3):
      for _ in range(int(rng.integers(0, 6))):
        if lens[s] >= 4 * G:
          break
        slots.append(pages[s, lens[s] // G] * G + lens[s] % G)
        lens[s] += 1
        ks.append(rng.standard_normal((K, H)) * (step + 1))
        vs.append(rng.standard_normal((K, H)) * (step + 1))
    slots.append(-1)  # a padding token: must be ignored
    ks.append(np.full((K, H), 1e4))
    vs.append(np.full((K, H), 1e4))
    k = np.asarray(ks, np.float32)
    v = np.asarray(vs, np.float32)
    pool, scales = jax.jit(pa.write_kv, donate_argnums=(0, 1))(pool, scales, jnp.asarray(k), jnp.asarray(v),
                                                             jnp.asarray(slots, jnp.int32))
    for t, sl in enumerate(slots):
      if sl < 0:
        continue
      p, o = divmod(sl, G)
      if fp8 and o == 0:
        want_scale[p] = 0.0
      real[p, o, 0::2], real[p, o, 1::2] = k[t], v[t]
      written[p, o] = True
    if fp8:
      for p in range(P):
        if written[p].any():
          want_scale[p] = np.maximum(want_scale[p], np.abs(real[p][written[p]]).max(axis=(0, 2)) / fmax)
  stored = np.asarray(pool.astype(jnp.float32))
  # bf16: every unwritten slot keeps its bytes. fp8: a page whose scale grows is requantized as a whole, so
  # only pages never written must keep theirs.
  keep = ~written if not fp8 else ~written.any(axis=1)
  np.testing.assert_array_equal(stored[keep], pool0[keep], err_msg=f"untouched slots changed, seed {seed}")
  if not fp8:
    np.testing.assert_array_equal(stored[written], np.asarray(jnp.asarray(real[written], jnp.float32)
                                                              .astype(jnp.bfloat16).astype(jnp.float32)))
    return
  got_scale = np.asarray(scales, np.float64)
  touched = written.any(axis=1)
  np.testing.assert_allclose(got_scale[touched], want_scale[touched], rtol=1e-6, err_msg=f"seed {seed}")
  deq = stored * got_scale[:, None, :, None]
  mant = 3 if jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn) else 2
  # Each value is rounded once when written and at most once more per scale growth (<= 4 steps here).
  bound = 5 * 2.0 ** -(mant + 1) * np.abs(real) + got_scale[:, None, :, None] * 2.0 ** -6
  assert np.all(np.abs(deq - real)[written] <= bound[written]), f"seed {seed}"


def test_write_kv_requantizes_a_page_whose_scale_grows():
  rng, seed = fresh_rng()
  P, G, K, H = 3, 4, 1, 8
  pool = jnp.zeros((P, G, 2 * K, H), jnp.float8_e4m3fn)
  sc = jnp.zeros((P, 2 * K), jnp.float32)
  small = rng.uniform(0.5, 1.0, (1, 1, H)).astype(np.float32)
  pool, sc = pa.write_kv(pool, sc, jnp.asarray(small), jnp.asarray(small), jnp.asarray([4], jnp.int32))
  big = small * 100
  pool, sc = pa.write_kv(pool, sc, jnp.asarray(big), jnp.asarray(big), jnp.asarray([5], jnp.int32))
  deq = np.asarray(pool.astype(jnp.float32)) * np.asarray(sc)[:, None, :, None]
  np.testing.assert_allclose(np.asarray(sc)[1], np.abs(big).max() / 448.0, rtol=1e-6)
  np.testing.assert_allclose(deq[1, 0, 0], small[0, 0], rtol=0.15, err_msg=f"old entry not requantized, seed {seed}")
  np.testing.assert_allclose(deq[1, 1, 0], big[0, 0], rtol=0.07, err_msg=f"seed {seed}")


def test_update_page_summaries_tracks_min_max_and_resets_fresh_pages():
  rng, seed = fresh_rng()
  P, G, K, H = 6, 4, 2, 8
  kmin, kmax = pa.init_page_summaries(P, K, H)
  first = rng.standard_normal((5, K, H)).astype(np.float32)
  slots1 = np.array([8, 9, 10, -1, 21], np.int32)  # page 2 offsets 0-2, padding, page 5 offset 1
  kmin, kmax = pa.update_page_summaries(kmin, kmax, jnp.asarray(first), jnp.asarray(slots1), page_size=G)
  second = rng.standard_normal((2, K, H)).astype(np.float32)
  slots2 = np.array([11, 20], np.int32)  # page 2 offset 3; page 5 restarts at offset 0
  kmin, kmax = pa.update_page_summaries(kmin, kmax, jnp.asarray(second), jnp.asarray(slots2), page_size=G)
  page2 = np.concatenate([first[:3], second[:1]])
  np.testing.assert_array_equal(np.asarray(kmin)[2], page2.min(0), err_msg=f"seed {seed}")
  np.testing.assert_array_equal(np.asarray(kmax)[2], page2.max(0), err_msg=f"seed {seed}")
  np.testing.assert_array_equal(np.asarray(kmin)[5], second[1], err_msg=f"fresh page not reset, seed {seed}")
  assert np.all(np.isinf(np.asarray(kmin)[[0, 1, 3, 4]]))


def _np_select(q, kmin, kmax, bt, lens, G, sink, window, topk):
  S, N, H = q.shape
  K = kmin.shape[1]
  g = N // K
  U = min(bt.shape[1], sink + window + topk)
  out = []
  for s in range(S):
    n = -(-int(lens[s]) // G)
    row = []
    for k in range(K):
      if n <= U:
        chosen = list(range(n))
      else:
        fixed = set(range(sink)) | set(range(n - window, n))
        cand = [j for j in range(n) if j not in fixed]
        score = {j: max(sum(max(q[s, k * g + h, d] * kmin[bt[s, j], k, d], q[s, k * g + h, d] * kmax[bt[s, j], k, d])
                            for d in range(H)) for h in range(g)) for j in cand}
        chosen = sorted(fixed | set(sorted(cand, key=lambda j: -score[j])[:topk]))
      row.append(chosen)
    out.append(row)
  return out


def test_select_pages_matches_the_rule():
  rng, seed = fresh_rng()
  S, K, g, H, G, P, Pmax = 3, 2, 2, 8, 4, 40, 12
  q = rng.standard_normal((S, K * g, H)).astype(np.float32)
  kmin = rng.standard_normal((P, K, H)).astype(np.float32)
  kmax = kmin + rng.uniform(0, 2, (P, K, H)).astype(np.float32)
  bt = rng.permutation(P)[: S * Pmax].reshape(S, Pmax).astype(np.int32)
  lens = np.array([Pmax * G, 5 * G + 1, 9], np.int32)  # long, budget-sized, short
  phys, logical, count = pa.select_pages(jnp.asarray(q), jnp.asarray(kmin), jnp.asarray(kmax), jnp.asarray(bt),
                                         jnp.asarray(lens), page_size=G, num_sink_pages=1, num_window_pages=2,
                                         top_k_pages=3)
  want = _np_select(q, kmin, kmax, bt, lens, G, 1, 2, 3)
  for s in range(S):
    for k in range(K):
      c = int(count[s, k])
      assert list(np.asarray(logical)[s, k, :c]) == want[s][k], f"s={s} k={k} seed {seed}"
      assert np.all(np.asarray(logical)[s, k, c:] == Pmax)
      np.testing.assert_array_equal(np.asarray(phys)[s, k, :c], bt[s, want[s][k]])


def test_sparse_reference_matches_oracle_and_dense_when_all_pages_fit():
  rng, seed = fresh_rng()
  q, kv, bt, lens, sc = random_decode(rng, S=3, K=2, g=2, H=16, G=4, Pmax=10, dtype=jnp.float8_e4m3fn,
                                      lens=[37, 40, 6])
  kmin = jnp.asarray(rng.standard_normal((kv.shape[0], 2, 16)), jnp.float32)
  kmax = kmin + 1.0
  out, (_, logical, _) = pa.paged_sparse_decode_attention(q, kv, bt, lens, kmin, kmax, num_sink_pages=1,
                                                          num_window_pages=1, top_k_pages=2, kv_scales_PK=sc,
                                                          impl="reference", return_selection=True)
  want = oracle_decode(q, kv, bt, lens, scales_PK=sc, logical_pages_SKU=np.asarray(logical))
  assert max_err(out, want) < 2e-2, f"seed {seed}"
  everything = pa.paged_sparse_decode_attention(q, kv, bt, lens, kmin, kmax, num_sink_pages=1, num_window_pages=1,
                                                top_k_pages=50, kv_scales_PK=sc, impl="reference")
  dense = pa.paged_decode_attention_reference(q, kv, bt, lens, kv_scales_PK=sc)
  assert max_err(everything, dense) < 1e-2, f"seed {seed}"


@pytest.mark.parametrize("rows_max_t", [0, 64])
@pytest.mark.parametrize("q_lens", [[1, 1, 1, 0], [1, 1, 19, 1, 0, 0], [7, 1, 1, 0], [1, 0, 0, 0]])
def test_step_attention_merges_decode_and_ragged_kernels(q_lens, rows_max_t, caplog):
    """The engine's one attention entry with the kernels (GPU interpreter). rows_max_t 0: the leading one-row
    sequences through the decode kernel, everything else (chunks, a one-row chunk after them, padding) through the
    ragged kernel, rows merged by a select; 64 (small steps): every row through the decode kernel as a one-query
    sequence of its own (causal prefix lengths). Equals the reference for decode-only, mixed and padded batches,
    and padding rows stay finite."""
    from pallas_kernels.paged_attention import step_attention
    from pallas_kernels.paged_attention.reference import paged_attention_reference
    rng = np.random.default_rng(len(q_lens) + sum(q_lens))
    S, K, g, H, G, Pmax = len(q_lens), 2, 2, 64, 16, 6
    P = S * Pmax + 1
    kv = jnp.asarray(rng.normal(size=(P, G, 2 * K, H)), jnp.bfloat16)
    bt = jnp.asarray(1 + np.arange(S * Pmax).reshape(S, Pmax), jnp.int32)
    T = max(sum(q_lens), S)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    lens = jnp.asarray([ql + (int(rng.integers(0, 40)) if ql else 0) for ql in q_lens], jnp.int32)
    q = jnp.asarray(rng.normal(size=(T, K * g, H)), jnp.bfloat16)
    want = paged_attention_reference(q, kv, bt, lens, cu)
    with caplog.at_level(logging.WARNING, logger="pallas_kernels.paged_attention"):
        got = step_attention(q, kv, bt, lens, cu, impl="gpu_interpret", rows_as_decodes_max_t=rows_max_t)
    assert not caplog.records, [r.getMessage() for r in caplog.records]      # the kernels ran, no fallback
    n = sum(q_lens)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_allclose(np.asarray(got, np.float32)[:n], np.asarray(want, np.float32)[:n], atol=3e-2, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
def test_blocked_attention_equals_the_reference_with_a_wide_table(window):
    """blocked.py (the CPU path of the engine step): a block table far wider than the live lengths, padding
    sequences at kv_len 0, decode and ragged batches, sliding window; equal to reference.py in float32."""
    from pallas_kernels.paged_attention import blocked
    from pallas_kernels.paged_attention.reference import paged_attention_reference, paged_decode_attention_reference
    rng = np.random.default_rng(11)
    P, G, K, H, N = 40, 4, 2, 8, 4
    kv = jnp.asarray(rng.normal(size=(P, G, 2 * K, H)), jnp.float32)
    bt = jnp.asarray(rng.integers(1, P, size=(5, 24)), jnp.int32)
    lens = jnp.asarray([0, 7, 70, 1, 33], jnp.int32)
    q = jnp.asarray(rng.normal(size=(5, N, H)), jnp.float32)
    np.testing.assert_allclose(blocked.decode_attention_blocked(q, kv, bt, lens, sliding_window=window),
                               paged_decode_attention_reference(q, kv, bt, lens, sliding_window=window), atol=1e-5)
    cu = jnp.asarray([0, 0, 3, 4, 9, 10], jnp.int32)
    qt = jnp.asarray(rng.normal(size=(16, N, H)), jnp.float32)
    lens2 = jnp.asarray([0, 9, 70, 5, 33], jnp.int32)
    np.testing.assert_allclose(blocked.ragged_attention_blocked(qt, kv, bt, lens2, cu, sliding_window=window),
                               paged_attention_reference(qt, kv, bt, lens2, cu, sliding_window=window), atol=1e-5)


def test_blocked_attention_reads_the_mla_latent_pool():
    """kv_layout=("latent", C): the split latent pool (tbjax/engine/mla_paged.py) read as one kv head whose key and
    value are the joined latent; equal to mla_paged.latent_attention (its jnp definition)."""
    from pallas_kernels.paged_attention import blocked
    from tbjax.engine.mla_paged import latent_attention
    rng = np.random.default_rng(12)
    C, G = 10, 4
    pool = jnp.asarray(rng.normal(size=(30, G, 2, 5)), jnp.float32)
    bt = jnp.asarray(rng.integers(1, 30, size=(3, 9)), jnp.int32)
    lens = jnp.asarray([6, 0, 30], jnp.int32)
    cu = jnp.asarray([0, 1, 1, 6], jnp.int32)
    q = jnp.asarray(rng.normal(size=(8, 3, C)), jnp.float32)
    want = latent_attention(q, pool, bt, lens, cu, scale=0.3)
    got = blocked.ragged_attention_blocked(q, pool, bt, lens, cu, scale=0.3, kv_layout=("latent", C))
    np.testing.assert_allclose(np.asarray(got)[:6], np.asarray(want)[:6], atol=1e-5)


@pytest.mark.parametrize("window,q_len", [(None, 20), (None, 70), (20, 70)])
def test_blocked_ragged_attention_is_batch_invariant(window, q_len):
    """A prefill chunk (one query tile or three) equals the reference, and its rows come out bit-identical whatever
    bucket (T) the step has and whatever other sequences share it: the CPU step's batch invariance. Head shapes are
    the default model's (9 query heads over 3 kv heads of 64)."""
    from pallas_kernels.paged_attention import blocked
    from pallas_kernels.paged_attention.reference import paged_attention_reference
    rng = np.random.default_rng(5)
    P, G, K, H, N = 60, 16, 3, 64, 9
    kv = jnp.asarray(rng.normal(size=(P, G, 2 * K, H)), jnp.float32)
    bt_row = rng.permutation(np.arange(1, P))[:40]
    kv_len = q_len + 30                                        # the chunk sits at positions 30 .. 30 + q_len - 1
    q_seq = rng.normal(size=(q_len, N, H))
    alone = None
    for others in ([], [(1, 12)], [(9, 50), (1, 3), (20, 20)], [(100, 200)]):
        T = q_len + sum(n for n, _ in others)
        T_bucket = next_pow2(T)
        rows = [q_seq] + [rng.normal(size=(n, N, H)) for n, _ in others]
        q = np.zeros((T_bucket, N, H))
        q[:T] = np.concatenate(rows)
        lens = [kv_len] + [n_kv for _, n_kv in others]
        cu = np.cumsum([0, q_len] + [n for n, _ in others])
        bt = np.stack([bt_row] + [rng.permutation(np.arange(1, P))[:40] for _ in others])
        args = (jnp.asarray(q, jnp.float32), kv, jnp.asarray(bt, jnp.int32), jnp.asarray(lens, jnp.int32),
                jnp.asarray(cu, jnp.int32))
        got = np.asarray(blocked.ragged_attention_blocked(*args, sliding_window=window))
        np.testing.assert_allclose(got[:T], np.asarray(paged_attention_reference(*args, sliding_window=window))[:T],
                                   atol=2e-5)
        if alone is None:
            alone = got[:q_len]
        np.testing.assert_array_equal(got[:q_len], alone)
