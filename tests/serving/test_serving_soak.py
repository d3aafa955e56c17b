"""Soak: a few hundred concurrent streams over loopback gRPC, a third of them cancelled at random points
(before admission, while queued in the engine, mid-decode) or cut by a short deadline. No crash, every
request that was not cancelled completes with exactly the reference output, and every KV page comes back."""
import asyncio
import collections
import random

import grpc

from serving.api import method_path, pb
from serving.client import Client
from serving.fake_engine import fake_served_model, reference
from serving.limits import Limits
from serving.server import ServerThread
from serving.testing import generate_stream_outcome, kv_pages_all_free

N_REQUESTS = 300


async def _one(stub, rng: random.Random, i: int) -> str:
    ids = [rng.randrange(3, 259) for _ in range(rng.randrange(1, 48))]
    max_tokens = rng.randrange(1, 64)
    req = pb.GenerateRequest(request_id=f"soak-{i}", params=pb.SamplingParams(max_tokens=max_tokens, temperature=0))
    req.prompt_token_ids.ids.extend(ids)
    mode = rng.random()
    timeout = 0.05 + rng.random() * 0.2 if mode < 0.1 else 60
    cancel_after = None if mode < 0.67 else rng.randrange(0, 8)
    await asyncio.sleep(rng.random() * 0.2)
    call = stub(req, timeout=timeout)
    if cancel_after == 0:
        call.cancel()
        return "cancelled"
    outcome, r = await generate_stream_outcome(call, ids, max_tokens, timeout=timeout, cancel_after=cancel_after,
                                               label=i)
    if outcome == "completed":
        want, _ = reference(ids, max_tokens)
        assert r.request_id == f"soak-{i}"
        assert r.usage.completion_tokens == len(want) and r.usage.prompt_tokens == len(ids)
    return outcome


def test_soak_concurrent_with_random_cancellations():
    model = fake_served_model(step_time_s=0.002, num_pages=600, page_size=4, max_num_seqs=32,
                              max_num_batched_tokens=256)
    lim = Limits(max_concurrent_requests=N_REQUESTS, max_queued_requests=N_REQUESTS)
    with ServerThread(model, limits=lim, metrics_port=None) as st:
        async def main():
            async with grpc.aio.insecure_channel(st.address) as ch:
                stub = ch.unary_stream(method_path("Generate"), request_serializer=pb.GenerateRequest.SerializeToString,
                                       response_deserializer=pb.GenerateResponse.FromString)
                rng = random.Random(20261129)
                return await asyncio.gather(*[_one(stub, random.Random(rng.random()), i) for i in range(N_REQUESTS)])

        outcomes = collections.Counter(asyncio.run(main()))
        assert sum(outcomes.values()) == N_REQUESTS
        assert outcomes["completed"] >= N_REQUESTS // 2 and outcomes["cancelled"] >= 30, outcomes
        # the cancellations reach the engine as aborts; then every page is free again
        for _ in range(200):
            stats = st.server.engine_loop.call(lambda e: e.scheduler.stats()).result(10)
            if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                break
            asyncio.run(asyncio.sleep(0.02))
        aborted = st.server.engine_loop.call(lambda e: e.scheduler.num_aborted).result(10)
        assert aborted >= outcomes["cancelled"] // 3, (aborted, outcomes)   # cancels reached the engine as aborts
        r = st.server.engine_loop.call(kv_pages_all_free).result(10)
        assert r["all_free"], r
        sv = st.server.servicer
        assert (sv.num_inflight, sv.num_queued, len(sv._active)) == (0, 0, 0)
        assert st.server.engine_loop.alive and st.server.engine_loop.fatal is None
        with Client(st.address, timeout=30) as c:       # still serving
            assert c.generate(token_ids=[4, 5, 6], max_tokens=5, temperature=0).token_ids == reference([4, 5, 6], 5)[0]
