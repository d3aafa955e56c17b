"""KV transfer between workers (prefill -> decode) with a late handshake, over gRPC (tbjax.kv.v1).

Why late: a decode worker's KV pages are its batch size. If it reserved pages when a request arrived, they
would sit idle for the whole prefill. Here the prefill side calls ``Announce`` only when the request's KV is
about to be ready; the decode side reserves pages then, for ``timeout_s`` (renewed by every chunk that
arrives), and the prefill side streams the pages (``PushKV``) in chunks, each encoded by a lossless codec and
checksummed (zlib.crc32). Everything that can go wrong frees the reservation at once:

- the stream breaks (the prefill process died, the network went) -> freed when the stream ends;
- the prefill side announces and then never pushes -> freed when the reservation lapses;
- a chunk's checksum, codec, size or page range is wrong -> DATA_LOSS / INVALID_ARGUMENT, freed;
- the prefill side gives up -> ``Release``.
A completed transfer hands the pages to ``on_ready(request_id, page_ids, num_tokens)``; a failed one calls
``on_failed(request_id, reason)`` so the owner (a decode worker / router) can fail the request (UNAVAILABLE)
or retry it.

The page store is behind ``PagePool`` (``serving/kv_pool.py``: reserve / write / free; ``ArrayPagePool`` is a numpy
one for tests and CPU workers, the engine's KV cache implements the same methods through its engine thread). Codecs
are behind ``Codec`` (``serving/kv_codecs.py``: ``raw`` always, ``SplitZipCodec`` when registered); the two sides
agree on one at Announce.

Same host: a receiver built with ``shm_bytes > 0`` owns a shared-memory arena (``serving/kv_shm.py``); a sender on
the same host (equal ``host_id``) that offers ``shm`` is granted a region at Announce and copies the pages there
(device -> pinned host DMA with the ``cupy`` copier); the chunks then carry only the page range and a 64-bit
device-side checksum (``in_shm``). The handshake, timeouts, and failure handling are the same; the region is
freed with the reservation. A sender that cannot map the region sends the pages in the payload instead.
The sender's half of the same-host planes (mappings, device checksums, copiers) is ``serving/kv_same_host.py``.
GPU processes on one host go device to device instead when the receiver has ``ipc_bytes > 0``: a region of its
CUDA IPC staging buffer (``in_ipc`` chunks); a sender that cannot open it falls back to shm, then to the payload.
On both same-host paths the sender queues every chunk's copy at once and sends each control message when its copy is
done; the receiver queues each chunk's copy into the reservation's ``kv_shm.Landing`` and, after the last chunk,
checks every chunk's checksum where the pages landed (one device program) and writes the pool once (a mismatch is
DATA_LOSS and frees the reservation, as on the byte path). Both sides record phase timestamps for diagnosis
(``SendStats.extra["marks_s"]``, ``KVReceiver.timings``).
fp8 pools: each chunk carries its pages' float32 scales (``scales``, crc32-checked) on either path.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc
import numpy as np

from pallas_kernels.utils import next_pow2, prev_pow2

from . import kv_same_host, kv_shm
from .kv_codecs import CODECS, np_dtype
from .kv_pool import PagePool
from .api import lenient_deserializer
from .proto import tbjax_kv_v1_pb2 as kvpb

__all__ = ["KVReceiver", "KVSender", "TransferError", "SendStats", "kv_service_handler", "host_pages", "KV_SERVICE_NAME",
           "LoopTask"]

log = logging.getLogger(__name__)

KV_SERVICE_NAME = kvpb.DESCRIPTOR.services_by_name["KVTransfer"].full_name   # "tbjax.kv.v1.KVTransfer"


class LoopTask:
    """A background coroutine run as one asyncio task: ``start`` (on the running loop) creates it unless it runs,
    ``cancel`` cancels it; both may be called again."""

    def __init__(self, coro_fn: Callable[[], object]):
        self._coro_fn = coro_fn
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._coro_fn())

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


# -- decode side -----------------------------------------------------------------------------------------------
@dataclass
class _Reservation:
    id: str
    request_id: str
    pages: list[int]
    num_tokens: int
    codec: str
    deadline: float
    received: np.ndarray
    raw_bytes: int = 0
    wire_bytes: int = 0
    streaming: bool = False
    shm_offset: int | None = None     # granted region of the receiver's arena
    shm_chunks: int = 0               # chunks that came through it (shared memory or IPC)
    ipc_offset: int | None = None     # granted region of the receiver's IPC buffer
    ipc_chunks: int = 0
    landing: kv_shm.Landing | None = None   # same-host chunks land here; verified and written once, at the end
    sums: dict = field(default_factory=dict)        # first page -> the sender's checksum64 of that chunk
    scales: np.ndarray | None = None                # scales of landed chunks (fp8 pools)
    marks: dict = field(default_factory=dict)       # phase -> perf_counter() (diagnostics: ``KVReceiver.timings``)


class KVReceiver:
    """Decode side of the transfer: the KVTransfer servicer (runs on the server's asyncio loop)."""

    def __init__(self, pool: PagePool, *, page_dtype: str, page_shape: Sequence[int], codecs: Sequence[str] = ("raw",),
                 timeout_s: float = 10.0, metrics=None,
                 on_ready: Callable[[str, list[int], int], None] | None = None,
                 on_failed: Callable[[str, str], None] | None = None,
                 scales_shape: Sequence[int] | None = None, shm_bytes: int = 0, copier: str = "auto", device=None,
                 ipc_bytes: int = 0):
        """``scales_shape``: per-page float32 scales that must come with the pages (fp8 pools). ``shm_bytes``:
        size of the same-host shared-memory arena (0: none, every transfer over gRPC). ``copier``: how pages
        leave the segment (``kv_shm.make_copier``); ``device``: the jax device the pool wants pages on (None:
        host arrays). ``ipc_bytes``: size of a device staging buffer shared by CUDA IPC with GPU senders on this
        host (0: none; needs ``device`` on a GPU and cupy)."""
        unknown = [c for c in codecs if c not in CODECS]
        if unknown:
            raise ValueError(f"unknown codecs {unknown}; registered: {sorted(CODECS)}")
        self.pool = pool
        self.dtype = np_dtype(page_dtype)
        self.page_shape = tuple(int(s) for s in page_shape)
        self.page_nbytes = int(np.prod(self.page_shape)) * self.dtype.itemsize
        self.codecs = list(codecs)
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.on_ready = on_ready
        self.on_failed = on_failed
        self.scales_shape = None if not scales_shape else tuple(int(s) for s in scales_shape)
        self.device = device
        self.arena: kv_shm.ShmArena | None = None
        self.copier: kv_shm.HostCopier | None = None
        self.host_id = kv_shm.host_id()
        if shm_bytes > 0:
            try:
                self.arena = kv_shm.ShmArena(shm_bytes)
                self.copier = kv_shm.make_copier(copier)
            except Exception as e:  # noqa: BLE001 - no /dev/shm, no memory: transfers go over gRPC
                log.warning("no shared-memory KV arena (%s): transfers go over gRPC", e)
                if self.arena is not None:
                    self.arena.close()
                self.arena = None
        self.ipc: kv_shm.IpcArena | None = None
        if ipc_bytes > 0 and device is not None and device.platform == "gpu":
            try:
                self.ipc = kv_shm.IpcArena(ipc_bytes, device)
            except Exception as e:  # noqa: BLE001 - no cupy / no IPC: shm or gRPC
                log.warning("no CUDA IPC KV buffer (%s: %s)", type(e).__name__, e)
        self._res: dict[str, _Reservation] = {}
        self.timings: dict[str, dict] = {}     # request id -> seconds of each phase of its last transfer (last 256)
        self._expiry = LoopTask(self._expire_loop)
        self.num_completed = 0
        self.num_failed = 0

    # -- bookkeeping ---------------------------------------------------------------------------------------
    @property
    def num_open(self) -> int:
        return len(self._res)

    @property
    def pages_reserved(self) -> int:
        return sum(len(r.pages) for r in self._res.values())

    def _fail(self, res: _Reservation, reason: str) -> None:
        if self._res.pop(res.id, None) is None:
            return
        if res.landing is not None:
            res.landing.abandon()
        self._free_region(res)
        self.pool.free(res.pages)
        self.num_failed += 1
        log.info("KV reservation %s (request %s) freed: %s", res.id, res.request_id, reason)
        if self.on_failed is not None:
            self.on_failed(res.request_id, reason)

    def _free_region(self, res: _Reservation) -> None:
        if res.shm_offset is not None and self.arena is not None:
            self.arena.free(res.shm_offset)
        if res.ipc_offset is not None and self.ipc is not None:
            self.ipc.free(res.ipc_offset)
        res.shm_offset = res.ipc_offset = None

    def start(self) -> None:
        """Start the expiry task (call on the serving loop)."""
        self._expiry.start()

    async def stop(self) -> None:
        self._expiry.cancel()
        for res in list(self._res.values()):
            self._fail(res, "receiver stopped")
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if self.ipc is not None:
            self.ipc.close()
            self.ipc = None

    async def _expire_loop(self) -> None:
        period = max(0.01, min(0.5, self.timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for res in list(self._res.values()):
                if now > res.deadline:
                    self._fail(res, f"no progress for {self.timeout_s:g} s (peer lost?)")

    # -- RPCs ----------------------------------------------------------------------------------------------
    async def Announce(self, req, context):
        try:
            return await self._announce(req)
        except _Abort as e:
            await context.abort(e.code, e.message)

    async def _announce(self, req) -> "kvpb.AnnounceResponse":
        """The late reservation: checks, reserves, grants same-host regions (raises _Abort)."""
        if not isinstance(req, kvpb.AnnounceRequest):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse AnnounceRequest: {req.reason}")
        if req.num_pages < 1:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_pages must be >= 1, got {req.num_pages}")
        if req.layout.dtype != self.dtype.name or tuple(req.layout.shape) != self.page_shape:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"page layout {req.layout.dtype}{list(req.layout.shape)} does not match this "
                                f"worker's {self.dtype.name}{list(self.page_shape)}")
        if (tuple(req.layout.scales_shape) or None) != self.scales_shape:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"page scales {list(req.layout.scales_shape)} do not match this worker's "
                                f"{list(self.scales_shape or [])} (fp8 pools need their scales)")
        codec = next((c for c in req.codecs if c in self.codecs), None)
        if codec is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no common codec: sender has {list(req.codecs)}, receiver {self.codecs}")
        try:
            pages = self.pool.reserve(req.num_pages, request_id=req.request_id)      # the late reservation
            if inspect.isawaitable(pages):
                pages = await pages
        except Exception as e:  # noqa: BLE001 - the pool's own out-of-pages error
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot reserve {req.num_pages} KV pages: {e}")
        rid = uuid.uuid4().hex
        res = self._res[rid] = _Reservation(rid, req.request_id, pages, req.num_tokens, codec,
                                            time.monotonic() + self.timeout_s, np.zeros(req.num_pages, bool))
        res.marks["announced"] = time.perf_counter()
        shm_name = ""
        if req.shm and self.arena is not None and req.host_id == self.host_id:
            res.shm_offset = self.arena.alloc(req.num_pages * self.page_nbytes)   # None: arena full -> gRPC
            if res.shm_offset is not None:
                shm_name = self.arena.name
        ipc_handle = b""
        if req.ipc and self.ipc is not None and req.host_id == self.host_id and req.pid != os.getpid():
            res.ipc_offset = self.ipc.alloc(req.num_pages * self.page_nbytes)
            if res.ipc_offset is not None:
                ipc_handle = self.ipc.handle
        return kvpb.AnnounceResponse(reservation_id=rid, codec=codec, timeout_ms=int(self.timeout_s * 1000),
                                     shm_name=shm_name, shm_offset=res.shm_offset or 0, ipc_handle=ipc_handle,
                                     ipc_offset=res.ipc_offset or 0)

    async def PushKV(self, request_iterator, context):
        try:
            return await self._push(request_iterator)
        except _Abort as e:
            await _drain(request_iterator, DRAIN_BEFORE_ABORT_S)    # see Transfer: keeps the status intact
            await context.abort(e.code, e.message)

    async def Transfer(self, request_iterator, context):
        """Announce and PushKV on one call: the announce, its grant, the chunks, the result."""
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty transfer call")
        try:
            if not isinstance(first, kvpb.TransferMessage) or first.WhichOneof("kind") != "announce":
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "a transfer call starts with its announce")
            grant = await self._announce(first.announce)
        except _Abort as e:
            await context.abort(e.code, e.message)
        yield kvpb.TransferReply(grant=grant)

        async def chunks():
            async for m in it:
                if isinstance(m, kvpb.TransferMessage) and m.WhichOneof("kind") == "chunk":
                    yield m.chunk
                elif isinstance(m, kvpb.TransferMessage):
                    yield _NotAChunk(f"a {m.WhichOneof('kind')} message where a chunk was expected")
                else:
                    yield m           # undecodable: _push refuses it with the parser's reason
        try:
            result = await self._push(chunks())
        except BaseException as e:    # also before the first chunk: the grant's reservation goes at once
            res = self._res.get(grant.reservation_id)
            if res is not None:
                self._fail(res, e.message if isinstance(e, _Abort) else f"transfer call broke: {type(e).__name__}")
            if isinstance(e, _Abort):
                # grpcio's asyncio client replaces the status of a call that ends while it is still writing with
                # INTERNAL "Internal error from Core" (grpc/grpc#36066): let the sender finish its (bounded) chunk
                # stream, unread, before ending the call with the real status.
                await _drain(it, DRAIN_BEFORE_ABORT_S)
                await context.abort(e.code, e.message)
            raise
        yield kvpb.TransferReply(result=result)

    async def _push(self, request_iterator) -> "kvpb.PushResult":
        """Take a reservation's chunks (raises _Abort, after freeing the reservation)."""
        res: _Reservation | None = None
        done = False
        try:
            async for chunk in request_iterator:
                if not isinstance(chunk, kvpb.KVChunk):
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse KVChunk: {chunk.reason}")
                if res is None:
                    res = self._res.get(chunk.reservation_id)
                    if res is None:
                        raise _Abort(grpc.StatusCode.NOT_FOUND,
                                     f"no open reservation {chunk.reservation_id!r} (expired or released)")
                    if res.streaming:
                        res = None
                        raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, "reservation already has a stream")
                    res.streaming = True
                elif chunk.reservation_id != res.id:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "one stream carries one reservation")
                if res.id not in self._res:
                    raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the reservation lapsed during the transfer")
                res.marks.setdefault("first_chunk", time.perf_counter())
                await self._take_chunk(res, chunk)
                if chunk.last:
                    res.marks["last_chunk"] = time.perf_counter()
                    if not res.received.all():
                        missing = np.flatnonzero(~res.received)[:8].tolist()
                        raise _Abort(grpc.StatusCode.DATA_LOSS, f"last chunk arrived but pages {missing} are missing")
                    if res.landing is not None:
                        await self._finish_landing(res)
                        if res.id not in self._res:
                            raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                         "the reservation lapsed during the transfer")
                    done = True
                    break
            if res is None:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "empty transfer stream")
            if not done:
                raise _Abort(grpc.StatusCode.DATA_LOSS, "the stream ended before its last chunk")
        except _Abort as e:
            if res is not None:
                self._fail(res, e.message)
            raise
        except BaseException as e:  # stream broken / cancelled: the peer is gone
            if res is not None:
                self._fail(res, f"transfer stream broke: {type(e).__name__}: {e}")
            raise
        del self._res[res.id]
        res.marks["done"] = time.perf_counter()
        t = res.marks.pop("announced")
        self.timings[res.request_id] = {**{k: v - t for k, v in res.marks.items()}, "announced_at": t}
        while len(self.timings) > 256:
            self.timings.pop(next(iter(self.timings)))
        used_shm = res.shm_chunks > 0 or res.ipc_chunks > 0
        self._free_region(res)
        self.num_completed += 1
        if self.on_ready is not None:
            self.on_ready(res.request_id, res.pages, res.num_tokens)
        path = "ipc" if res.ipc_chunks else "shm" if res.shm_chunks else "grpc"
        return kvpb.PushResult(reservation_id=res.id, pages=len(res.pages), raw_bytes=res.raw_bytes,
                               wire_bytes=res.wire_bytes, shm=used_shm, path=path)

    async def _take_chunk(self, res: _Reservation, chunk) -> None:
        n, first = chunk.num_pages, chunk.first_page
        if n < 1 or first < 0 or first + n > len(res.pages):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"chunk pages [{first}, {first + n}) outside the {len(res.pages)} announced")
        if res.received[first:first + n].any():
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"chunk pages [{first}, {first + n}) sent twice")
        if chunk.raw_nbytes != n * self.page_nbytes:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"chunk says {chunk.raw_nbytes} raw bytes, {n} pages are {n * self.page_nbytes}")
        scales = None
        if self.scales_shape is not None:
            if zlib.crc32(chunk.scales) != chunk.scales_crc32:
                raise _Abort(grpc.StatusCode.DATA_LOSS, f"scales checksum mismatch in chunk at page {first}")
            want = n * int(np.prod(self.scales_shape)) * 4
            if len(chunk.scales) != want:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"chunk carries {len(chunk.scales)} bytes of scales, {want} expected")
            scales = np.frombuffer(chunk.scales, np.float32).reshape(n, *self.scales_shape)
        elif chunk.scales:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "chunk carries scales, this worker's pages have none")
        if chunk.in_ipc or chunk.in_shm:
            await self._land(res, chunk, first, n, scales)
        else:
            if chunk.codec != res.codec:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"chunk codec {chunk.codec!r}, agreed {res.codec!r}")
            if zlib.crc32(chunk.payload) != chunk.crc32:
                raise _Abort(grpc.StatusCode.DATA_LOSS, f"checksum mismatch in chunk at page {first}")
            try:
                pages = CODECS[res.codec].decode(chunk.payload, self.dtype, (n, *self.page_shape))
            except Exception as e:  # noqa: BLE001
                raise _Abort(grpc.StatusCode.DATA_LOSS, f"cannot decode chunk at page {first}: {e}") from None
            await self._write(res, first, n, pages, scales)
            if res.id not in self._res:
                raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the reservation lapsed during the transfer")
        res.received[first:first + n] = True
        res.shm_chunks += bool(chunk.in_shm)
        res.ipc_chunks += bool(chunk.in_ipc)
        res.raw_bytes += chunk.raw_nbytes
        res.wire_bytes += len(chunk.payload) + len(chunk.scales)
        res.deadline = time.monotonic() + self.timeout_s     # progress renews the reservation
        if self.metrics is not None:
            self.metrics.transfer_raw.inc(chunk.raw_nbytes)
            self.metrics.transfer_wire.inc(len(chunk.payload) + len(chunk.scales))

    async def _write(self, res: _Reservation, first: int, n: int, pages, scales) -> None:
        try:
            w = self.pool.write(res.pages[first:first + n], pages, scales)
            if inspect.isawaitable(w):
                await w
        except Exception as e:  # noqa: BLE001 - the pool could not store them
            raise _Abort(grpc.StatusCode.INTERNAL, f"cannot store chunk at page {first}: {e}") from None

    async def _land(self, res: _Reservation, chunk, first: int, n: int, scales) -> None:
        """A same-host chunk: queue its copy into the reservation's landing (shared memory or IPC buffer -> the
        pool's device); verification and the pool write happen once, after the last chunk (``_finish_landing``)."""
        ipc = chunk.in_ipc
        where = "the IPC buffer" if ipc else "shared memory"
        region, plane = (res.ipc_offset, self.ipc) if ipc else (res.shm_offset, self.arena)
        if region is None or plane is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, f"chunk is in {where}, none was granted")
        if res.landing is None:
            res.landing = kv_shm.Landing(len(res.pages), self.dtype, self.page_shape, self.device, self.copier)
        offset = region + first * self.page_nbytes
        try:
            if ipc:
                res.landing.put_ipc(self.ipc.ptr + offset, first, n)
            else:
                slow = res.landing.put_shm(self.arena.seg, offset, first, n)
                if slow is not None:
                    await asyncio.to_thread(slow)
        except Exception as e:  # noqa: BLE001
            raise _Abort(grpc.StatusCode.INTERNAL, f"cannot read chunk at page {first} from {where}: "
                                                   f"{type(e).__name__}: {e}") from None
        res.sums[first] = chunk.checksum64
        if scales is not None:
            if res.scales is None:
                res.scales = np.zeros((len(res.pages), *self.scales_shape), np.float32)
            res.scales[first:first + n] = scales
        if res.id not in self._res:
            raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the reservation lapsed during the transfer")

    async def _finish_landing(self, res: _Reservation) -> None:
        """All chunks are in: wait for the copies, checksum every chunk where it landed (one device program), compare
        with the sender's, then one pool write."""
        land = res.landing
        try:
            rows, got = await asyncio.to_thread(land.finish)
        except Exception as e:  # noqa: BLE001
            raise _Abort(grpc.StatusCode.INTERNAL, f"cannot land the pages: {type(e).__name__}: {e}") from None
        res.marks["landed_checked"] = time.perf_counter()
        for first, want in sorted(res.sums.items()):
            if got.get(first) != want:
                where = "shared-memory" if res.shm_chunks else "IPC"
                raise _Abort(grpc.StatusCode.DATA_LOSS, f"checksum mismatch in {where} chunk at page {first} "
                                                        f"({got.get(first, 0):#x}, sender {want:#x})")
        parts = sorted(land.parts)
        if sum(m for _, m in parts) == len(res.pages):
            await self._write(res, 0, len(res.pages), rows, res.scales)
        else:     # some chunks came in the gRPC stream (already written): write the landed ones only
            for first, m in parts:
                await self._write(res, first, m, rows[first:first + m],
                                  None if res.scales is None else res.scales[first:first + m])
        res.marks["written"] = time.perf_counter()
        res.landing = None

    async def Release(self, req, context):
        res = self._res.get(req.reservation_id)
        if res is None:
            return kvpb.ReleaseResponse(released=False)
        self._fail(res, f"released by the sender: {req.reason or 'no reason given'}")
        return kvpb.ReleaseResponse(released=True)


class _NotAChunk:
    """A message of a transfer call that is not a chunk where one must be (``_push`` refuses it)."""

    def __init__(self, reason: str):
        self.reason = reason


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _kv_method(make_handler, behaviour, request_type, response_type) -> grpc.RpcMethodHandler:
    return make_handler(behaviour, request_deserializer=lenient_deserializer(request_type),
                        response_serializer=response_type.SerializeToString)


def kv_service_handler(receiver: KVReceiver) -> grpc.GenericRpcHandler:
    """The KVTransfer service for a grpc.aio server: ``server.add_generic_rpc_handlers((handler,))``."""
    handlers = {
        "Announce": _kv_method(grpc.unary_unary_rpc_method_handler, receiver.Announce, kvpb.AnnounceRequest,
                               kvpb.AnnounceResponse),
        "PushKV": _kv_method(grpc.stream_unary_rpc_method_handler, receiver.PushKV, kvpb.KVChunk, kvpb.PushResult),
        "Transfer": _kv_method(grpc.stream_stream_rpc_method_handler, receiver.Transfer, kvpb.TransferMessage,
                               kvpb.TransferReply),
        "Release": _kv_method(grpc.unary_unary_rpc_method_handler, receiver.Release, kvpb.ReleaseRequest,
                              kvpb.ReleaseResponse),
    }
    return grpc.method_handlers_generic_handler(KV_SERVICE_NAME, handlers)


# -- prefill side ----------------------------------------------------------------------------------------------
class TransferError(RuntimeError):
    """The transfer failed; ``code`` is the gRPC status (UNAVAILABLE when the decode worker is gone)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


@dataclass
class SendStats:
    reservation_id: str
    codec: str
    pages: int
    raw_bytes: int
    wire_bytes: int
    announce_s: float
    push_s: float
    shm: bool = False              # pages did not travel in the gRPC stream (shared memory or CUDA IPC)
    path: str = "grpc"             # "ipc", "shm" or "grpc"
    extra: dict = field(default_factory=dict)


def host_pages(pages, n: int) -> np.ndarray:
    """Rows [0, n) of ``pages`` on the host (a device array goes through pinned host memory when it can)."""
    if isinstance(pages, np.ndarray):
        return pages[:n]
    import jax

    try:
        return np.asarray(jax.device_put(pages, pages.sharding.with_memory_kind("pinned_host")))[:n]
    except Exception:  # noqa: BLE001 - no pinned_host memory on this backend
        return np.asarray(jax.device_get(pages))[:n]


class KVSender:
    """Prefill side: ``await send(request_id, pages)`` announces, then streams the pages chunk by chunk (through
    the receiver's shared memory when it grants a region, else in the chunks' payload)."""

    def __init__(self, channel: grpc.aio.Channel, *, codecs: Sequence[str] = ("raw",), chunk_pages: int = 16,
                 timeout_s: float = 30.0, metrics=None, shm: bool = True, copier: str | kv_shm.HostCopier = "auto",
                 ipc: bool = True, fast_chunk_bytes: int = 64 << 20, fast_min_chunk_bytes: int = 8 << 20,
                 fast_chunks: int = 16, one_call: bool = False):
        """``chunk_pages``: pages per chunk in the gRPC stream. Through shared memory a transfer is cut into about
        ``fast_chunks`` chunks of ``fast_min_chunk_bytes``..``fast_chunk_bytes`` (pipelining the two copies); through
        CUDA IPC it is one chunk (see ``fast_chunk_pages``). ``one_call``: announce and chunks on one ``Transfer``
        call (one RPC set-up instead of two; same checks and failure handling; off until measured on a GPU)."""
        unknown = [c for c in codecs if c not in CODECS]
        if unknown:
            raise ValueError(f"unknown codecs {unknown}; registered: {sorted(CODECS)}")
        if chunk_pages < 1:
            raise ValueError(f"chunk_pages must be >= 1, got {chunk_pages}")
        self.codecs, self.chunk_pages, self.timeout_s, self.metrics = list(codecs), chunk_pages, timeout_s, metrics
        self.shm, self._copier, self.ipc, self.fast_chunk_bytes = shm, copier, ipc, fast_chunk_bytes
        self.fast_min_chunk_bytes, self.fast_chunks, self.one_call = fast_min_chunk_bytes, fast_chunks, one_call
        p = f"/{KV_SERVICE_NAME}/"
        self._announce = channel.unary_unary(p + "Announce", request_serializer=kvpb.AnnounceRequest.SerializeToString,
                                             response_deserializer=kvpb.AnnounceResponse.FromString)
        self._push = channel.stream_unary(p + "PushKV", request_serializer=kvpb.KVChunk.SerializeToString,
                                          response_deserializer=kvpb.PushResult.FromString)
        self._release = channel.unary_unary(p + "Release", request_serializer=kvpb.ReleaseRequest.SerializeToString,
                                            response_deserializer=kvpb.ReleaseResponse.FromString)
        self._transfer = channel.stream_stream(p + "Transfer",
                                               request_serializer=kvpb.TransferMessage.SerializeToString,
                                               response_deserializer=kvpb.TransferReply.FromString)

    @property
    def copier(self) -> kv_shm.HostCopier:
        if isinstance(self._copier, str):
            self._copier = kv_same_host.copier_named(self._copier)
        return self._copier

    async def _chunks_async(self, reservation_id: str, codec: str, pages, scales=None, n: int | None = None):
        for i, chunk in enumerate(self.chunks(reservation_id, codec, pages, scales, n)):
            await self.before_chunk(i)
            yield chunk
            await asyncio.sleep(0)

    async def before_chunk(self, index: int) -> None:
        """Called before chunk ``index`` of a transfer leaves (any data plane); nothing here. Subclasses use it to
        pace or to fail a transfer on purpose (``serving.testing.StallingSender``)."""

    def _scales_fields(self, scales, first: int, m: int) -> dict:
        if scales is None:
            return {}
        b = np.ascontiguousarray(scales[first:first + m], np.float32).tobytes()
        return {"scales": b, "scales_crc32": zlib.crc32(b)}

    def chunks(self, reservation_id: str, codec: str, pages, scales=None, n: int | None = None):
        """Payload chunks (the gRPC byte path): pages host or device, first ``n`` rows."""
        enc = CODECS[codec]
        n = pages.shape[0] if n is None else n
        pages = host_pages(pages, n)
        for first in range(0, n, self.chunk_pages):
            part = pages[first:first + self.chunk_pages]
            payload = enc.encode(part)
            yield kvpb.KVChunk(reservation_id=reservation_id, first_page=first, num_pages=part.shape[0], codec=codec,
                               raw_nbytes=part.nbytes, payload=payload, crc32=zlib.crc32(payload),
                               last=first + self.chunk_pages >= n, **self._scales_fields(scales, first, part.shape[0]))

    def fast_chunk_pages(self, pages, n: int | None = None, *, ipc: bool = False) -> int:
        """Pages per chunk through shared memory (``ipc=False``) or the CUDA IPC buffer for ``n`` rows of ``pages``.

        IPC: one chunk (the device-to-device copy runs at ~2 TB/s; a chunk only adds fixed costs). Shared memory:
        about ``fast_chunks`` chunks, each ``fast_min_chunk_bytes``..``fast_chunk_bytes`` (at least one page), so the
        receiver's host -> device copy of chunk i overlaps the sender's device -> host copy of chunk i + 1 and only
        the last chunk's copy is not hidden. A power of two of pages (the checksum programs stay few), and at least
        ``chunk_pages``."""
        n = pages.shape[0] if n is None else int(n)
        if ipc:
            return next_pow2(n)
        row_bytes = int(np.prod(pages.shape[1:])) * np.dtype(pages.dtype).itemsize
        want = min(self.fast_chunk_bytes, max(self.fast_min_chunk_bytes, n * row_bytes // max(self.fast_chunks, 1)))
        return max(self.chunk_pages, prev_pow2(max(1, want // max(row_bytes, 1))))

    async def _fast_chunks(self, ann, pages, scales, n: int, c: int, sums: list[int], start, in_ipc: bool):
        """Chunks through a granted same-host region. All copies are queued first (``start(first, m, region offset)``
        returns a waiter), then each chunk's control message leaves as soon as its copy is done."""
        row_bytes = int(np.prod(pages.shape[1:])) * pages.dtype.itemsize
        region = ann.ipc_offset if in_ipc else ann.shm_offset
        if not isinstance(pages, np.ndarray) and not pages.is_ready():    # (ready: the checksums read it)
            await asyncio.to_thread(pages.block_until_ready)
        firsts = list(range(0, n, c))
        waits = [start(first, min(c, n - first), region + first * row_bytes) for first in firsts]
        for j, first in enumerate(firsts):
            await self.before_chunk(j)
            m = min(c, n - first)
            ready = getattr(waits[j], "ready", None)
            if ready is not None and ready():
                waits[j]()                          # copy already done: no thread hop
            else:
                await asyncio.to_thread(waits[j])
            yield kvpb.KVChunk(reservation_id=ann.reservation_id, first_page=first, num_pages=m, codec=ann.codec,
                               raw_nbytes=m * row_bytes, in_shm=not in_ipc, in_ipc=in_ipc, checksum64=sums[j],
                               last=first + c >= n, **self._scales_fields(scales, first, m))

    def _shm_chunks(self, ann, pages, scales, n: int, seg: kv_shm.ShmMapping, sums: list[int]):
        """Chunks through the granted shared-memory region (copier: device -> pinned segment, DMA)."""
        copier = self.copier
        return self._fast_chunks(ann, pages, scales, n, self.fast_chunk_pages(pages, n), sums,
                                 lambda first, m, off: copier.start_to_shm(pages, first, m, seg, off), False)

    def _ipc_chunks(self, ann, pages, scales, n: int, dst_ptr: int, sums: list[int]):
        """Chunks through the granted device region of the receiver's IPC buffer (device to device)."""
        return self._fast_chunks(ann, pages, scales, n, self.fast_chunk_pages(pages, n, ipc=True), sums,
                                 lambda first, m, off: kv_shm.start_copy_to_ipc(pages, first, m, dst_ptr + off), True)

    async def _rest_of_call(self, call, feed, chunks):
        """The chunks on the ``Transfer`` call, then its result (a status from the receiver as AioRpcError)."""
        feed.set_result(chunks)
        reply = await call.read()            # the result, or the receiver's status as AioRpcError
        if reply is grpc.aio.EOF or reply.WhichOneof("kind") != "result":
            code = await call.code()
            if code == grpc.StatusCode.OK:
                raise TransferError(grpc.StatusCode.INTERNAL, "the transfer call ended without a result")
            raise TransferError(code, await call.details())
        return reply.result

    async def send(self, request_id: str, pages, num_tokens: int = 0, *, num_pages: int | None = None,
                   scales=None) -> SendStats:
        """Move ``pages`` ([n, *page_shape], host numpy or a device array that may carry padding rows past
        ``num_pages``) and fp8 ``scales`` ([n, *scales_shape] or None) to the receiver."""
        if pages.ndim < 2 or pages.shape[0] < 1:
            raise ValueError(f"pages must be [num_pages >= 1, *page_shape], got shape {pages.shape}")
        n = pages.shape[0] if num_pages is None else int(num_pages)
        if not 1 <= n <= pages.shape[0]:
            raise ValueError(f"num_pages {num_pages} outside 1..{pages.shape[0]} (the rows given)")
        if scales is not None:
            scales = host_pages(scales, n)
        dtype_name = np.dtype(pages.dtype).name
        t0 = time.perf_counter()
        marks = {}
        pending = {}
        ipc = self.ipc and self.shm and kv_shm.ipc_capable(pages)
        c_shm = self.fast_chunk_pages(pages, n)
        c_ipc = self.fast_chunk_pages(pages, n, ipc=True)
        if self.shm:    # queued before the announce (no reservation waits on it, or on its compile), read after it
            sizes = {c_shm, c_ipc} if ipc else {c_shm}
            keys = {(tuple(pages.shape), np.dtype(pages.dtype).name, c) for c in sizes}
            if keys <= kv_same_host.CHECKSUMS_COMPILED:      # a dispatch (~0.1 ms): inline, no thread hop
                pending = kv_same_host.start_checksums(pages, n, sizes)
            else:                                # may compile: off the event loop
                pending = await asyncio.to_thread(kv_same_host.start_checksums, pages, n, sizes)
                kv_same_host.CHECKSUMS_COMPILED.update(keys)
            marks["checksums_queued"] = time.perf_counter() - t0
        announce = kvpb.AnnounceRequest(
            request_id=request_id, num_pages=n, num_tokens=num_tokens,
            layout=kvpb.PageLayout(dtype=dtype_name, shape=list(pages.shape[1:]),
                                   scales_shape=[] if scales is None else list(scales.shape[1:])),
            codecs=self.codecs, host_id=kv_shm.host_id() if self.shm else "", shm=self.shm, ipc=ipc, pid=os.getpid())
        call = feed = None
        try:
            if self.one_call:
                feed = asyncio.get_running_loop().create_future()     # the chunks, once the grant is in

                async def requests():      # consumed by gRPC (it stops by itself when the receiver ends the call)
                    yield kvpb.TransferMessage(announce=announce)
                    chunks = await feed
                    if chunks is not None:
                        async for c in chunks:
                            yield kvpb.TransferMessage(chunk=c)
                call = self._transfer(requests(), timeout=self.timeout_s)
                reply = await call.read()
                if reply is grpc.aio.EOF or reply.WhichOneof("kind") != "grant":
                    feed.set_result(None)
                    code = await call.code()
                    raise TransferError(grpc.StatusCode.INTERNAL if code == grpc.StatusCode.OK else code,
                                        f"announce of {request_id!r} failed: {await call.details() or 'no grant'}")
                ann = reply.grant
            else:
                ann = await self._announce(announce, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            if feed is not None and not feed.done():
                feed.set_result(None)
            raise TransferError(e.code(), f"announce of {request_id!r} failed: {e.details()}") from None
        t1 = time.perf_counter()
        chunks = None
        if ann.ipc_handle and c_ipc in pending:
            try:
                ptr = kv_shm.open_ipc(ann.ipc_handle)
                sums = await kv_same_host.checksums_when_ready(pending[c_ipc], n, c_ipc)
                marks["sums_read"] = time.perf_counter() - t0
                chunks = self._ipc_chunks(ann, pages, scales, n, ptr, sums)
            except Exception as e:  # noqa: BLE001 - cannot open it: shared memory or the byte stream
                log.warning("CUDA IPC buffer not usable (%s: %s): trying shared memory", type(e).__name__, e)
        if chunks is None and ann.shm_name and c_shm in pending:
            try:
                seg = kv_same_host.mapping(ann.shm_name)
                sums = await kv_same_host.checksums_when_ready(pending[c_shm], n, c_shm)
                marks["sums_read"] = time.perf_counter() - t0
                chunks = self._shm_chunks(ann, pages, scales, n, seg, sums)
            except Exception as e:  # noqa: BLE001 - cannot map it: the byte stream still works
                log.warning("shared-memory region %s not usable (%s): sending over gRPC", ann.shm_name, e)
        if chunks is None:
            chunks = self._chunks_async(ann.reservation_id, ann.codec, pages, scales, n)
        try:
            result = await (self._push(chunks, timeout=self.timeout_s) if call is None
                            else self._rest_of_call(call, feed, chunks))
        except grpc.aio.AioRpcError as e:
            raise TransferError(e.code(), f"transfer of {request_id!r} failed: {e.details()}") from None
        except BaseException:
            if call is not None:
                if not feed.done():
                    feed.set_result(None)
                call.cancel()
            try:   # our side failed (cancelled, encoder error): tell the decode side now, do not wait for its timeout
                await asyncio.shield(self._release(kvpb.ReleaseRequest(reservation_id=ann.reservation_id,
                                                                       reason="sender failed"), timeout=5))
            except Exception:  # noqa: BLE001
                pass
            raise
        if self.metrics is not None:
            self.metrics.transfer_raw.inc(result.raw_bytes)
            self.metrics.transfer_wire.inc(result.wire_bytes)
        marks["announced"], marks["acknowledged"], marks["started_at"] = t1 - t0, time.perf_counter() - t0, t0
        return SendStats(ann.reservation_id, result.path if result.shm else ann.codec, result.pages,
                         result.raw_bytes, result.wire_bytes, t1 - t0, time.perf_counter() - t1, shm=result.shm,
                         path=result.path or "grpc", extra={"marks_s": marks})


DRAIN_BEFORE_ABORT_S = 10.0


async def _drain(request_iterator, timeout_s: float) -> None:
    """Read and drop what is left of a client stream (at most timeout_s seconds; errors ignored)."""
    async def rest():
        async for _ in request_iterator:
            pass
    try:
        await asyncio.wait_for(rest(), timeout_s)
    except Exception:  # noqa: BLE001 - the stream may already be broken or cancelled: nothing left to drain
        pass
