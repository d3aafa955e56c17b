"""The HTTP API over the real default model (float32, the shared small engine of tests/conftest.py) at its default
sampling settings (the model card's temperature 0.2 / top_p 0.9): the same request through HTTP and gRPC gives the
same tokens (greedy and seeded), greedy output equals transformers' reference, streaming equals non-streaming, and
the prompt logprobs of echo (a whole-sequence forward) equal the engine's own logprobs of the same tokens."""
import numpy as np
import pytest
from openai import OpenAI

from serving.client import Client
from serving.model import ServedModel
from serving.server import ServerThread
from tbjax.weights import load_generation_defaults

Q = [{"role": "user", "content": "What is the capital of Japan?"}]


@pytest.fixture(scope="module")
def real(smollm_llm):
    model = ServedModel.from_llm(smollm_llm)
    defaults = load_generation_defaults(None)                  # what `python -m tbjax.serve` serves it with
    model.make_params, model.generation_defaults = defaults.make_params, defaults
    st = ServerThread(model, metrics_port=None, http_port=0).start()
    with Client(st.address, timeout=300) as c:
        yield st, OpenAI(base_url=st.server.http_url + "/v1", api_key="-", max_retries=0, timeout=300), c
    st.stop()


def test_same_tokens_through_http_and_grpc(real, hf_ref):
    st, oa, c = real
    meta, _ = hf_ref
    tok = st.server.model.tokenizer
    prompt = meta["prompts"][0]
    g = c.generate(prompt, max_tokens=8, temperature=0)
    h = oa.completions.create(model=st.server.model.name, prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
    assert g.token_ids == meta["greedy"][0][:8]                      # transformers' greedy continuation
    assert h.choices[0].text == tok.decode(g.token_ids) and h.choices[0].logprobs.tokens == \
        [tok.decode([t], skip_special_tokens=False) for t in g.token_ids]
    for seed in (1, 2):     # sampled at the model's defaults (no temperature / top_p given), same seed: same tokens
        g = c.generate(messages=Q, max_tokens=12, seed=seed)
        h = oa.chat.completions.create(model=st.server.model.name, messages=Q, max_tokens=12, seed=seed,
                                       logprobs=True)
        assert [x.token for x in h.choices[0].logprobs.content] == \
            [tok.decode([t], skip_special_tokens=False) for t in g.token_ids]
        assert h.choices[0].message.content == tok.decode(g.token_ids) and "Tokyo" in g.text
        assert h.choices[0].finish_reason == g.finish_reason


def test_streaming_equals_non_streaming_greedy(real):
    st, oa, _ = real
    kw = dict(model=st.server.model.name, messages=Q, max_tokens=16, temperature=0)
    whole = oa.chat.completions.create(**kw).choices[0]
    chunks = list(oa.chat.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert "Tokyo" in whole.message.content


def test_echo_prompt_logprobs_equal_the_engines(real, smollm_llm):
    """lm-eval's loglikelihood: score a continuation with echo + logprobs. The dense forward's prompt logprobs of
    the greedy continuation equal the engine's own logprobs of those tokens (float32), and each is the top one."""
    st, oa, c = real
    ids = st.server.model.tokenizer.encode("The capital of France is")
    g = c.generate(token_ids=ids, max_tokens=6, temperature=0, logprobs=1)
    engine_lps = [lp for _, lp, _ in g.logprobs]
    r = oa.completions.create(model=st.server.model.name, prompt=ids + g.token_ids, max_tokens=0, echo=True,
                              logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 6
    np.testing.assert_allclose(lp.token_logprobs[len(ids):], engine_lps, atol=2e-3)
    assert all(abs(max(t.values()) - v) < 1e-6 for t, v in zip(lp.top_logprobs[len(ids):], lp.token_logprobs[len(ids):]))
    assert all(v <= 0 for v in lp.token_logprobs[1:])
