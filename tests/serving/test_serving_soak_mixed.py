"""The CI soak (issue 18, item 6): a few thousand requests against the fake engine through gRPC and the HTTP API at
once, mixing valid requests with every kind of invalid one, random cancels at every stage, short deadlines, slow
readers and more concurrent clients than the admission limits allow. At the end: every valid request that was not
cancelled got exactly the reference output, every invalid one the status its case names, overload only ever as
RESOURCE_EXHAUSTED / 429, every KV page is free, no request is left in the server, the process RSS grew less than a
bound, and nothing was logged at ERROR. The numbers are printed (run with -s to see them)."""
import asyncio
import collections
import json
import logging
import random
import time

import grpc
import httpx2 as httpx

from serving.api import method_path, pb
from serving.client import Client
from serving.fake_engine import FakeTokenizer, fake_served_model, reference
from serving.limits import Limits
from serving.server import ServerThread
from serving.testing import BAD_REQUESTS, generate_stream_outcome, kv_pages_all_free

N_REQUESTS = 2000
CLIENTS = 128                 # concurrent clients: more than running + waiting slots (16 + 8), so some overload
RSS_GROWTH_BOUND_MB = 150
TOK = FakeTokenizer()
SERVER_LOGGERS = ("serving", "tbjax", "grpc", "uvicorn")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def _grpc_one(stub, raw_stub, info, rng: random.Random, i: int) -> str:
    mode = rng.random()
    if mode < 0.12:                                               # an invalid request
        case = rng.choice(BAD_REQUESTS)
        req = case.make(info)
        payload = req if isinstance(req, bytes) else req.SerializeToString()
        try:
            async for _ in raw_stub(payload, timeout=30):
                pass
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and case.code != e.code():
                assert "busy" in (e.details() or "").lower() or "queue" in (e.details() or "").lower(), e.details()
                return "overloaded"
            assert e.code() == case.code, (case.name, e.code(), e.details())
            assert case.must_mention.lower() in (e.details() or "").lower(), (case.name, e.details())
            assert len(e.details() or "") < 1024, case.name
            return "invalid"
        raise AssertionError(f"{case.name}: accepted")
    ids = [rng.randrange(3, 259) for _ in range(rng.randrange(1, 40))]
    max_tokens = rng.randrange(1, 48)
    req = pb.GenerateRequest(request_id=f"g-{i}", params=pb.SamplingParams(max_tokens=max_tokens, temperature=0))
    req.prompt_token_ids.ids.extend(ids)
    timeout = 0.02 + rng.random() * 0.1 if mode < 0.2 else 60
    cancel_after = rng.randrange(0, 6) if 0.2 <= mode < 0.45 else None
    slow = 0.45 <= mode < 0.55
    call = stub(req, timeout=timeout)
    if cancel_after == 0:
        await asyncio.sleep(rng.random() * 0.01)
        call.cancel()
        return "cancelled"
    on_response = (lambda: asyncio.sleep(0.005 + rng.random() * 0.02)) if slow else None
    outcome, _ = await generate_stream_outcome(
        call, ids, max_tokens, timeout=timeout, cancel_after=cancel_after, label=i, on_response=on_response,
        status_outcomes={grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded"})
    return outcome


async def _http_one(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    ids = [rng.randrange(3 + 32, 3 + 127) for _ in range(rng.randrange(1, 30))]   # printable ASCII bytes
    max_tokens = rng.randrange(1, 32)
    mode = rng.random()
    if mode < 0.15:
        body = {"model": "fake", "prompt": ids, "max_tokens": rng.choice([0, -1, "x"]), "temperature": 0}
        r = await client.post("/v1/completions", json=body)
        if r.status_code == 429:
            return "overloaded"
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], r.text
        return "invalid"
    body = {"model": "fake", "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    want_ids, _ = reference(ids, max_tokens)
    want = TOK.decode(want_ids)
    if mode < 0.6:
        r = await client.post("/v1/completions", json=body)
        if r.status_code == 429:
            return "overloaded"
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want, i
        return "completed"
    cancel_after = rng.randrange(1, 4) if mode < 0.8 else None
    text, n = "", 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code == 429:
            return "overloaded"
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                assert text == want, i
                return "completed"
            text += json.loads(line[6:])["choices"][0]["text"]
            n += 1
            if cancel_after is not None and n >= cancel_after:
                return "cancelled"                                # leaving the block closes the connection
    raise AssertionError(f"http request {i}: stream ended without [DONE]")


def test_soak_thousands_mixed_requests(caplog):
    caplog.set_level(logging.WARNING)
    model = fake_served_model(step_time_s=0.001, num_pages=800, page_size=4, max_num_seqs=48,
                              max_num_batched_tokens=256)
    lim = Limits(max_concurrent_requests=16, max_queued_requests=8)
    with ServerThread(model, limits=lim, metrics_port=None, http_port=0) as st:
        with Client(st.address, timeout=30) as c:
            info = dict(c.model_info(), _max_message_bytes=lim.max_message_bytes)

        async def main(n, seed):
            sem = asyncio.Semaphore(CLIENTS)
            async with grpc.aio.insecure_channel(st.address) as ch, \
                    httpx.AsyncClient(base_url=st.server.http_url, timeout=60,
                                      limits=httpx.Limits(max_connections=CLIENTS)) as hc:
                stub = ch.unary_stream(method_path("Generate"), request_serializer=pb.GenerateRequest.SerializeToString,
                                       response_deserializer=pb.GenerateResponse.FromString)
                raw = ch.unary_stream(method_path("Generate"), request_serializer=lambda b: b,
                                      response_deserializer=pb.GenerateResponse.FromString)
                rng = random.Random(seed)

                async def one(i, r):
                    async with sem:
                        await asyncio.sleep(r.random() * 0.002)
                        if r.random() < 0.25:
                            return "http-" + await _http_one(hc, r, i)
                        return await _grpc_one(stub, raw, info, r, i)

                return await asyncio.gather(*[one(i, random.Random(rng.random())) for i in range(n)])

        asyncio.run(main(200, 1))                     # warm: imports, first connections, allocator pools
        rss0, t0 = _rss_mb(), time.perf_counter()
        outcomes = collections.Counter(asyncio.run(main(N_REQUESTS, 20261202)))
        wall = time.perf_counter() - t0
        # every request is accounted for; the mix really happened
        assert sum(outcomes.values()) == N_REQUESTS
        for k, lo in (("completed", N_REQUESTS // 5), ("invalid", 100), ("cancelled", 150), ("deadline", 20),
                      ("http-completed", 100), ("http-cancelled", 25), ("http-invalid", 20), ("overloaded", 1)):
            assert outcomes[k] >= lo, (k, outcomes)
        # nothing left: the server's queues, the engine's requests, the KV pages
        for _ in range(500):
            stats = st.server.engine_loop.call(lambda e: e.scheduler.stats()).result(10)
            sv = st.server.servicer
            if stats["num_running"] == 0 and stats["num_waiting"] == 0 and sv.num_inflight == 0 and sv.num_queued == 0:
                break
            time.sleep(0.02)
        assert (sv.num_inflight, sv.num_queued, len(sv._active)) == (0, 0, 0)
        r = st.server.engine_loop.call(kv_pages_all_free).result(10)
        assert r["all_free"], r
        assert st.server.engine_loop.alive and st.server.engine_loop.fatal is None
        rss1 = _rss_mb()
        with Client(st.address, timeout=30) as c:     # still serving
            assert c.generate(token_ids=[4, 5, 6], max_tokens=5, temperature=0).token_ids == reference([4, 5, 6], 5)[0]
    errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records           # the server's (the test's own
              if r.levelno >= logging.ERROR and r.name.startswith(SERVER_LOGGERS)]   # client loop is not judged)
    # grpc core logs this when a client's cancel races the final status of its stream (after the handler returned):
    # a few per thousand cancels under load, outside the handler's reach. Counted, bounded, and nothing else allowed.
    races = [e for e in errors if "ExecuteBatchError raised in core" in e]
    errors = [e for e in errors if e not in races]
    print(f"\nsoak: {N_REQUESTS} requests in {wall:.1f} s ({N_REQUESTS / wall:.0f}/s), {CLIENTS} clients, "
          f"RSS {rss0:.0f} -> {rss1:.0f} MB, outcomes {dict(sorted(outcomes.items()))}, "
          f"{len(errors)} ERROR lines, {len(races)} grpc cancel races")
    assert not errors, errors[:5]
    assert len(races) <= max(2, (outcomes["cancelled"] + outcomes["deadline"]) // 100), races[:3]
    assert rss1 - rss0 < RSS_GROWTH_BOUND_MB, (rss0, rss1)
