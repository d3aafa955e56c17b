"""MLA's latent cache split over the K and V slots (tbjax/engine/mla_paged.py) against the GQA paged-attention
reference over a pool that stores the latent whole as one head's key and value (twice the bytes)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import write_kv
from pallas_kernels.paged_attention.reference import paged_attention_reference
from tbjax.engine.mla_paged import (latent_attention, latent_decode_attention, latent_heads, latent_mixed_attention,
                                    write_latent)


def _case(rng, C, dtype, G=4, P=24):
    S, N = 3, 5
    q_lens = [1, 5, 3]
    kv_lens = [9, 5, 14]                      # sequence 1 is a fresh prefill, the others extend a cached prefix
    Pmax = -(-max(kv_lens) // G)
    perm = rng.permutation(np.arange(1, P))
    bt = np.zeros((S, Pmax), np.int32)
    k = 0
    for s, n in enumerate(kv_lens):
        npg = -(-n // G)
        bt[s, :npg] = perm[k:k + npg]
        k += npg
    slots = np.concatenate([[bt[s, j // G] * G + j % G for j in range(n)] for s, n in enumerate(kv_lens)])
    lat = jnp.asarray(rng.normal(size=(len(slots), C)) * 2.0, jnp.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(cu[-1], N, C)), jnp.float32)
    K, Hh = latent_heads(C)
    fp8 = jnp.dtype(dtype).itemsize == 1
    split = jnp.zeros((P, G, 2 * K, Hh), dtype)
    whole = jnp.zeros((P, G, 2, C), dtype)
    sc_split = jnp.zeros((P, 2), jnp.float32) if fp8 else None
    sc_whole = jnp.zeros((P, 2), jnp.float32) if fp8 else None
    split, sc_split = write_latent(split, sc_split, lat, jnp.asarray(slots, jnp.int32))
    whole, sc_whole = write_kv(whole, sc_whole, lat[:, None], lat[:, None], jnp.asarray(slots, jnp.int32))
    args = (jnp.asarray(bt), jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu))
    return q, split, sc_split, whole, sc_whole, args


@pytest.mark.parametrize("C", [40, 41])
def test_split_latent_pool_equals_whole_latent_reference(C):
    rng = np.random.default_rng(C)
    q, split, _, whole, _, args = _case(rng, C, jnp.float32)
    assert split.shape[-1] * split.shape[-2] < 2 * C          # the point: about half the bytes of the whole form
    got = latent_attention(q, split, *args, scale=0.1)
    want = paged_attention_reference(q, whole, *args, scale=0.1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # the engine's mixed-step path: the one-row sequence through the batched decode path, the others scanned
    mixed = jax.jit(lambda *a: latent_mixed_attention(*a, scale=0.1))(q, split, *args)
    np.testing.assert_allclose(np.asarray(mixed), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_split_latent_pool_fp8_close_to_float():
    rng = np.random.default_rng(7)
    q, split8, sc8, _, _, args = _case(rng, 40, jnp.float8_e4m3fn)
    _, splitf, _, wholef, _, _ = _case(np.random.default_rng(7), 40, jnp.float32)
    got = np.asarray(latent_attention(q, split8, *args, scale=0.1, kv_scales_PK=sc8))
    want = np.asarray(paged_attention_reference(q, wholef, *args, scale=0.1))
    assert np.all(sc8[np.asarray(args[0]).ravel()[np.asarray(args[0]).ravel() > 0]] > 0)   # every used page scaled
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 1e-4 < err < 0.08, err                             # e4m3: 3 mantissa bits, per-page-and-half scales


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_decode_path_equals_reference(dtype):
    """latent_decode_attention (all sequences at once, the engine's decode step) against the GQA reference over the
    whole-latent pool (one query row per sequence; a padding row with kv_len 0 gives zeros)."""
    rng = np.random.default_rng(11)
    C, G, P, N = 41, 4, 40, 6
    kv_lens = [9, 1, 14, 0, 23]
    S = len(kv_lens)
    Pmax = -(-max(kv_lens) // G)
    perm = rng.permutation(np.arange(1, P))
    bt = np.zeros((S, Pmax), np.int32)
    slots, k = [], 0
    for s, n in enumerate(kv_lens):
        npg = -(-n // G)
        bt[s, :npg] = perm[k:k + npg]
        k += npg
        slots += [bt[s, j // G] * G + j % G for j in range(n)]
    lat = jnp.asarray(rng.normal(size=(len(slots), C)) * 2.0, jnp.float32)
    q = jnp.asarray(rng.normal(size=(S, N, C)), jnp.float32)
    K, Hh = latent_heads(C)
    fp8 = jnp.dtype(dtype).itemsize == 1
    split, sc = write_latent(jnp.zeros((P, G, 2 * K, Hh), dtype), jnp.zeros((P, 2), jnp.float32) if fp8 else None,
                             lat, jnp.asarray(slots, jnp.int32))
    whole, _ = write_kv(jnp.zeros((P, G, 2, C), jnp.float32), None, lat[:, None], lat[:, None],
                        jnp.asarray(slots, jnp.int32))
    args = (jnp.asarray(bt), jnp.asarray(kv_lens, jnp.int32))
    qd = q.astype(jnp.bfloat16) if dtype == jnp.bfloat16 else q
    got = np.asarray(jax.jit(lambda *a: latent_decode_attention(*a, scale=0.1, kv_scales_PK=sc))(
        qd, split, *args)).astype(np.float32)
    want = np.asarray(paged_attention_reference(q, whole, *args, jnp.arange(S + 1, dtype=jnp.int32), scale=0.1))
    assert np.all(got[3] == 0)                                # nothing to attend to
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:   # bf16 inputs / e4m3 latents: against the float32 math, and the fp8 one equal to the scan definition
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < (0.03 if dtype == jnp.bfloat16 else 0.08), err
        if fp8:
            scan = latent_attention(q, split, *args, jnp.arange(S + 1, dtype=jnp.int32), scale=0.1, kv_scales_PK=sc)
            np.testing.assert_allclose(got, np.asarray(scan), rtol=1e-5, atol=1e-5)
