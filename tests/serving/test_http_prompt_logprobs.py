"""Prompt logprobs for echo (serving/prompt_logprobs.py) on real engines of tiny models: stacked and per-layer weight
buffers (forward_dense over the engine's own parameters) and decode meshes with packed, sharded attention weights
(the mesh forward, prompt on the first device's block) all equal log_softmax of a plain forward_dense over the
original weights, top-k included; over HTTP, through the engine loop."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import byte_tokenizer, tiny_model

from serving.prompt_logprobs import bucket, prompt_logprobs
from tbjax.engine import Engine, EngineConfig
from tbjax.model import forward_dense

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "hf_moe")


def _want(spec, params, ids, k):
    logits, _ = jax.jit(lambda p, t: forward_dense(p, spec, t))(params, jnp.asarray(ids, jnp.int32))
    lp = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1))
    tok = [lp[t - 1, ids[t]] for t in range(1, len(ids))]
    top = [np.argsort(-lp[t - 1])[:k] for t in range(1, len(ids))]
    return tok, top, lp


def _check(got, spec, params, ids, k, atol=2e-4):
    tok, top, lp = _want(spec, params, ids, k)
    assert got[0] is None and len(got) == len(ids)
    np.testing.assert_allclose([g[0] for g in got[1:]], tok, atol=atol)
    for t, (g, want_top) in enumerate(zip(got[1:], top)):
        assert len(g[1]) == k
        np.testing.assert_allclose([v for _, v in g[1]], lp[t, want_top], atol=atol)
        assert [i for i, _ in g[1]][:1] == list(want_top[:1])


@pytest.mark.parametrize("cfg", [dict(layer_buffers="stacked"), dict(layer_buffers="split"), dict(mesh="dp=2"),
                                 dict(mesh="dp=4,ep=2")], ids=["stacked", "split", "dp2", "dp4xep2"])
def test_prompt_logprobs_equal_a_dense_forward(cfg):
    spec, params = tiny_model()
    eng = Engine(spec, params, byte_tokenizer(), EngineConfig(num_pages=32, max_num_seqs=4, max_num_batched_tokens=32,
                                                              **cfg))
    rng = np.random.default_rng(0)
    for n in (2, 13, 40):                       # buckets 16, 16, 64
        ids = [int(t) for t in rng.integers(0, spec.vocab_size, n)]
        _check(prompt_logprobs(eng, ids, 3), spec, params, ids, 3)
    assert prompt_logprobs(eng, [5], 2) == [None]
    assert bucket(13) == 16 and bucket(40) == 64 and bucket(40, cap=48) == 48


def test_prompt_logprobs_moe_on_a_mesh():
    from tbjax.weights.hf_names_moe import load_hf
    spec, params, _ = load_hf(os.path.join(DATA, "mixtral"), dtype=jnp.float32)
    eng = Engine(spec, params, byte_tokenizer(), EngineConfig(num_pages=24, page_size=4, max_num_seqs=8,
                                                              max_num_batched_tokens=32, mesh="dp=2,ep=2"))
    ids = [int(t) for t in np.random.default_rng(1).integers(0, spec.vocab_size, 11)]
    _check(prompt_logprobs(eng, ids, 2), spec, params, ids, 2)


def test_echo_logprobs_over_http_through_the_engine_loop():
    from openai import OpenAI

    from serving.model import ServedModel
    from serving.server import ServerThread
    from tbjax.sampling import SamplingParams
    spec, params = tiny_model()
    tok = byte_tokenizer()
    eng = Engine(spec, params, tok, EngineConfig(num_pages=32, max_num_seqs=4, max_num_batched_tokens=32))
    model = ServedModel("tiny", spec.arch, tok, spec.vocab_size, 512, (), SamplingParams, eng)
    ids = [7, 8, 9, 10, 11]
    with ServerThread(model, metrics_port=None, http_port=0) as st:
        oa = OpenAI(base_url=st.server.http_url + "/v1", api_key="-", max_retries=0, timeout=120)
        r = oa.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    want, _, _ = _want(spec, params, ids, 2)
    np.testing.assert_allclose(lp.token_logprobs[1:5], want, atol=2e-4)
    assert len(lp.tokens) == 6 and r.usage.completion_tokens == 1 and len(lp.top_logprobs[1]) >= 2
