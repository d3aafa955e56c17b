"""The OpenAI-compatible HTTP front end (serving/http_api.py) driven by the official `openai` client, over the fake
engine (serving.fake_engine: real scheduler and pages, a toy next-token hash that `reference` computes on its own).

Covers: models list, health, metrics, completions and chat equal to the reference, streaming equal to non-streaming
under greedy ([DONE], include_usage), logprobs and echo (prompt logprobs, lm-eval's loglikelihood request), stop
strings, max_tokens -> length, n > 1 (seeded choices, shared prompt pages), bad parameters and unsupported fields ->
400, unknown model -> 404, overload -> 429, warming up and draining -> 503, a client that goes away frees its pages,
the same tokens as gRPC, one log line per request, the model's sampling defaults, the CLI's --http-port.
"""
import json
import logging
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from openai import OpenAI

from serving.client import Client
from serving.fake_engine import VOCAB, FakeEngine, fake_served_model, reference
from serving.limits import Limits
from serving.server import ServerThread
from serving.testing import wait_kv_pages_all_free
from tbjax.weights.generation_config import GenerationDefaults

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"}]
IGN = {"ignore_eos": True}   # an extension field: the openai client sends it through extra_body


def _client(st, **kw) -> OpenAI:
    return OpenAI(base_url=st.server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)


@pytest.fixture(scope="module")
def fast():
    st = ServerThread(fake_served_model(step_time_s=0.001, num_pages=1024), metrics_port=None, http_port=0).start()
    with Client(st.address, timeout=30) as c:
        yield st, _client(st), c
    st.stop()


def _get(url, timeout=10):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _post_raw(url, body: bytes, timeout=30):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_models_health_metrics(fast):
    st, oa, _ = fast
    models = oa.models.list().data
    assert [m.id for m in models] == ["fake"] and models[0].owned_by == "tbjax"
    assert oa.models.retrieve("fake").id == "fake"
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("other")
    assert _get(st.server.http_url + "/health") == (200, '{"status":"ok"}')
    oa.completions.create(model="fake", prompt=[30, 31], max_tokens=3, temperature=0)
    code, text = _get(st.server.http_url + "/metrics")
    assert code == 200 and 'tbjax_requests_total{model_name="fake",outcome="length"}' in text
    assert 'tbjax_time_to_first_token_seconds_count{model_name="fake"}' in text
    code, body = _get(st.server.http_url + "/v1/nothing")
    assert code == 404 and json.loads(body)["error"]["message"].startswith("no route")


def test_completion_and_chat_equal_the_reference(fast):
    st, oa, _ = fast
    tok = st.server.model.tokenizer
    r = oa.completions.create(model="fake", prompt="Once upon", max_tokens=12, temperature=0, extra_body=IGN)
    want, _ = reference(tok.encode("Once upon"), 12, ignore_eos=True)
    assert r.choices[0].text == tok.decode(want) and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (9, 12, 21)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "fake"
    r = oa.completions.create(model="fake", prompt=[40, 41, 42], max_tokens=5, temperature=0, extra_body={"top_k": 5})
    assert r.choices[0].text == tok.decode(reference([40, 41, 42], 5)[0])
    ids = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True))
    r = oa.chat.completions.create(model="fake", messages=CHAT, max_completion_tokens=9, temperature=0)
    want, reason = reference(ids, 9)
    assert r.choices[0].message.content == tok.decode(want) and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == reason and r.usage.prompt_tokens == len(ids)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    # text parts and the developer role (rendered as system)
    r2 = oa.chat.completions.create(model="fake", max_tokens=9, temperature=0, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "héllo"}]}])
    assert r2.choices[0].message.content == r.choices[0].message.content


def test_batch_prompts_and_n_choices(fast):
    st, oa, _ = fast
    tok = st.server.model.tokenizer
    r = oa.completions.create(model="fake", prompt=[[30, 31], [40, 41, 42]], max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [tok.decode(reference(p, 6)[0]) for p in ([30, 31], [40, 41, 42])]
    assert r.usage.prompt_tokens == 5
    r = oa.completions.create(model="fake", prompt=[50, 51], max_tokens=8, n=3, seed=7, temperature=0.8,
                              extra_body=IGN)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [tok.decode(reference([50, 51], 8, seed=7 + i, ignore_eos=True)[0])
                                           for i in range(3)]   # choice i samples with seed + i
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 24
    r = oa.chat.completions.create(model="fake", messages=CHAT, max_tokens=4, n=2, temperature=0)
    assert len(r.choices) == 2 and r.choices[0].message.content == r.choices[1].message.content


def test_n_choices_share_the_prompt_pages():
    """n = 4 completions of a 64-token prompt (16 pages of 4): handed to the engine in one command, the prefix cache
    keeps one copy of the prompt's pages while the four decode."""
    model = fake_served_model(step_time_s=0.01, num_pages=256, page_size=4)
    with ServerThread(model, metrics_port=None, http_port=0) as st:
        oa = _client(st)
        prompt = [3 + (i * 7) % 250 for i in range(64)]
        stream = oa.completions.create(model="fake", prompt=prompt, max_tokens=100, n=4, temperature=0,
                                       extra_body=IGN, stream=True)
        got = {}
        used = None
        for ch in stream:
            for c in ch.choices:
                got[c.index] = got.get(c.index, "") + c.text
            if used is None and len(got) == 4 and min(len(t) for t in got.values()) >= 8:
                used = st.server.engine_loop.call(lambda e: e.scheduler.stats()["pages_used"]).result(10)
        want = st.server.model.tokenizer.decode(reference(prompt, 100, ignore_eos=True)[0])
        assert got == {i: want for i in range(4)}
        assert used is not None and used < 16 + 4 * 6, used    # one prompt copy + each one's own decode pages
        wait_kv_pages_all_free(st)


def _sse_events(url, body: dict):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        lines = [ln.decode().rstrip("\n") for ln in r]
    events = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and all(ln == "" or ln.startswith("data: ") for ln in lines)
    return [json.loads(e) for e in events[:-1]]


def test_streaming_equals_non_streaming_under_greedy(fast):
    st, oa, _ = fast
    whole = oa.completions.create(model="fake", prompt="Hello", max_tokens=40, temperature=0, extra_body=IGN)
    chunks = list(oa.completions.create(model="fake", prompt="Hello", max_tokens=40, temperature=0, extra_body=IGN,
                                        stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40    # include_usage: a last chunk
    assert all(c.usage is None for c in chunks[:-1])
    whole = oa.chat.completions.create(model="fake", messages=CHAT, max_tokens=30, temperature=0)
    chunks = list(oa.chat.completions.create(model="fake", messages=CHAT, max_tokens=30, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    # the wire: data: lines, [DONE] last
    ev = _sse_events(st.server.http_url + "/v1/chat/completions",
                     {"messages": CHAT, "max_tokens": 5, "temperature": 0, "stream": True})
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # n = 2 streams interleave their chunks by index
    chunks = list(oa.completions.create(model="fake", prompt=[60, 61], max_tokens=10, n=2, seed=3, temperature=1,
                                        stream=True, extra_body=IGN))
    tok = st.server.model.tokenizer
    for i in range(2):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == \
            tok.decode(reference([60, 61], 10, seed=3 + i, ignore_eos=True)[0])


def test_logprobs_and_echo(fast):
    st, oa, _ = fast
    tok = st.server.model.tokenizer
    ids = [40, 41, 42]
    want, _ = reference(ids, 6, ignore_eos=True)
    r = oa.completions.create(model="fake", prompt=ids, max_tokens=6, temperature=0, extra_body=IGN, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in want] and lp.token_logprobs == [-0.5] * 6
    for t, top in zip(want, lp.top_logprobs):   # the fake: t at -0.5, t + 1 at -2: top-2 (the sampled one is in it)
        assert top == {tok.decode([t]): -0.5, tok.decode([(t + 1) % VOCAB]): -2.0}
    assert lp.text_offset == list(range(6))
    r = oa.chat.completions.create(model="fake", messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                   top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content and len(content) == 4
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token and c.logprob == -0.5
               and c.bytes == list(c.token.encode()) for c in content)
    r = oa.chat.completions.create(model="fake", messages=CHAT, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None
    # echo: the prompt's text before the completion
    r = oa.completions.create(model="fake", prompt="Hi there", max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text == "Hi there" + tok.decode(reference(tok.encode("Hi there"), 5)[0])
    # lm-eval's loglikelihood request: token ids, echo, logprobs=1, max_tokens=1; its score is token_logprobs[n:-1]
    ctx, cont = [40, 41], [42, 43]
    r = oa.completions.create(model="fake", prompt=ctx + cont, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:4] == [-0.5] * 3
    assert [max(t.values()) for t in lp.top_logprobs[2:4]] == lp.token_logprobs[2:4]   # each is the greedy one
    assert lp.tokens[:4] == [tok.decode([t]) for t in ctx + cont]
    # max_tokens 0: the prompt's logprobs only, nothing generated
    r = oa.completions.create(model="fake", prompt=ctx + cont, max_tokens=0, echo=True, logprobs=0)
    assert r.choices[0].text == tok.decode(ctx + cont) and r.usage.completion_tokens == 0
    assert r.choices[0].logprobs.top_logprobs[1] == {tok.decode([41]): -0.5}   # logprobs 0: the token's own only
    chunks = list(oa.completions.create(model="fake", prompt=ctx + cont, max_tokens=0, echo=True, logprobs=1,
                                        stream=True))
    assert chunks[0].choices[0].text == tok.decode(ctx + cont) and chunks[-1].choices[0].finish_reason == "length"
    assert chunks[0].choices[0].logprobs.token_logprobs == [None, -0.5, -0.5, -0.5]


def test_stop_strings_and_length(fast):
    st, oa, _ = fast
    tok = st.server.model.tokenizer
    want = tok.decode(reference([70, 71], 60, ignore_eos=True)[0])
    stop = want[20:22]
    r = oa.completions.create(model="fake", prompt=[70, 71], max_tokens=60, temperature=0, extra_body=IGN, stop=stop)
    assert r.choices[0].text == want[:want.index(stop)] and r.choices[0].finish_reason == "stop"
    r = oa.completions.create(model="fake", prompt=[70, 71], max_tokens=60, temperature=0, extra_body=IGN,
                              stop=["\x00never", stop])
    assert r.choices[0].finish_reason == "stop"
    chunks = list(oa.completions.create(model="fake", prompt=[70, 71], max_tokens=60, temperature=0, extra_body=IGN,
                                        stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want[:want.index(stop)]
    r = oa.completions.create(model="fake", prompt=[70, 71], max_tokens=7, temperature=0, extra_body=IGN)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
    # a stop token id -> stop (the fake keeps its text; the engine leaves it out)
    ids = reference([70, 71], 60, ignore_eos=True)[0]
    k = next(i for i, t in enumerate(ids) if i >= 3 and t not in ids[:i])
    r = oa.completions.create(model="fake", prompt=[70, 71], max_tokens=60, temperature=0,
                              extra_body={"ignore_eos": True, "stop_token_ids": [ids[k]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k + 1
    assert r.choices[0].text.startswith(tok.decode(ids[:k]))


BAD = [
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "x", "max_tokens": -2}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 10 ** 12}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("completions", {"prompt": "x", "seed": -1}, "seed"),
    ("completions", {"prompt": "x", "min_p": 1.0}, "min_p"),
    ("completions", {"prompt": "x", "top_k": -5}, "top_k"),
    ("completions", {"prompt": "x", "stop": [1]}, "stop"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [1, "a"]}, "prompt"),
    ("completions", {"prompt": [1, 99999]}, "prompt"),
    ("completions", {}, "prompt"),
    ("completions", {"prompt": [5] * 600}, "prompt"),
    ("completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"prompt": "x", "frequency_penalty": 1}, "frequency_penalty"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
    ("completions", {"prompt": "x", "suffix": "end"}, "suffix"),
    ("completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("completions", {"prompt": "x", "mirostat": 2}, "mirostat"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
                          "max_completion_tokens": 6}, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{p}:{b}"[:60] for p, b, _ in BAD])
def test_bad_parameters_are_400_naming_them(fast, path, body, param):
    st, _, _ = fast
    code, text = _post_raw(f"{st.server.http_url}/v1/{path}", json.dumps(body).encode())
    assert code == 400, text
    err = json.loads(text)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and param in err["message"], err


def test_openai_client_errors(fast):
    st, oa, _ = fast
    with pytest.raises(openai.NotFoundError) as e:
        oa.completions.create(model="gpt-9", prompt="x")
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], temperature=-3)
    assert "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model="fake", prompt="x", extra_body={"repetition_penalty": 1.3})
    assert "repetition_penalty" in e.value.message
    code, text = _post_raw(st.server.http_url + "/v1/completions", b"{not json")
    assert code == 400 and "JSON" in json.loads(text)["error"]["message"]
    code, _ = _post_raw(st.server.http_url + "/v1/completions", b"x" * (5 << 20))
    assert code == 413
    wait_kv_pages_all_free(st)


def test_overload_is_429_and_counts_with_grpc():
    import concurrent.futures

    import grpc
    model = fake_served_model(step_time_s=0.01)
    lim = Limits(max_concurrent_requests=2, max_queued_requests=1)
    with ServerThread(model, metrics_port=None, http_port=0, limits=lim) as st, \
            Client(st.address, timeout=30) as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        oa = _client(st)
        stream = oa.completions.create(model="fake", prompt=[20, 21], max_tokens=300, n=2, extra_body=IGN,
                                       temperature=0, stream=True)
        next(iter(stream))              # 2 running: the next request waits in the queue (limit 1)...
        waiting = pool.submit(lambda: oa.completions.create(model="fake", prompt=[5], max_tokens=2, temperature=0))
        sv = st.server.servicer
        deadline = time.time() + 10
        while sv.num_queued != 1 and time.time() < deadline:
            time.sleep(0.01)
        assert sv.num_queued == 1 and sv.num_running == 2
        with pytest.raises(openai.RateLimitError) as e:   # ... and the one after it is refused
            oa.completions.create(model="fake", prompt="x", max_tokens=2)
        assert e.value.status_code == 429 and "busy" in e.value.message and "queue full" in e.value.message
        with pytest.raises(grpc.RpcError) as g:   # the same limit for gRPC
            c.generate(token_ids=[5], max_tokens=2)
        assert g.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not waiting.done()
        stream.close()                 # the client goes away: both requests are aborted, the waiting one runs
        assert waiting.result(30).choices[0].text
        wait_kv_pages_all_free(st)
        r = oa.completions.create(model="fake", prompt=[5], max_tokens=2, temperature=0)   # room again
        assert r.choices[0].text
        with pytest.raises(openai.RateLimitError):   # n over the running limit at once: never fits
            oa.completions.create(model="fake", prompt=[5], max_tokens=2, n=3)


def test_warming_up_is_503_then_200():
    st = ServerThread(fake_served_model(warmup_s=2.0), warmup=True, metrics_port=None, http_port=0)
    st.start(wait_ready=False)
    try:
        code, body = _get(st.server.http_url + "/health")
        assert code == 503 and "warming up" in json.loads(body)["error"]["message"]
        with pytest.raises(openai.InternalServerError) as e:
            _client(st).completions.create(model="fake", prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "not_ready"
        assert _client(st).models.list().data[0].id == "fake"     # answers while warming up
        st.wait_ready(30)
        assert _get(st.server.http_url + "/health")[0] == 200
        assert _client(st).completions.create(model="fake", prompt="x", max_tokens=2).choices[0].text
    finally:
        st.stop()


def test_drain_is_503_for_new_requests_running_ones_finish():
    st = ServerThread(fake_served_model(step_time_s=0.005), metrics_port=None, http_port=0).start()
    oa = _client(st)
    stream = oa.completions.create(model="fake", prompt=[20, 21], max_tokens=200, extra_body=IGN, temperature=0,
                                   stream=True)
    it = iter(stream)
    text = next(it).choices[0].text
    stopper = threading.Thread(target=st.stop, kwargs={"grace": 20})
    stopper.start()
    deadline = time.time() + 10
    while not st.server._stopping and time.time() < deadline:
        time.sleep(0.01)
    code, body = _get(st.server.http_url + "/health")
    assert code == 503 and json.loads(body)["error"]["code"] == "draining"
    with pytest.raises(openai.InternalServerError) as e:
        oa.completions.create(model="fake", prompt="x", max_tokens=2)
    assert e.value.status_code == 503
    text += "".join(c.choices[0].text for c in it)       # the running one completes
    assert text == st.server.model.tokenizer.decode(reference([20, 21], 200, ignore_eos=True)[0])
    stopper.join(30)
    assert not stopper.is_alive()


def test_client_going_away_frees_pages(fast):
    st, oa, _ = fast
    stream = oa.completions.create(model="fake", prompt=[20, 21], max_tokens=400, extra_body=IGN, stream=True)
    next(iter(stream))
    stream.close()
    wait_kv_pages_all_free(st)
    # non-streaming: a client that times out
    slow = fake_served_model(step_time_s=0.02)
    with ServerThread(slow, metrics_port=None, http_port=0) as st2:
        with pytest.raises(openai.APITimeoutError):
            _client(st2).with_options(timeout=0.5).completions.create(model="fake", prompt=[5], max_tokens=400,
                                                                     extra_body=IGN)
        wait_kv_pages_all_free(st2)


def test_same_tokens_as_grpc_and_a_log_line_per_request(fast, caplog):
    st, oa, c = fast
    tok = st.server.model.tokenizer
    for kw in (dict(temperature=0), dict(temperature=0.9, seed=5), dict(temperature=0.7, top_k=20, seed=9)):
        g = c.generate("Same request", max_tokens=20, **kw)
        extra = {"top_k": kw.pop("top_k")} if "top_k" in kw else {}
        h = oa.completions.create(model="fake", prompt="Same request", max_tokens=20, extra_body=extra, **kw)
        assert h.choices[0].text == tok.decode(g.token_ids) and h.choices[0].finish_reason == g.finish_reason
    g = c.generate(messages=CHAT, max_tokens=10, temperature=0)
    h = oa.chat.completions.create(model="fake", messages=CHAT, max_tokens=10, temperature=0)
    assert h.choices[0].message.content == tok.decode(g.token_ids)
    with caplog.at_level(logging.INFO, logger="tbjax.requests"):
        r = oa.completions.create(model="fake", prompt=[30, 31, 32], max_tokens=4, temperature=0)
        c.generate(token_ids=[30, 31], max_tokens=3, temperature=0)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "tbjax.requests"]
    assert any(ln.startswith(f"request {r.id} (http): 3 prompt + 4 output tokens, ttft ") and ln.endswith(
        "finish length") for ln in lines), lines
    assert any("(grpc): 2 prompt + 3 output tokens" in ln for ln in lines), lines


def _recording_fake(defaults):
    class Rec(FakeEngine):
        def add_request(self, rid, ids, params):
            self.seen.append(params)
            super().add_request(rid, ids, params)

    model = fake_served_model()
    model.engine = Rec()
    model.engine.seen = []
    model.make_params, model.generation_defaults = defaults.make_params, defaults
    return model


def test_grpc_and_http_fill_the_same_sampling_defaults_explicit_values_win():
    gd = GenerationDefaults(temperature=0.2, top_p=0.9, source="test")
    model = _recording_fake(gd)
    with ServerThread(model, metrics_port=None, http_port=0) as st, Client(st.address) as c:
        oa = _client(st)
        c.generate(token_ids=[20, 21], max_tokens=3)
        oa.completions.create(model="fake", prompt=[20, 21], max_tokens=3)
        oa.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        c.generate(token_ids=[20, 21], max_tokens=3, temperature=0.9, top_p=0.5)
        oa.completions.create(model="fake", prompt=[20, 21], max_tokens=3, temperature=0.9, top_p=0.5)
        assert oa.models.list().data[0].model_extra["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9}
    got = [(round(p.temperature, 4), round(p.top_p, 4)) for p in model.engine.seen]
    assert got == [(0.2, 0.9)] * 3 + [(0.9, 0.5)] * 2


def test_serve_cli_http_port_and_generation_config_flags(tmp_path, capsys):
    from serving import cli
    parse = cli.build_parser().parse_args
    assert cli.http_port(parse([])) == cli.DEFAULT_HTTP_PORT == 8000
    assert cli.http_port(parse(["--port", "0"])) == 0                 # any free port, as gRPC's
    assert cli.http_port(parse(["--http-port", "0"])) is None         # off
    assert cli.http_port(parse(["--http-port", "8123", "--port", "0"])) == 8123
    assert cli.http_port(parse(["--role", "prefill"])) is None        # workers serve no public API
    with pytest.raises(SystemExit):
        cli.main(["--http-port", "70000"])
    assert "--http-port must be in 0..65535" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--role", "decode", "--http-port", "8001"])
    assert "serves no HTTP API" in capsys.readouterr().err
    a = parse([])
    assert a.generation_config == "auto" and cli._generation_defaults(a).sampling() == {"temperature": 0.2,
                                                                                       "top_p": 0.9}
    assert cli._generation_defaults(parse(["--generation-config", "none"])).sampling() == {}
    f = tmp_path / "g.json"
    f.write_text('{"temperature": 0.4}')
    assert cli._generation_defaults(parse(["--generation-config", str(f)])).sampling() == {"temperature": 0.4}
    assert cli.main(["--generation-config", str(tmp_path / "nope.json")]) == 2
    assert "--generation-config" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [[], ["--engine-process"]], ids=["engine-thread", "engine-process"])
def test_serve_cli_serves_http_beside_grpc(extra):
    """`python -m tbjax.serve` (fake engine): its serving line names the HTTP address (any free port with --port 0);
    completions, echo with prompt logprobs (computed in the engine's process with --engine-process) and gRPC work;
    SIGTERM drains both and exits 0."""
    import os
    import re
    import signal
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.Popen([sys.executable, "-m", "tbjax.serve", "--fake-engine", "--port", "0", "--metrics-port", "-1",
                          "--log-level", "INFO", *extra], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        line = p.stdout.readline()
        m = re.search(r"on (\S+):(\d+) \(gRPC tbjax.v1\), OpenAI HTTP on (http://127\.0\.0\.1:\d+)/v1$", line.strip())
        assert m, (line, p.stderr.read() if p.poll() is not None else "")
        oa = OpenAI(base_url=m.group(3) + "/v1", api_key="-", max_retries=0, timeout=60)
        tok = fake_served_model().tokenizer
        r = oa.completions.create(model="fake", prompt=[40, 41, 42], max_tokens=5, temperature=0)
        assert r.choices[0].text == tok.decode(reference([40, 41, 42], 5)[0])
        r = oa.completions.create(model="fake", prompt=[40, 41, 42], max_tokens=0, echo=True, logprobs=2)
        assert r.choices[0].logprobs.token_logprobs == [None, -0.5, -0.5]
        with Client(f"127.0.0.1:{m.group(2)}", timeout=30) as c:
            assert c.generate(token_ids=[40, 41, 42], max_tokens=5, temperature=0).token_ids == \
                reference([40, 41, 42], 5)[0]
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
        err = p.stderr.read()
        assert "stopped" in err and re.search(r"tbjax.requests: request cmpl-\w+ \(http\): 3 prompt \+ 5 output", err)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_engine_refusal_is_400_and_engine_failure_500_or_an_error_chunk():
    class Crashing(FakeEngine):
        def step(self):
            if any(r.startswith("cmpl-") for r in self._req) and self.num_added >= 2:
                raise RuntimeError("device on fire")
            return super().step()

    model = fake_served_model(num_pages=8, page_size=4, max_model_len=512)
    with ServerThread(model, metrics_port=None, http_port=0) as st:
        with pytest.raises(openai.BadRequestError) as e:    # more pages than the engine has: refused by the engine
            _client(st).completions.create(model="fake", prompt=[5] * 200, max_tokens=2)
        assert "pages" in e.value.message or "fit" in e.value.message
    model = fake_served_model()
    model.engine = Crashing()
    with ServerThread(model, metrics_port=None, http_port=0) as st:
        oa = _client(st)
        assert oa.completions.create(model="fake", prompt=[5], max_tokens=2).choices[0].text   # the first is fine
        with pytest.raises(openai.InternalServerError) as e:
            oa.completions.create(model="fake", prompt=[5], max_tokens=2)
        assert e.value.status_code == 500 and "device on fire" in e.value.message
        with pytest.raises(openai.APIError) as e:      # streaming: the error arrives as a data: chunk
            list(oa.completions.create(model="fake", prompt=[5], max_tokens=2, stream=True))
        assert "device on fire" in str(e.value)
