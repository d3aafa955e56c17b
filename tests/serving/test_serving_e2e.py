"""End to end with the real default model (SmolLM2-135M-Instruct) over real gRPC on loopback, on CPU:
streamed greedy output equals `tbjax.LLM` offline output (token ids and text), for plain prompts, token-id
prompts, chat, seeded sampling, stop strings and logprobs; the bad-input table gets its statuses from the
real model's limits (and never reaches the engine); the server keeps serving; a cancelled stream's KV pages
come back. Everything is sent in one concurrent burst, both offline and served, to keep CPU time down."""
import threading
import time

import grpc
import pytest

from serving.client import Client
from serving.limits import Limits
from serving.model import DEFAULT_MODEL_NAME, ServedModel
from serving.server import ServerThread
from serving.testing import BAD_REQUESTS, raw_generate, wait_kv_pages_all_free

import tbjax
from tbjax.sampling import SamplingParams

MAX_MSG = 1 << 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name three colours."}]
N_TOK = 8


def _cases(tok):
    """(name, client kwargs, offline prompt, offline SamplingParams): all sent at once, offline and served."""
    chat_ids = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True), add_special_tokens=False)
    g = dict(max_tokens=N_TOK, temperature=0.0)
    return [
        ("greedy0", dict(prompt=PROMPTS[0], **g), PROMPTS[0], SamplingParams.greedy(N_TOK)),
        ("greedy1", dict(prompt=PROMPTS[1], **g), PROMPTS[1], SamplingParams.greedy(N_TOK)),
        ("token_ids", dict(token_ids=tok.encode(PROMPTS[2]), **g), PROMPTS[2], SamplingParams.greedy(N_TOK)),
        ("chat", dict(messages=CHAT, **g), chat_ids, SamplingParams.greedy(N_TOK)),
        ("seeded", dict(prompt=PROMPTS[2], max_tokens=N_TOK, temperature=0.8, top_p=0.9, seed=7), PROMPTS[2],
         SamplingParams(max_tokens=N_TOK, temperature=0.8, top_p=0.9, seed=7)),
        ("stop", dict(prompt=PROMPTS[0], stop=[" ", ","], **g), PROMPTS[0], SamplingParams.greedy(N_TOK, stop=[" ", ","])),
        ("logprobs", dict(prompt=PROMPTS[1], logprobs=3, **g), PROMPTS[1], SamplingParams.greedy(N_TOK, logprobs=3)),
    ]


@pytest.fixture(scope="module")
def served():
    llm = tbjax.LLM(progress=False, max_num_seqs=8, max_num_batched_tokens=256, num_pages=256)
    cases = _cases(llm.tokenizer)
    # offline references first, in one batch: the engine belongs to this thread until the server takes it over
    offline = llm.generate([c[2] for c in cases], [c[3] for c in cases])
    ref = {c[0]: o for c, o in zip(cases, offline)}
    st = ServerThread(ServedModel.from_llm(llm), limits=Limits(max_message_bytes=MAX_MSG), metrics_port=None).start()
    with Client(st.address, timeout=300) as c:
        yield llm, cases, ref, st, c
    st.stop()


def test_streamed_outputs_equal_offline(served):
    """Greedy (text, token ids, chat), seeded sampling, stop strings and logprobs, all streamed concurrently.
    The model computes in bf16, where a different batch composition may flip a near-tie, so the requests are
    let into the engine together and in the offline order (the engine thread is held until all are queued):
    the same batches as offline, over the whole gRPC path."""
    llm, cases, ref, st, c = served
    loop = st.server.engine_loop
    gate = threading.Event()
    held = loop.call(lambda e: gate.wait(60))
    got = {}

    def run(name, kw):
        got[name] = list(c.generate_stream(**kw))

    ts = []
    try:
        for name, kw, _, _ in cases:
            n = loop.inbox_size()
            ts.append(threading.Thread(target=run, args=(name, kw)))
            ts[-1].start()
            deadline = time.time() + 60
            while loop.inbox_size() == n and time.time() < deadline:   # this one is queued: next
                time.sleep(0.005)
    finally:
        gate.set()
    held.result(60)
    for t in ts:
        t.join(300)
    for name, kw, prompt, _ in cases:
        chunks, want = got[name], ref[name]
        assert [t for ch in chunks for t in ch.token_ids] == want.token_ids, name
        assert "".join(ch.text for ch in chunks) == want.text, name
        assert chunks[-1].finish_reason == want.finish_reason, name
        assert chunks[-1].prompt_tokens == len(want.prompt_token_ids), name
        if want.finish_reason == "length":
            assert len(chunks) >= 2 and chunks[-1].completion_tokens == N_TOK, name    # it streams
    lps = [lp for ch in got["logprobs"] for lp in (ch.logprobs or [])]
    assert len(lps) == len(ref["logprobs"].logprobs) == N_TOK
    for (tok, lp, top), (wlp, wtop) in zip(lps, ref["logprobs"].logprobs):
        assert lp == pytest.approx(wlp, abs=1e-5)
        assert [t for t, _ in top] == [t for t, _ in wtop]
        assert [v for _, v in top] == pytest.approx([v for _, v in wtop], abs=1e-5)
    assert ref["stop"].finish_reason == "stop"   # the stop case really stopped on a string


def test_tokenize_matches_the_chat_template(served):
    llm, cases, ref, st, c = served
    tok = llm.tokenizer
    assert c.tokenize(messages=CHAT) == tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True),
                                                   add_special_tokens=False)
    assert c.tokenize(PROMPTS[0]) == tok.encode(PROMPTS[0])


def test_model_info_is_the_default_model(served):
    llm, cases, ref, st, c = served
    info = c.model_info()
    assert info["model"] == DEFAULT_MODEL_NAME and info["arch"] == llm.spec.arch
    assert info["vocab_size"] == llm.spec.vocab_size and info["has_chat_template"]
    assert info["max_context"] == llm.engine.max_model_len


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[b.name for b in BAD_REQUESTS])
def test_bad_input_with_real_model(served, case):
    llm, cases, ref, st, c = served
    info = dict(c.model_info(), _max_message_bytes=MAX_MSG)
    req = case.make(info)
    added = st.server.engine_loop.call(lambda e: e.stats()["step"]).result(60)
    with pytest.raises(grpc.RpcError) as e:
        if isinstance(req, bytes):
            raw_generate(c.channel, req)
        else:
            list(c.generate_call(req, timeout=60))
    assert e.value.code() == case.code, (e.value.code(), e.value.details())
    assert case.must_mention.lower() in (e.value.details() or "").lower(), e.value.details()
    assert st.server.engine_loop.call(lambda e: e.stats()["step"]).result(60) == added   # the engine never ran
    assert c.tokenize(PROMPTS[0]) == llm.tokenizer.encode(PROMPTS[0])                    # still serving


def test_serves_after_the_bad_inputs_and_cancel_frees_pages(served):
    """Runs after the bad-input table: the engine still generates the right tokens; cancelling the stream
    frees its KV pages."""
    llm, cases, ref, st, c = served
    stream = c.generate_stream(PROMPTS[2], max_tokens=200, temperature=0, ignore_eos=True)
    first = [t for _ in range(2) for t in next(stream).token_ids]
    assert first == ref["token_ids"].token_ids[:2]
    stream.close()
    wait_kv_pages_all_free(st, timeout=30, call_timeout=60)


def test_short_soak_on_the_real_model(served, caplog):
    """The real model under a small mixed load: 36 concurrent streams of the three greedy prompts, a third of them
    cancelled after a few tokens or cut by a short deadline. Every stream that finishes has exactly the offline
    greedy tokens (the step is batch invariant), every page comes back, nothing is logged at ERROR."""
    import asyncio
    import logging
    import random

    from serving.api import method_path, pb
    caplog.set_level(logging.WARNING)
    llm, cases, ref, st, c = served
    want = {PROMPTS[0]: ref["greedy0"].token_ids, PROMPTS[1]: ref["greedy1"].token_ids}
    ids = {p: llm.tokenizer.encode(p) for p in want}

    async def one(stub, rng, i):
        p = rng.choice(list(want))
        req = pb.GenerateRequest(request_id=f"soak-{i}", params=pb.SamplingParams(max_tokens=N_TOK, temperature=0))
        req.prompt_token_ids.ids.extend(ids[p])
        mode = rng.random()
        await asyncio.sleep(rng.random() * 0.5)
        call = stub(req, timeout=0.05 + rng.random() * 0.3 if mode < 0.15 else 300)
        got = []
        try:
            async for r in call:
                got.extend(r.token_ids)
                if r.finish_reason:
                    assert got == want[p], (i, p, got)
                    return "completed"
                if 0.15 <= mode < 0.35 and len(got) >= 2:
                    call.cancel()
                    return "cancelled"
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and mode < 0.15:
                return "deadline"
            raise
        raise AssertionError(f"stream {i} ended without a finish reason")

    async def main():
        async with grpc.aio.insecure_channel(st.address) as ch:
            stub = ch.unary_stream(method_path("Generate"), request_serializer=pb.GenerateRequest.SerializeToString,
                                   response_deserializer=pb.GenerateResponse.FromString)
            rng = random.Random(2026)
            return await asyncio.gather(*[one(stub, random.Random(rng.random()), i) for i in range(36)])

    outcomes = asyncio.run(main())
    assert outcomes.count("completed") >= 18 and outcomes.count("cancelled") >= 3, outcomes
    wait_kv_pages_all_free(st, timeout=30, call_timeout=60)
    server_loggers = ("serving", "tbjax", "grpc", "uvicorn")       # the server's (not the test client's own loop)
    errors = [f"{x.name}: {x.getMessage()[:200]}" for x in caplog.records
              if x.levelno >= logging.ERROR and x.name.startswith(server_loggers)]
    assert not errors, errors
