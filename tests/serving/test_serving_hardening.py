"""Serving hardening (issue 18), against the fake engine: bounded request ids and error messages that never echo
unbounded input, a byte-length check before tokenizing, tokenizing off the event loop a few at a time, admission
limits that mean their names (running vs waiting), ModelInfo limits that really apply."""
import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from serving.api import pb
from serving.client import Client
from serving.fake_engine import FakeTokenizer, fake_served_model, reference
from serving.limits import Limits
from serving.server import ServerThread


def _post(url, body: dict, timeout=30):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server():
    st = ServerThread(fake_served_model(step_time_s=0.005), metrics_port=None, http_port=0,
                      limits=Limits(max_prompt_bytes=1000)).start()
    with Client(st.address, timeout=30) as c:
        yield st, c
    st.stop()


# -- request_id --------------------------------------------------------------------------------------------------
def test_request_id_bounded_and_never_echoed(server):
    st, c = server
    for rid in ("Q" * 257, "é" * 129, "Z" * 1_000_000):        # 257 / 258 / 1e6 bytes
        with pytest.raises(grpc.RpcError) as e:
            c.generate(token_ids=[5], max_tokens=2, request_id=rid)
        d = e.value.details()
        n = len(rid.encode())
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, d
        assert "request_id" in d and "256" in d and str(n) in d, d
        assert rid[:16] not in d and len(d) < 200, d
    ok = c.generate(token_ids=[5, 6], max_tokens=3, temperature=0, request_id="r" * 256)   # at the limit: fine
    assert ok.token_ids == reference([5, 6], 3)[0]


def test_duplicate_long_request_id_is_already_exists_with_a_short_message(server):
    st, c = server
    rid = "D" * 256
    s = c.generate_stream(token_ids=[9], max_tokens=400, ignore_eos=True, request_id=rid)
    next(s)
    try:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(token_ids=[9], max_tokens=2, request_id=rid)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert rid not in e.value.details() and len(e.value.details()) < 200, e.value.details()
    finally:
        s.close()


def test_messages_never_echo_unbounded_input(server):
    st, c = server
    big = "m" * 20_000
    with pytest.raises(grpc.RpcError) as e:
        c.generate("hi", max_tokens=2, model=big)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and len(e.value.details()) < 300, len(e.value.details())
    url = st.server.http_url
    for body in ({"model": big, "prompt": "x"}, {"prompt": "x", big: 1}, {"prompt": "x", "max_tokens": big},
                 {"prompt": "x", "stop": [1] * 20_000}, {"prompt": "x", "temperature": [big]},
                 {"prompt": "x", "user": {big: big}}, {"prompt": [big, 3]}):
        code, out = _post(url + "/v1/completions", body)
        assert code in (400, 404), (code, out)
        assert len(out["error"]["message"]) < 400, out["error"]["message"][:500]
    code, out = _post(url + "/v1/chat/completions", {"messages": [{"role": big, "content": "x"}]})
    assert code == 400 and len(out["error"]["message"]) < 400
    code, out = _post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x", big: 1}]})
    assert code == 400 and len(out["error"]["message"]) < 400
    req = urllib.request.Request(url + "/v1/models/" + big)
    with pytest.raises(urllib.error.HTTPError) as h:
        urllib.request.urlopen(req, timeout=30)
    assert h.value.code == 404 and len(json.loads(h.value.read())["error"]["message"]) < 400


# -- prompt bytes before tokenizing ---------------------------------------------------------------------------
class CountingTokenizer(FakeTokenizer):
    def __init__(self, delay_s: float = 0.0):
        self.calls = 0
        self.active = 0
        self.max_active = 0
        self.threads = set()
        self.delay_s = delay_s
        self._lock = threading.Lock()

    def encode(self, text, add_special_tokens=True):
        with self._lock:
            self.calls += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.threads.add(threading.current_thread().name)
        try:
            time.sleep(self.delay_s)
            return super().encode(text, add_special_tokens)
        finally:
            with self._lock:
                self.active -= 1


def _counting_server(delay_s=0.0, **limits):
    model = fake_served_model(step_time_s=0.0)
    tok = CountingTokenizer(delay_s)
    model.tokenizer = tok
    model.engine.tokenizer = tok
    st = ServerThread(model, metrics_port=None, http_port=0, limits=Limits(**limits))
    return st, tok


def test_prompt_bytes_checked_before_tokenizing():
    st, tok = _counting_server(max_prompt_bytes=400)
    with st, Client(st.address, timeout=30) as c:
        for prompt, what in (("a" * 401, "401"), ("é" * 201, "402")):       # bytes, not characters
            with pytest.raises(grpc.RpcError) as e:
                c.generate(prompt, max_tokens=2)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "400" in e.value.details() and what in e.value.details() and "bytes" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:     # a chat: its contents together
            c.generate(messages=[{"role": "user", "content": "b" * 300}, {"role": "user", "content": "c" * 300}],
                       max_tokens=2)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "400" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.tokenize("t" * 2000)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "400" in e.value.details()
        url = st.server.http_url
        code, out = _post(url + "/v1/completions", {"prompt": "a" * 401, "max_tokens": 2})
        assert code == 400 and "400" in out["error"]["message"] and out["error"]["param"] == "prompt"
        code, out = _post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 401}]})
        assert code == 400 and "400" in out["error"]["message"]
        assert tok.calls == 0                       # none of them reached the tokenizer
        assert c.generate("a" * 400, max_tokens=2).completion_tokens == 2   # at the limit: tokenized and served
        assert tok.calls == 1


def test_default_prompt_bytes_limit_follows_the_token_limit():
    lim = Limits(max_prompt_tokens=10_000)
    assert lim.prompt_bytes_limit(1 << 20) == 32 * 10_000
    assert Limits(max_prompt_tokens=10).prompt_bytes_limit(512) == 64 << 10    # never below 64 KiB
    assert Limits(max_prompt_bytes=123).prompt_bytes_limit(512) == 123


def test_tokenizing_is_off_the_loop_and_bounded():
    # 1 s per tokenize: a request stuck behind them would take >= 1 s; "answered at once" gets half of that (2 busy
    # cores, 3 test workers)
    st, tok = _counting_server(delay_s=1.0, max_tokenize_concurrency=2)
    with st, Client(st.address, timeout=30) as c:
        results = []

        def slow(i):
            results.append(c.generate(f"slow prompt {i}", max_tokens=2).completion_tokens)

        threads = [threading.Thread(target=slow, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.1)
        t0 = time.perf_counter()       # token ids need no tokenizer: answered while the slow ones tokenize
        got = c.generate(token_ids=[5, 6], max_tokens=2, temperature=0)
        fast = time.perf_counter() - t0
        for t in threads:
            t.join(30)
        assert got.token_ids == reference([5, 6], 2)[0]
        assert fast < 0.5, fast
        assert results == [2, 2, 2, 2]
        assert tok.max_active == 2, tok.max_active            # the semaphore: at most 2 at once
        assert "tbjax-grpc" not in tok.threads, tok.threads   # never on the server's event loop thread
        tok.max_active = 0                 # HTTP shares the same semaphore
        codes = []
        threads = [threading.Thread(target=lambda i=i: codes.append(_post(
            st.server.http_url + "/v1/completions", {"prompt": f"http prompt {i}", "max_tokens": 2})[0]))
            for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert codes == [200] * 4 and tok.max_active == 2, (codes, tok.max_active)
        assert "tbjax-grpc" not in tok.threads


# -- admission limits ------------------------------------------------------------------------------------------
async def _counts(sv):
    return sv.num_running, sv.num_queued


def test_limits_4_4_admit_4_running_and_4_waiting():
    model = fake_served_model(step_time_s=0.01)
    lim = Limits(max_concurrent_requests=4, max_queued_requests=4)
    with ServerThread(model, metrics_port=None, limits=lim) as st, Client(st.address, timeout=30) as c:
        sv = st.server.servicer
        running = [c.generate_stream(token_ids=[5 + i], max_tokens=400, ignore_eos=True) for i in range(4)]
        for s in running:
            next(s)
        waiting = [c.generate_call(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[30 + i]),
                                                      params=pb.SamplingParams(max_tokens=3, temperature=0)))
                   for i in range(4)]
        deadline = time.time() + 10
        while st.run_coro(_counts(sv)) != (4, 4) and time.time() < deadline:
            time.sleep(0.01)
        assert st.run_coro(_counts(sv)) == (4, 4)
        in_engine = st.server.engine_loop.call(lambda e: len(e._req)).result(10)
        assert in_engine == 4                       # the waiting ones wait in the server, not in the engine
        with pytest.raises(grpc.RpcError) as e:     # the ninth is refused
            c.generate(token_ids=[7], max_tokens=2)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in e.value.details()
        for s in running:                           # running places free up: the waiting ones run, oldest first
            s.close()
        for i, w in enumerate(waiting):
            assert [t for r in w for t in r.token_ids] == reference([30 + i], 3)[0]
        assert st.run_coro(_counts(sv)) == (0, 0)
        text = st.server.metrics.text()
        assert 'tbjax_requests_queued{model_name="fake"} 0.0' in text
        assert 'tbjax_requests_inflight{model_name="fake"} 0.0' in text


def test_waiting_request_cancelled_or_expired_leaves_the_queue():
    model = fake_served_model(step_time_s=0.01)
    lim = Limits(max_concurrent_requests=1, max_queued_requests=2)
    with ServerThread(model, metrics_port=None, limits=lim) as st, Client(st.address, timeout=30) as c:
        sv = st.server.servicer
        s = c.generate_stream(token_ids=[5], max_tokens=400, ignore_eos=True)
        next(s)
        with pytest.raises(grpc.RpcError) as e:      # waits, then its deadline passes
            c.generate(token_ids=[6], max_tokens=2, timeout=0.3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.time() + 5
        while st.run_coro(_counts(sv)) != (1, 0) and time.time() < deadline:
            time.sleep(0.01)
        assert st.run_coro(_counts(sv)) == (1, 0)
        s.close()
        assert c.generate(token_ids=[6], max_tokens=2, temperature=0).token_ids == reference([6], 2)[0]


# -- ModelInfo -------------------------------------------------------------------------------------------------
def test_model_info_reports_the_prompt_limit_the_kv_pool_allows():
    model = fake_served_model(num_pages=64, page_size=4, max_model_len=8192, max_num_batched_tokens=8192)
    with ServerThread(model, metrics_port=None, http_port=0) as st, Client(st.address, timeout=30) as c:
        info = c.model_info()
        assert info["max_context"] == 8192
        assert info["max_prompt_tokens"] == 63 * 4          # 63 usable pages (one is the null page) of 4 tokens
        assert info["max_tokens_limit"] == 63 * 4 and info["default_max_tokens"] == 252   # 256, capped
        with pytest.raises(grpc.RpcError) as e:
            c.generate(token_ids=[5] * (63 * 4 + 1), max_tokens=1)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV" in e.value.details()
        code, out = _post(st.server.http_url + "/v1/completions", {"prompt": [5] * 253, "max_tokens": 1})
        assert code == 400 and "KV" in out["error"]["message"]
        assert c.generate(token_ids=[5] * 252, max_tokens=1).completion_tokens == 1
        # no max_tokens: the default (256) stays within what the KV pool holds, so the engine never refuses it
        assert c.generate(token_ids=[5] * 200, ignore_eos=True).completion_tokens == 252 - 200 + 1


# -- KV gauges -------------------------------------------------------------------------------------------------
def _gauges(text: str) -> dict:
    """The tbjax_kv_pages_* gauges of the fake model, by name."""
    out = {}
    for line in text.splitlines():
        if line.startswith("tbjax_kv_pages_"):
            k, v = line.split()
            name, labels = k.split("{", 1)
            assert labels == 'model_name="fake"}', k
            out[name] = float(v)
    return out


def test_kv_gauges_used_cached_free():
    model = fake_served_model(num_pages=100, page_size=4, step_time_s=0.01)
    with ServerThread(model, metrics_port=None) as st, Client(st.address, timeout=30) as c:
        s = c.generate_stream(token_ids=list(range(10, 42)), max_tokens=300, ignore_eos=True)
        next(s)
        deadline = time.time() + 10
        while (g := _gauges(st.server.metrics.text())).get("tbjax_kv_pages_used", 0) < 8 and time.time() < deadline:
            time.sleep(0.02)
        assert g["tbjax_kv_pages_used"] >= 8       # 32 prompt tokens = 8 pages, held by the running request
        s.close()
        deadline = time.time() + 10
        while (g := _gauges(st.server.metrics.text()))["tbjax_kv_pages_used"] != 0 and time.time() < deadline:
            time.sleep(0.02)
        # nothing runs: used is 0 (no leak), the prompt's full pages stay in the prefix cache (evictable)
        assert g["tbjax_kv_pages_used"] == 0, g
        assert g["tbjax_kv_pages_cached"] >= 8, g
        assert g["tbjax_kv_pages_used"] + g["tbjax_kv_pages_cached"] + g["tbjax_kv_pages_free"] == \
            g["tbjax_kv_pages_total"] == 99, g


# -- cancellations are not errors ------------------------------------------------------------------------------
def test_client_cancellations_during_blocked_writes_log_no_errors(caplog):
    import logging
    import socket
    caplog.set_level(logging.DEBUG)
    model = fake_served_model(max_model_len=4096, num_pages=2048, max_num_batched_tokens=4096)
    lim = Limits(max_tokens=4000)
    with ServerThread(model, metrics_port=None, http_port=0, limits=lim) as st:
        for _ in range(3):   # gRPC: a reader that stops reading (the server's writes block), then goes away
            ch = grpc.insecure_channel(st.address, options=[("grpc.http2.lookahead_bytes", 1024)])
            s = Client(channel=ch).generate_stream(token_ids=[5] * 4, max_tokens=4000, ignore_eos=True, logprobs=20)
            next(s)
            time.sleep(0.3)
            s.close()
            ch.close()
        body = json.dumps({"prompt": [5, 6], "max_tokens": 4000, "stream": True, "ignore_eos": True,
                           "logprobs": 5}).encode()
        for _ in range(3):   # HTTP: the same, then a reset connection
            sock = socket.create_connection(("127.0.0.1", st.server.bound_http_port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            sock.recv(100)
            time.sleep(0.3)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()
        deadline = time.time() + 10
        while st.server.engine_loop.call(lambda e: len(e._req)).result(10) and time.time() < deadline:
            time.sleep(0.05)
        assert st.server.engine_loop.call(lambda e: len(e._req)).result(10) == 0   # all aborted
    bad = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not bad, [(r.name, r.getMessage()[:200]) for r in bad]
    assert any("cancelled by the client" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)


def test_http_request_waiting_in_the_queue_leaves_it_when_the_client_goes_away():
    import socket
    model = fake_served_model(step_time_s=0.01)
    lim = Limits(max_concurrent_requests=1, max_queued_requests=1)
    with ServerThread(model, metrics_port=None, http_port=0, limits=lim) as st, Client(st.address, timeout=30) as c:
        sv = st.server.servicer
        s = c.generate_stream(token_ids=[5], max_tokens=400, ignore_eos=True)
        next(s)
        added = st.server.engine_loop.call(lambda e: e.num_added).result(10)
        body = json.dumps({"prompt": [7], "max_tokens": 2}).encode()
        sock = socket.create_connection(("127.0.0.1", st.server.bound_http_port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.time() + 10
        while st.run_coro(_counts(sv)) != (1, 1) and time.time() < deadline:
            time.sleep(0.01)
        assert st.run_coro(_counts(sv)) == (1, 1)
        sock.close()                      # gone while waiting: its place in the queue frees at once
        deadline = time.time() + 5
        while st.run_coro(_counts(sv)) != (1, 0) and time.time() < deadline:
            time.sleep(0.01)
        assert st.run_coro(_counts(sv)) == (1, 0)
        assert st.server.engine_loop.call(lambda e: e.num_added).result(10) == added   # never reached the engine
        s.close()


def test_request_over_the_kv_share_is_refused_by_validation_naming_the_context():
    model = fake_served_model(num_pages=64, page_size=4, max_model_len=8192, max_num_batched_tokens=8192)
    with ServerThread(model, metrics_port=None) as st, Client(st.address, timeout=30) as c:
        added = st.server.engine_loop.call(lambda e: e.num_added).result(10)
        with pytest.raises(grpc.RpcError) as e:     # 200 + 60 - 1 > 252 KV positions, within the model's 8192
            c.generate(token_ids=[5] * 200, max_tokens=60)
        d = e.value.details()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in d and "253" in d and "KV" in d, d
        assert st.server.engine_loop.call(lambda e: e.num_added).result(10) == added   # never reached the engine
        assert c.generate(token_ids=[5] * 200, max_tokens=53, ignore_eos=True).completion_tokens == 53
