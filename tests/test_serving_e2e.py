"""End to end with the real default model (SmolLM2-135M-Instruct) over real gRPC on loopback, on CPU:
streamed greedy output equals `tbjax.LLM` offline output (token ids and text), for plain prompts, token-id
prompts, chat, seeded sampling, stop strings and logprobs; the bad-input table gets its statuses from the
real model's limits; the server keeps serving and every KV page comes back."""
import threading
import time

import grpc
import pytest

from serving.client import Client
from serving.limits import Limits
from serving.model import DEFAULT_MODEL_NAME, ServedModel
from serving.server import ServerThread
from serving.testing import BAD_REQUESTS, kv_pages_all_free, raw_generate

import tbjax
from tbjax.sampling import SamplingParams

MAX_MSG = 1 << 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name three colours."}]
N_TOK = 12


@pytest.fixture(scope="module")
def served():
    llm = tbjax.LLM(progress=False, max_num_seqs=8, max_num_batched_tokens=256, num_pages=256)
    # offline references first: the engine belongs to this thread until the server takes it over
    ref = {
        "greedy": llm.generate(PROMPTS, SamplingParams.greedy(N_TOK)),
        "chat": llm.chat(CHAT, SamplingParams.greedy(N_TOK)),
        "seeded": llm.generate(PROMPTS[2], SamplingParams(max_tokens=N_TOK, temperature=0.8, top_p=0.9, seed=7))[0],
        "stop": llm.generate(PROMPTS[0], SamplingParams.greedy(N_TOK, stop=[" ", ","]))[0],
        "logprobs": llm.generate(PROMPTS[1], SamplingParams.greedy(6, logprobs=3))[0],
    }
    st = ServerThread(ServedModel.from_llm(llm), limits=Limits(max_message_bytes=MAX_MSG), metrics_port=None).start()
    with Client(st.address, timeout=300) as c:
        yield llm, ref, st, c
    st.stop()


def test_streamed_greedy_equals_offline_concurrently(served):
    llm, ref, st, c = served
    got = [None] * len(PROMPTS)

    def run(i):
        got[i] = list(c.generate_stream(PROMPTS[i], max_tokens=N_TOK, temperature=0))

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    for chunks, want in zip(got, ref["greedy"]):
        assert [t for ch in chunks for t in ch.token_ids] == want.token_ids
        assert "".join(ch.text for ch in chunks) == want.text
        assert chunks[-1].finish_reason == want.finish_reason
        assert chunks[-1].prompt_tokens == len(want.prompt_token_ids)
        assert len(chunks) >= 2   # it streams


def test_token_id_prompt_equals_offline(served):
    llm, ref, st, c = served
    want = ref["greedy"][1]
    got = c.generate(token_ids=want.prompt_token_ids, max_tokens=N_TOK, temperature=0)
    assert got.token_ids == want.token_ids and got.text == want.text


def test_chat_equals_offline(served):
    llm, ref, st, c = served
    got = c.generate(messages=CHAT, max_tokens=N_TOK, temperature=0)
    assert got.token_ids == ref["chat"].token_ids and got.text == ref["chat"].text
    tok = llm.tokenizer
    assert c.tokenize(messages=CHAT) == tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True),
                                                   add_special_tokens=False)


def test_seeded_sampling_stop_strings_and_logprobs_equal_offline(served):
    llm, ref, st, c = served
    got = c.generate(PROMPTS[2], max_tokens=N_TOK, temperature=0.8, top_p=0.9, seed=7)
    assert got.token_ids == ref["seeded"].token_ids
    got = c.generate(PROMPTS[0], max_tokens=N_TOK, temperature=0, stop=[" ", ","])
    assert (got.text, got.finish_reason) == (ref["stop"].text, ref["stop"].finish_reason)
    got = c.generate(PROMPTS[1], max_tokens=6, temperature=0, logprobs=3)
    want = ref["logprobs"]
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(want.logprobs) == 6
    for (tok, lp, top), (wlp, wtop) in zip(got.logprobs, want.logprobs):
        assert lp == pytest.approx(wlp, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in wtop]
        assert [v for _, v in top] == pytest.approx([v for _, v in wtop], abs=1e-4)


def test_model_info_is_the_default_model(served):
    llm, ref, st, c = served
    info = c.model_info()
    assert info["model"] == DEFAULT_MODEL_NAME and info["arch"] == llm.spec.arch
    assert info["vocab_size"] == llm.spec.vocab_size and info["has_chat_template"]
    assert info["max_context"] == llm.engine.max_model_len


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[b.name for b in BAD_REQUESTS])
def test_bad_input_with_real_model(served, case):
    llm, ref, st, c = served
    info = dict(c.model_info(), _max_message_bytes=MAX_MSG)
    req = case.make(info)
    with pytest.raises(grpc.RpcError) as e:
        if isinstance(req, bytes):
            raw_generate(c.channel, req)
        else:
            list(c.generate_call(req, timeout=60))
    assert e.value.code() == case.code, (e.value.code(), e.value.details())
    assert case.must_mention.lower() in (e.value.details() or "").lower(), e.value.details()
    want = ref["greedy"][0]
    got = c.generate(token_ids=want.prompt_token_ids, max_tokens=2, temperature=0)
    assert got.token_ids == want.token_ids[:2]


def test_cancel_mid_stream_frees_pages(served):
    llm, ref, st, c = served
    stream = c.generate_stream(PROMPTS[2], max_tokens=200, temperature=0, ignore_eos=True)
    next(stream), next(stream)
    stream.close()
    for _ in range(500):
        r = None
        try:
            r = st.server.engine_loop.call(kv_pages_all_free).result(60)
        except AssertionError:
            pass
        if r and r["all_free"]:
            break
        time.sleep(0.02)
    assert r and r["all_free"], r
