"""The Python API on the real default model: logprobs against a whole-sequence forward, stop strings and ids,
chat, seeded sampling, and fp8 KV against bf16."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tbjax.model import forward_dense
from tbjax.sampling import SamplingParams


def test_generate_text_ids_and_logprobs(smollm_llm, hf_ref):
    meta, _ = hf_ref
    out = smollm_llm.generate("The capital of France is", SamplingParams.greedy(8, logprobs=3, ignore_eos=True))[0]
    assert out.token_ids == meta["greedy"][0][:8]
    assert out.text == smollm_llm.tokenizer.decode(meta["greedy"][0][:8])
    assert out.finish_reason == "length" and len(out.logprobs) == 8
    # reference: log_softmax of a whole-sequence forward (no cache) at each generated position
    spec, params = smollm_llm.spec, smollm_llm.params
    ids = meta["prompt_ids"][0] + out.token_ids
    lg = np.asarray(jax.jit(lambda p, t: forward_dense(p, spec, t)[0])(params, jnp.asarray(ids)), np.float64)
    n = len(meta["prompt_ids"][0])
    for j, (chosen_lp, top) in enumerate(out.logprobs):
        row = lg[n - 1 + j]
        ref = row - (np.log(np.exp(row - row.max()).sum()) + row.max())
        assert abs(chosen_lp - ref[out.token_ids[j]]) < 2e-3
        assert [t for t, _ in top] == list(np.argsort(-ref)[:3])


def test_stop_strings_and_stop_ids(smollm_llm, hf_ref):
    meta, _ = hf_ref
    full = smollm_llm.tokenizer.decode(meta["greedy"][0])           # " Paris.\n\nThe answer is: ..."
    out = smollm_llm.generate("The capital of France is", SamplingParams.greedy(40, stop=["answer"]))[0]
    assert out.finish_reason == "stop" and out.text == full[: full.index("answer")]
    stop_id = meta["greedy"][0][3]
    out = smollm_llm.generate("The capital of France is", SamplingParams.greedy(40, stop_token_ids=[stop_id]))[0]
    g = meta["greedy"][0]
    assert out.finish_reason == "stop" and out.token_ids == g[: g.index(stop_id) + 1]


def test_chat_uses_the_template_and_stops_at_eos(smollm_llm, hf_ref):
    meta, _ = hf_ref
    tok = smollm_llm.tokenizer
    c = smollm_llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams.greedy(24))
    # the same prompt as the reference's chat-formatted prompt 3 (with the default system message added)
    assert c.finish_reason in ("stop", "length") and c.text.strip()
    if c.finish_reason == "stop":
        assert c.token_ids[-1] in tok.eos_token_ids and "<|im_end|>" not in c.text


def test_seeded_sampling_reproducible(smollm_llm):
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    a = smollm_llm.generate(["Tell me a story", "List three fruits"], p)
    b = smollm_llm.generate(["List three fruits"], p)                # alone, and in another batch position
    assert a[1].token_ids == b[0].token_ids
    c = smollm_llm.generate(["List three fruits"], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95,
                                                                  seed=99, ignore_eos=True))
    assert c[0].token_ids != b[0].token_ids


def test_bad_inputs_name_the_problem(smollm_llm):
    with pytest.raises(ValueError, match="empty prompt"):
        smollm_llm.generate("")
    with pytest.raises(ValueError, match="top_p"):
        smollm_llm.generate("hi", SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="out of vocabulary"):
        smollm_llm.generate([[1, 2, 10**6]])
    assert not smollm_llm.engine.has_unfinished()
