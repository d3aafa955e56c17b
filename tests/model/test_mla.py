"""MLA attention kind: interleaved RoPE against DeepSeek's complex-number formulation, and the latent (absorbed)
form with a cache of one latent per token against the expanded form on whole prompts. Parity of the expanded
form with transformers is in test_moe.py (tiny DeepSeek-V3 models, tests/data/hf_moe)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tbjax.model import forward_dense, init_params
from tbjax.model import layers as ly
from tbjax.model import mla
from tbjax.model.transformer import forward_hidden, lm_logits
from tbjax.spec import ModelSpec, rope_attention_scale
from tbjax.weights.hf_names_moe import load_hf

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "hf_moe")
SEED = int.from_bytes(os.urandom(4), "little")


def test_interleaved_rope_matches_complex_rotation():
    r = np.random.default_rng(SEED)
    T, N, R = 7, 3, 8
    x = r.normal(size=(T, N, R)).astype(np.float32)
    ang = r.uniform(0, 6, (T, R // 2))
    got = np.asarray(mla.apply_rope_interleaved(jnp.asarray(x), jnp.cos(ang).astype(jnp.float32),
                                                jnp.sin(ang).astype(jnp.float32)))
    z = (x[..., 0::2] + 1j * x[..., 1::2]).astype(np.complex128) * np.exp(1j * ang)[:, None, :]
    # DeepSeek's output is interleaved (re0, im0, re1, im1...); ours is de-interleaved (re..., im...)
    np.testing.assert_allclose(got, np.concatenate([z.real, z.imag], -1), rtol=1e-5, atol=1e-5)


class LatentCache:
    """A minimal engine-side `attend` for the latent form: contiguous cache [S, C] per layer (C = kv_lora + rope)."""
    mla_latent = True

    def __init__(self, scale, q_positions):
        self.scale, self.qpos = scale, q_positions

    def __call__(self, layer, q_TNC, k_T1C, v_T1C, cache):
        assert k_T1C.shape[1] == 1 and k_T1C is v_T1C     # one kv head: the latent is key and value
        lat = k_T1C[:, 0] if cache is None else jnp.concatenate([cache, k_T1C[:, 0]])
        kpos = jnp.arange(lat.shape[0])
        s = jnp.einsum("tnc,sc->nts", q_TNC.astype(jnp.float32), lat.astype(jnp.float32)) * self.scale
        s = jnp.where(kpos[None, None, :] <= self.qpos[None, :, None], s, -jnp.inf)
        o = jnp.einsum("nts,sc->tnc", jax.nn.softmax(s, -1), lat.astype(jnp.float32))
        return o.astype(q_TNC.dtype), lat


def _latent_run(params, spec, tokens, positions, caches):
    att = LatentCache(rope_attention_scale(spec), positions)
    h, caches = forward_hidden(params, spec, tokens, positions, att, caches)
    return lm_logits(params, spec, h), caches


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_nolora"])
def test_latent_cache_decode_equals_expanded_forward(name):
    spec, params, _ = load_hf(os.path.join(DATA, name), dtype=jnp.float32)
    toks = np.load(os.path.join(DATA, name, "reference.npz"))["tokens"][1]
    T = len(toks) - 1
    full = np.asarray(jax.jit(lambda p, t: forward_dense(p, spec, t)[0])(params, jnp.asarray(toks)))
    run = jax.jit(lambda p, t, pos, c: _latent_run(p, spec, t, pos, c))
    pre, caches = run(params, jnp.asarray(toks[:T]), jnp.arange(T), [None] * spec.n_layers)
    assert all(c.shape == (T, mla.latent_dim(spec)) for c in caches)
    step, caches = run(params, jnp.asarray(toks[T:]), jnp.arange(T, T + 1), caches)
    assert all(c.shape == (T + 1, spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) for c in caches)
    np.testing.assert_allclose(np.asarray(pre), full[:T], atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(step)[0], full[T], atol=2e-5, rtol=0)


def test_expanded_and_latent_agree_when_v_head_is_wider_than_qk():
    # v_head_dim > qk_nope + qk_rope exercises the padding of q/k in the expanded form
    spec = ModelSpec.from_hf_config(os.path.join(DATA, "deepseek_v3_nolora")).replace(dtype="float32")
    spec = spec.replace(mla=spec.mla.__class__(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=8,
                                               qk_rope_head_dim=8, v_head_dim=40), head_dim=16)
    params = init_params(spec, jax.random.key(SEED % 1000), std=0.1)
    toks = jnp.asarray(np.random.default_rng(SEED).integers(0, spec.vocab_size, 10))
    full = np.asarray(jax.jit(lambda p, t: forward_dense(p, spec, t)[0])(params, toks))
    lat, _ = jax.jit(lambda p, t: _latent_run(p, spec, t, jnp.arange(10), [None] * spec.n_layers))(params, toks)
    np.testing.assert_allclose(np.asarray(lat), full, atol=2e-5, rtol=0)
    assert np.abs(full).max() > 1e-3


def test_mla_shapes_refuse_unsupported_configs():
    spec = ModelSpec.from_hf_config(os.path.join(DATA, "deepseek_v3"))
    with pytest.raises(NotImplementedError, match="attention_bias"):
        mla.mla_shapes(spec.replace(qkv_bias=True))
    with pytest.raises(ValueError, match="needs spec.mla"):
        mla.mla_shapes(spec.replace(mla=None))
    s = mla.mla_shapes(spec)
    assert s["wkv_a"] == (64, 32 + 8) and s["w_o"] == (4 * 16, 64) and "wq" not in s


def test_latent_norms_use_eps_1e6_like_transformers():
    # transformers builds q_a_layernorm / kv_a_layernorm with the default eps (1e-6), not rms_norm_eps
    spec = ModelSpec.from_hf_config(os.path.join(DATA, "deepseek_v3")).replace(dtype="float32", norm_eps=0.5)
    p = {k: jnp.ones(s, jnp.float32) * 0.1 for k, s in mla.mla_shapes(spec).items()}
    x = jnp.ones((2, spec.d_model), jnp.float32)
    cos, sin = ly.rope_cos_sin(jnp.arange(2), spec.rope)
    _, _, lat = mla.mla_project(spec, p, x, cos, sin)
    c = np.asarray(lat[:, :spec.mla.kv_lora_rank])
    h = 1.0 / np.sqrt(1.0 + 0.5) * 0.1                 # attn_norm with eps 0.5 (rms_norm_eps), weight 0.1
    ckv = h * spec.d_model * 0.1                       # every latent entry before its norm
    expect = ckv / np.sqrt(ckv * ckv + 1e-6) * 0.1
    np.testing.assert_allclose(c, expect, rtol=1e-5)
