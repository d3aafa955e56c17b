"""Prefill and decode workers of prefill/decode disaggregation: the internal service a router drives.

Flow of one request (the router, ``serving/router.py``, runs it):
1. ``Prefill`` on a prefill worker (server streaming): the engine computes the prompt and samples the first
   token (``prefill_only``), which goes back at once (message ``{"first": ...}``: the client sees its first
   token before any KV moves). Unless that token ends the request, the worker exports the KV
   (``Engine.export_kv``) and pushes it to the decode worker named in the request over the KV transfer
   service (``kv_transfer``: announce -> late reservation -> chunked, checksummed, codec-compressed push);
   then ``{"done": ...}`` with the transfer's byte counts.
2. ``Decode`` on that decode worker (server streaming): the pages that landed for this request (reserved at
   announce, written chunk by chunk into the engine's pools) become a running sequence
   (``Engine.add_prefilled_request``) and the generated tokens stream back.
Every wait has a timeout: a reservation lapses without progress (``KVReceiver``), landed pages that no
``Decode`` claims within ``timeout_s`` are freed, a broken stream frees at once. ``Stats`` reports free pages,
reservations and held sequences (tests check that nothing leaks).

Control messages are tiny JSON documents over gRPC generic handlers (service ``tbjax.pd.v1.Worker``); the KV
itself travels as protobuf (``tbjax.kv.v1``), or, when both workers are on one host, through the decode worker's
shared-memory arena (``kv_shm``: the prefill side DMAs the pages from its device into it, the decode side from it
into its device; only control messages go over gRPC). fp8 pools send their per-page scales with the pages.
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import logging
import os
import time
from typing import Callable

import grpc

from .engine_loop import EngineLoop, RequestStream
from .kv_codecs import CODECS, SplitZipCodec, register_codec
from .kv_transfer import KVReceiver, KVSender, LoopTask, TransferError, kv_service_handler

__all__ = ["PD_SERVICE", "PrefillService", "DecodeService", "EnginePagePool", "worker_handler", "dumps", "loads",
           "params_to_dict", "kv_codecs_for", "page_layout"]

log = logging.getLogger(__name__)

PD_SERVICE = "tbjax.pd.v1.Worker"
SENDER_FACTORY_ENV = "TBJAX_KV_SENDER_FACTORY"   # "module:name" of a sender factory (default_sender's signature)


def default_sender(request_id: str, channel: grpc.aio.Channel, **kwargs) -> KVSender:
    """The ``KVSender`` that moves one request's KV (``kwargs``: KVSender's). A prefill service takes another
    factory of this signature (``sender_factory=``, or named by $TBJAX_KV_SENDER_FACTORY in a worker process): tests
    inject senders that stall or fail mid-transfer this way (``serving.testing.stalling_sender``)."""
    return KVSender(channel, **kwargs)


def sender_factory_from_env() -> Callable[..., KVSender]:
    name = os.environ.get(SENDER_FACTORY_ENV)
    if not name:
        return default_sender
    mod, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"${SENDER_FACTORY_ENV}={name!r}: cannot load it ({e})") from None


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(b: bytes):
    return json.loads(b.decode())


def params_to_dict(params) -> dict:
    d = dataclasses.asdict(params)
    d["stop"], d["stop_token_ids"] = list(d["stop"]), list(d["stop_token_ids"])
    return d


def page_layout(engine) -> tuple[str, tuple[int, ...]]:
    """The transfer's page: one page id over all layers, [L, G, 2K, H], in the pools' dtype."""
    pages = engine.runner.caches[0][0]
    return str(pages.dtype), (len(engine.runner.caches), *pages.shape[1:])


def scales_layout(engine) -> tuple[int, ...] | None:
    """Per-page shape of the fp8 pools' scales over all layers, [L, 2K]; None when the pools have none."""
    scales = engine.runner.caches[0][1]
    return None if scales is None else (len(engine.runner.caches), *scales.shape[1:])


def pool_device(engine):
    """The jax device holding the engine's pools (None for CPU: received pages stay numpy until written)."""
    dev = next(iter(engine.runner.caches[0][0].devices()))
    return None if dev.platform == "cpu" else dev


def kv_codecs_for(dtype: str) -> list[str]:
    """Codecs in preference order: the exponent-split codec for bf16 KV, raw always."""
    if dtype == "bfloat16":
        if "splitzip" not in CODECS:
            register_codec(SplitZipCodec())
        return ["splitzip", "raw"]
    return ["raw"]


def _out_msg(o) -> dict:
    return {"token_ids": list(o.new_token_ids), "text": o.text_delta, "finished": o.finished,
            "finish_reason": o.finish_reason, "logprobs": o.logprobs}


async def _future(fut):
    return await asyncio.wrap_future(fut)


class _Base:
    def __init__(self, engine_loop: EngineLoop, make_params, timeout_s: float):
        self.engine_loop, self.make_params, self.timeout_s = engine_loop, make_params, timeout_s

    async def Stats(self, request: bytes, context) -> bytes:
        """Free/usable pages after dropping unlocked prefix-cache pages, open reservations, held sequences."""
        def f(e):
            s = e.scheduler
            pages = s.clear_prefix_caches()
            return {"pages_free": sum(free for free, _ in pages), "pages_usable": sum(u for _, u in pages),
                    "reservations": s.num_reservations, "held": s.num_held, "unfinished": s.has_unfinished()}
        d = await _future(self.engine_loop.call(f))
        d.update(self.extra_stats())
        return dumps(d)

    def extra_stats(self) -> dict:
        return {}

    async def _stream_engine(self, rid: str, ids, params, adder, context):
        """Submit to the engine thread and yield its outputs; aborts in the engine if the caller goes away."""
        stream = RequestStream(asyncio.get_running_loop(), rid)
        self.engine_loop.submit(rid, ids, params, stream, adder=adder)
        finished = False
        try:
            while not finished:
                for item in await stream.get_all():
                    if isinstance(item, BaseException):
                        code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(item, ValueError) \
                            else grpc.StatusCode.UNAVAILABLE
                        await context.abort(code, f"{type(item).__name__}: {item}")
                    if hasattr(item, "new_token_ids"):
                        finished = item.finished
                        yield item
                        if finished:
                            break
        finally:
            if not finished:     # caller gone or refused: whatever the engine holds under rid is freed
                self.engine_loop.abort(rid)


class PrefillService(_Base):
    """``Prefill``: compute a prompt, answer its first token, push its KV to a decode worker."""

    def __init__(self, engine_loop: EngineLoop, make_params, *, timeout_s: float = 30.0, chunk_pages: int = 16,
                 shm: bool = True, copier: str = "auto", sender_factory: Callable[..., KVSender] | None = None):
        super().__init__(engine_loop, make_params, timeout_s)
        self.sender_factory = sender_factory or sender_factory_from_env()
        self.chunk_pages, self.shm, self.copier = chunk_pages, shm, copier
        self.dtype, self.page_shape = page_layout(engine_loop.engine)
        self.codecs = kv_codecs_for(self.dtype)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.last_stats = None

    def _channel(self, target: str) -> grpc.aio.Channel:
        ch = self._channels.get(target)
        if ch is None:
            ch = self._channels[target] = grpc.aio.insecure_channel(target, options=[
                ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)])
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def Prefill(self, request: bytes, context):
        req = loads(request)
        rid, ids, target = req["id"], [int(t) for t in req["prompt_token_ids"]], req["decode"]
        params = self.make_params(**req["params"])
        first, exported = None, False
        try:
            async for o in self._stream_engine(rid, ids, params,
                                               lambda e: e.add_request(rid, ids, params, prefill_only=True), context):
                first = o
            yield dumps({"first": _out_msg(first)})
            if first.finish_reason == "stop" or params.max_tokens <= 1:     # nothing to decode
                yield dumps({"done": {"transferred": False}})
                return
            try:
                kv = await _future(self.engine_loop.call(lambda e: e.export_kv(rid, on_device=True)))
                exported = True
            except Exception as e:  # noqa: BLE001
                await context.abort(grpc.StatusCode.INTERNAL, f"KV export of {rid!r} failed: {e}")
        finally:
            if not exported:     # the held pages go back (done, refused, or the router went away)
                self.engine_loop.abort(rid)
        sender = self.sender_factory(rid, self._channel(target), codecs=self.codecs, chunk_pages=self.chunk_pages,
                                     timeout_s=self.timeout_s, shm=self.shm, copier=self.copier)
        t0 = time.perf_counter()
        try:
            st = await sender.send(rid, kv.device_pages, kv.num_tokens, num_pages=kv.num_pages,
                                   scales=kv.device_scales)
        except TransferError as e:
            await context.abort(e.code, e.message)
        self.last_stats = st
        yield dumps({"done": {"transferred": True, "codec": st.codec, "pages": st.pages, "raw_bytes": st.raw_bytes,
                              "wire_bytes": st.wire_bytes, "shm": st.shm, "path": st.path,
                              "seconds": time.perf_counter() - t0}})


class EnginePagePool:
    """``kv_pool.PagePool`` over an engine's pools, every call on its engine thread: reserve ->
    ``Engine.reserve_kv``, write -> ``Engine.write_kv_pages``, free -> ``Engine.release_reservation``."""

    def __init__(self, engine_loop: EngineLoop, page_size: int):
        self.engine_loop, self.page_size = engine_loop, page_size
        self._by_page: dict[int, tuple[str, list[int]]] = {}   # first page id -> (request id, pages)

    async def reserve(self, n: int, request_id: str = "") -> list[int]:
        pages = await _future(self.engine_loop.call(lambda e: e.reserve_kv(request_id, n * self.page_size)))
        for p in pages:
            self._by_page[p] = (request_id, pages)
        return pages

    def _owner(self, page_ids):
        got = self._by_page.get(int(page_ids[0]))
        if got is None:
            raise KeyError(f"pages {list(page_ids)[:4]} belong to no reservation")
        return got

    async def write(self, page_ids, pages, scales=None) -> None:
        """``pages`` in the transfer layout [>= n, L, G, 2K, H] (host or device), fp8 ``scales`` [n, L, 2K]."""
        rid, all_pages = self._owner(page_ids)
        first = all_pages.index(int(page_ids[0]))
        n = len(page_ids)
        await _future(self.engine_loop.call(lambda e: e.write_kv_pages(rid, pages, scales, first, num_pages=n)))

    def forget(self, request_id: str, pages) -> None:
        for p in pages:
            if self._by_page.get(p, (None,))[0] == request_id:
                del self._by_page[p]

    def free(self, page_ids) -> None:
        rid, all_pages = self._owner(page_ids)
        self.forget(rid, all_pages)
        self.engine_loop.call(lambda e: e.release_reservation(rid))


class DecodeService(_Base):
    """The KV transfer receiver (late reservations into the engine's pools) and ``Decode``."""

    def __init__(self, engine_loop: EngineLoop, make_params, *, timeout_s: float = 10.0, metrics=None,
                 shm_bytes: int = 256 << 20, copier: str = "auto", ipc_bytes: int = 256 << 20):
        super().__init__(engine_loop, make_params, timeout_s)
        eng = engine_loop.engine
        self.dtype, self.page_shape = page_layout(eng)
        self.pool = EnginePagePool(engine_loop, eng.config.page_size)
        self.receiver = KVReceiver(self.pool, page_dtype=self.dtype, page_shape=self.page_shape,
                                   codecs=kv_codecs_for(self.dtype), timeout_s=timeout_s, metrics=metrics,
                                   on_ready=self._on_ready, scales_shape=scales_layout(eng), shm_bytes=shm_bytes,
                                   copier=copier, device=pool_device(eng), ipc_bytes=ipc_bytes)
        self._landed: dict[str, tuple[list[int], float]] = {}    # request id -> (pages, deadline)
        self._expiry = LoopTask(self._expire_loop)

    def handler(self) -> grpc.GenericRpcHandler:
        return kv_service_handler(self.receiver)

    def start(self) -> None:
        self.receiver.start()
        self._expiry.start()

    async def stop(self) -> None:
        self._expiry.cancel()
        await self.receiver.stop()
        for rid in list(self._landed):
            self._drop(rid, "decode worker stopped")

    def extra_stats(self) -> dict:
        a, ipc = self.receiver.arena, self.receiver.ipc
        return {"landed": len(self._landed), "open_transfers": self.receiver.num_open,
                "shm_regions": 0 if a is None else a.num_regions, "shm_segment": None if a is None else a.name,
                "ipc_regions": 0 if ipc is None else ipc.num_regions}

    def _on_ready(self, rid: str, pages: list[int], num_tokens: int) -> None:
        self._landed[rid] = (pages, time.monotonic() + self.timeout_s)

    def _drop(self, rid: str, why: str) -> None:
        got = self._landed.pop(rid, None)
        if got is not None:
            log.info("landed KV of %s freed: %s", rid, why)
            self.pool.forget(rid, got[0])
            self.engine_loop.call(lambda e: e.release_reservation(rid))

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(max(0.01, min(0.5, self.timeout_s / 4)))
            now = time.monotonic()
            for rid, (_, deadline) in list(self._landed.items()):
                if now > deadline:
                    self._drop(rid, f"no Decode call within {self.timeout_s:g} s")

    async def Decode(self, request: bytes, context):
        req = loads(request)
        rid, ids, first = req["id"], [int(t) for t in req["prompt_token_ids"]], int(req["first_token"])
        params = self.make_params(**req["params"])
        got = self._landed.pop(rid, None)
        if got is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no KV has landed for request {rid!r} (never sent, or it expired)")
        self.pool.forget(rid, got[0])
        async for o in self._stream_engine(rid, ids, params,
                                           lambda e: e.add_prefilled_request(rid, ids, first, params), context):
            yield dumps(_out_msg(o))


def worker_handler(service: _Base) -> grpc.GenericRpcHandler:
    """The ``tbjax.pd.v1.Worker`` service of a prefill or decode worker (JSON messages)."""
    ident = lambda b: b  # noqa: E731
    h = {"Stats": grpc.unary_unary_rpc_method_handler(service.Stats, request_deserializer=ident,
                                                      response_serializer=ident)}
    if isinstance(service, PrefillService):
        h["Prefill"] = grpc.unary_stream_rpc_method_handler(service.Prefill, request_deserializer=ident,
                                                            response_serializer=ident)
    if isinstance(service, DecodeService):
        h["Decode"] = grpc.unary_stream_rpc_method_handler(service.Decode, request_deserializer=ident,
                                                           response_serializer=ident)
    return grpc.method_handlers_generic_handler(PD_SERVICE, h)
