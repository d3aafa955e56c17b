"""Parity with Hugging Face transformers on the same SmolLM2 GGUF weights.

The reference is transformers' own output, stored by scripts/make_hf_reference.py (run under Python 3.11 with
torch 2.13.0 CPU: see that script's docstring for the exact commands; rerun it after changing the prompts).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tbjax.model import forward_dense
from tbjax.sampling import SamplingParams


@pytest.fixture(scope="module")
def dense_logits(smollm_f32):
    spec, params, _ = smollm_f32
    f = jax.jit(lambda p, t: forward_dense(p, spec, t)[0])
    return lambda ids: np.asarray(f(params, jnp.asarray(ids, jnp.int32)))


def test_logits_match_transformers(hf_ref, dense_logits):
    meta, arr = hf_ref
    sub = arr["vocab_subset"]
    for i, ids in enumerate(meta["prompt_ids"]):
        lg = dense_logits(ids)
        ref_last = arr[f"last_logits_{i}"]
        scale = np.abs(ref_last).max()
        assert np.abs(lg[-1] - ref_last).max() <= 1e-3 * scale, i
        assert np.abs(lg[:, sub] - arr[f"subset_logits_{i}"]).max() <= 1e-3 * scale, i
        assert lg[-1].argmax() == ref_last.argmax()


def test_qk_unpermutation_matters(hf_ref, smollm_f32):
    """Loading the GGUF q/k rows as stored (llama.cpp's interleaved order) gives far-off logits: the unpermute
    step is what makes parity hold."""
    from tbjax.weights.gguf_file import unpermute_rows
    spec, params, _ = smollm_f32
    meta, arr = hf_ref
    g = params["groups"]["gqa_dense"]
    N, K, H, D = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.d_model

    def repermute(w_DX, n):  # inverse of unpermute_rows on [out, in]
        w = np.asarray(w_DX).T
        return w.reshape(n, 2, H // 2, D).swapaxes(1, 2).reshape(w.shape).T
    w = np.asarray(g["w_qkv"])
    bad = np.concatenate([np.stack([repermute(w[l, :, :N * H], N) for l in range(spec.n_layers)]),
                          np.stack([repermute(w[l, :, N * H:(N + K) * H], K) for l in range(spec.n_layers)]),
                          w[:, :, (N + K) * H:]], axis=-1)
    # sanity: unpermute_rows really inverts it
    np.testing.assert_array_equal(unpermute_rows(bad[0, :, :N * H].T, N).T, w[0, :, :N * H])
    bad_params = {**params, "groups": {"gqa_dense": {**g, "w_qkv": jnp.asarray(bad)}}}
    lg = np.asarray(jax.jit(lambda p, t: forward_dense(p, spec, t)[0])(bad_params, jnp.asarray(meta["prompt_ids"][0])))
    ref = arr["last_logits_0"]
    assert np.abs(lg[-1] - ref).max() > 0.05 * np.abs(ref).max()


def test_greedy_continuations_match_transformers(hf_ref, smollm_llm):
    """32+ greedy tokens through the engine (paged KV, continuous batching of all prompts) equal transformers'."""
    meta, _ = hf_ref
    outs = smollm_llm.generate(meta["prompt_ids"], SamplingParams.greedy(32, ignore_eos=True))
    for o, ref in zip(outs, meta["greedy"]):
        assert o.token_ids == ref[:32]
