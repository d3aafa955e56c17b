"""Helpers shared by the serving tests and the load tool's self-check (not used by the server itself).

- ``kv_pages_all_free(engine)``: run on the engine thread (``EngineLoop.call``) to check that no request is
  left and that every KV page comes back once the prefix cache lets go of its (unlocked) pages;
  ``wait_kv_pages_all_free(st)`` polls it on a ``ServerThread``'s engine until it holds.
- ``metric_series(text, model_name)``: a Prometheus text page by series, each sample checked for the served name.
- ``run_in_threads(fn, n)``: ``fn(0) .. fn(n - 1)`` at once, one thread each (concurrent client calls).
- ``BAD_REQUESTS``: the bad inputs the server must refuse, each with the status code it must get.
- ``raw_generate(channel, payload)``: send raw bytes as a GenerateRequest (for invalid UTF-8 and the like).
- ``stalling_sender``: a prefill worker's KV sender factory whose transfers of chosen requests hang mid-way.
- ``generate_stream_outcome(call, ids, max_tokens, ...)``: read a Generate stream against the fake engine's
  reference output and name how it ended (completed, cancelled, deadline, or a chosen RPC status).
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
from prometheus_client.parser import text_string_to_metric_families

from .api import method_path, pb
from .fake_engine import reference
from .kv_transfer import KVSender

__all__ = ["kv_pages_all_free", "wait_kv_pages_all_free", "metric_series", "run_in_threads", "BadRequest",
           "BAD_REQUESTS", "raw_generate", "encode_field", "StallingSender", "stalling_sender",
           "generate_stream_outcome"]


def kv_pages_all_free(engine) -> dict:
    """Between steps: check the scheduler's bookkeeping, drop the unlocked prefix-cache pages, and report
    free vs usable pages per dp rank. Raises AssertionError if a request is still held."""
    s = engine.scheduler
    s.check()
    assert not s.has_unfinished(), f"requests still in the engine: {s.stats()['num_running']} running, " \
                                   f"{s.stats()['num_waiting']} waiting"
    out = s.clear_prefix_caches()
    return {"ranks": out, "all_free": all(f == u for f, u in out)}


def wait_kv_pages_all_free(st, timeout: float = 10.0, call_timeout: float = 10.0) -> dict:
    """Poll ``kv_pages_all_free`` on the engine thread of ``st`` (a ``ServerThread``) until every page is free (a
    request still held counts as not yet); its last report. AssertionError after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while True:
        try:
            r = st.server.engine_loop.call(kv_pages_all_free).result(call_timeout)
            if r["all_free"]:
                return r
        except AssertionError:
            r = None
        if time.time() > deadline:
            raise AssertionError(f"KV pages not all free after {timeout} s: {r}")
        time.sleep(0.02)


def metric_series(text: str, model_name: str) -> dict:
    """Prometheus text by series (``name{label="v",...}``), keyed without the label ``model_name``, which every sample
    must carry with the served name."""
    vals = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name", None) == model_name, s
            own = ",".join(f'{k}="{v}"' for k, v in labels.items())
            vals[s.name + (f"{{{own}}}" if own else "")] = s.value
    return vals


def run_in_threads(fn: Callable[[int], object], n: int, timeout_s: float = 60.0) -> None:
    """Run ``fn(i)`` for i in 0 .. n - 1 at once, one thread each, and wait up to ``timeout_s`` for each thread."""
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout_s)


def encode_field(number: int, wire_type: int, payload: bytes) -> bytes:
    """One protobuf field (length-delimited when wire_type == 2), for hand-made wire bytes."""
    key = (number << 3) | wire_type

    def varint(v: int) -> bytes:
        out = bytearray()
        while True:
            b = v & 0x7F
            v >>= 7
            out.append(b | (0x80 if v else 0))
            if not v:
                return bytes(out)
    if wire_type == 2:
        return varint(key) + varint(len(payload)) + payload
    raise ValueError("only length-delimited fields are supported")


def raw_generate(channel: grpc.Channel, payload: bytes, timeout: float = 30.0) -> list:
    """Call Generate with ``payload`` as the request bytes; returns the responses (raises grpc.RpcError)."""
    rpc = channel.unary_stream(method_path("Generate"), request_serializer=lambda b: b,
                               response_deserializer=pb.GenerateResponse.FromString)
    return list(rpc(payload, timeout=timeout))


@dataclass(frozen=True)
class BadRequest:
    name: str
    code: grpc.StatusCode
    must_mention: str                          # a word the status message must contain (case-insensitive)
    make: Callable[[dict], object]             # info (ModelInfo as dict) -> GenerateRequest or raw bytes


def _req(prompt="Hello", **params):
    r = pb.GenerateRequest(prompt=prompt)
    for k, v in params.items():
        setattr(r.params, k, v)
    return r


def _ids(ids, **params):
    r = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids))
    for k, v in params.items():
        setattr(r.params, k, v)
    return r


BAD_REQUESTS = [
    BadRequest("empty_prompt", grpc.StatusCode.INVALID_ARGUMENT, "empty", lambda i: _req("")),
    BadRequest("no_input", grpc.StatusCode.INVALID_ARGUMENT, "no input", lambda i: pb.GenerateRequest()),
    BadRequest("empty_token_ids", grpc.StatusCode.INVALID_ARGUMENT, "empty", lambda i: _ids([])),
    BadRequest("empty_chat", grpc.StatusCode.INVALID_ARGUMENT, "no messages",
               lambda i: pb.GenerateRequest(chat=pb.ChatMessages())),
    BadRequest("prompt_over_limit", grpc.StatusCode.INVALID_ARGUMENT, "limit",
               lambda i: _ids([5] * (i["max_prompt_tokens"] + 1))),
    BadRequest("max_tokens_negative", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens",
               lambda i: _req(max_tokens=-3)),
    BadRequest("max_tokens_zero", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens", lambda i: _req(max_tokens=0)),
    BadRequest("max_tokens_absurd", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens",
               lambda i: _req(max_tokens=2_000_000_000)),
    # the context: the model's, or less where the KV pool holds less for one sequence (ModelInfo's limits say so)
    BadRequest("max_tokens_over_context", grpc.StatusCode.INVALID_ARGUMENT, "context",
               lambda i: _ids([5] * min(i["max_prompt_tokens"], i["max_context"] // 2 + 1),
                              max_tokens=min(i["max_tokens_limit"], i["max_context"] // 2 + 1))),
    BadRequest("temperature_negative", grpc.StatusCode.INVALID_ARGUMENT, "temperature",
               lambda i: _req(temperature=-0.5)),
    BadRequest("temperature_nan", grpc.StatusCode.INVALID_ARGUMENT, "temperature",
               lambda i: _req(temperature=float("nan"))),
    BadRequest("top_p_zero", grpc.StatusCode.INVALID_ARGUMENT, "top_p", lambda i: _req(top_p=0.0)),
    BadRequest("top_p_above_one", grpc.StatusCode.INVALID_ARGUMENT, "top_p", lambda i: _req(top_p=1.5)),
    BadRequest("top_k_negative", grpc.StatusCode.INVALID_ARGUMENT, "top_k", lambda i: _req(top_k=-1)),
    BadRequest("min_p_one", grpc.StatusCode.INVALID_ARGUMENT, "min_p", lambda i: _req(min_p=1.0)),
    BadRequest("logprobs_too_many", grpc.StatusCode.INVALID_ARGUMENT, "logprobs", lambda i: _req(logprobs=1000)),
    BadRequest("token_id_over_vocab", grpc.StatusCode.INVALID_ARGUMENT, "vocabulary",
               lambda i: _ids([1, 2, i["vocab_size"]])),
    BadRequest("token_id_negative", grpc.StatusCode.INVALID_ARGUMENT, "vocabulary", lambda i: _ids([1, -7])),
    BadRequest("stop_token_id_over_vocab", grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids",
               lambda i: pb.GenerateRequest(prompt="Hi", params=pb.SamplingParams(stop_token_ids=[i["vocab_size"]]))),
    BadRequest("empty_stop_string", grpc.StatusCode.INVALID_ARGUMENT, "stop",
               lambda i: pb.GenerateRequest(prompt="Hi", params=pb.SamplingParams(stop=[""]))),
    BadRequest("invalid_utf8", grpc.StatusCode.INVALID_ARGUMENT, "utf-8",
               lambda i: encode_field(3, 2, b"Hello \xff\xfe world")),   # field 3 = prompt
    BadRequest("unknown_model", grpc.StatusCode.NOT_FOUND, "unknown model",
               lambda i: pb.GenerateRequest(model="no-such-model", prompt="Hi")),
    BadRequest("oversized_message", grpc.StatusCode.RESOURCE_EXHAUSTED, "",
               lambda i: encode_field(3, 2, b"x" * (i["_max_message_bytes"] + 1024))),
]


STALL_PREFIX_ENV = "TBJAX_TEST_STALL_PREFIX"


class StallingSender(KVSender):
    """A sender that hangs before its second chunk (so a test can kill the prefill process mid-transfer)."""

    def __init__(self, channel, *, stall_s: float = 3600.0, **kwargs):
        super().__init__(channel, **{**kwargs, "fast_chunk_bytes": 0})   # several chunks on every data plane
        self.stall_s = stall_s

    async def before_chunk(self, index: int) -> None:
        if index == 1:
            await asyncio.sleep(self.stall_s)


def stalling_sender(request_id: str, channel, **kwargs) -> KVSender:
    """A ``serving.pd_worker`` sender factory: transfers of requests whose id starts with $TBJAX_TEST_STALL_PREFIX
    stall after one chunk, all others are plain. Named in a worker process by
    ``TBJAX_KV_SENDER_FACTORY=serving.testing:stalling_sender``."""
    prefix = os.environ.get(STALL_PREFIX_ENV)
    if prefix and request_id.startswith(prefix):
        return StallingSender(channel, **kwargs)
    return KVSender(channel, **kwargs)


async def generate_stream_outcome(call, ids, max_tokens: int, *, timeout: float, cancel_after: int | None = None,
                                  label: object = None, on_response=None, status_outcomes: dict | None = None):
    """Read the Generate stream ``call`` (sent with prompt ``ids``, ``max_tokens`` and a ``timeout``) and return
    ``(outcome, last_response)``. ``"completed"``: the finish reason came, and the tokens and finish reason were
    asserted equal to ``reference(ids, max_tokens)``; ``"cancelled"``: ``cancel_after`` responses came and the call
    was cancelled (or the RPC ended CANCELLED with ``cancel_after`` set); ``"deadline"``: DEADLINE_EXCEEDED with a
    short (< 1 s) timeout. ``await on_response()`` runs after each response (a slow reader); an RPC error whose code
    is a key of ``status_outcomes`` returns that value; any other error is raised. ``label`` tags the assertions."""
    got, n, r = [], 0, None
    try:
        async for r in call:
            got.extend(r.token_ids)
            n += 1
            if on_response is not None:
                await on_response()
            if r.finish_reason:
                want, reason = reference(ids, max_tokens)
                assert got == want and {1: "stop", 2: "length"}[r.finish_reason] == reason, label
                return "completed", r
            if cancel_after is not None and n >= cancel_after:
                call.cancel()
                return "cancelled", r
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout < 1:
            return "deadline", r
        if e.code() == grpc.StatusCode.CANCELLED and cancel_after is not None:
            return "cancelled", r
        if status_outcomes and e.code() in status_outcomes:
            return status_outcomes[e.code()], r
        raise
    raise AssertionError(f"request {label}: stream ended without a finish reason")
