"""The router of prefill/decode disaggregation: places each request on a prefill worker, then a decode worker.

``Router`` stands where a colocated server has its ``EngineLoop`` (same ``submit`` / ``abort`` / ``start`` /
``stop``), so the public tbjax.v1 servicer is unchanged: it validates, submits, and streams what arrives on
the request's ``RequestStream``. Per request the router runs one task on the serving loop:
``Prefill`` on a prefill worker (which answers the first token, then pushes the KV to the chosen decode worker
and says when it is done), then ``Decode`` on that decode worker, forwarding every output. Workers are taken
round robin. Every call has a deadline (``timeout_s`` without progress for one step of the protocol);
a worker that dies or cannot be reached fails the request with ``WorkerError(UNAVAILABLE)``, which the
servicer sends to the client. Aborting a request (client gone, deadline, drain) cancels its task, and the
cancelled calls make the workers drop what they hold.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

import grpc

from tbjax.engine.engine import RequestOutput

from .engine_loop import Admitted, EngineStopped, RequestStream
from .pd_worker import PD_SERVICE, dumps, loads, params_to_dict

__all__ = ["Router", "WorkerError"]

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker call failed; ``code`` is the gRPC status to give the client."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class Router:
    def __init__(self, prefill_workers: list[str], decode_workers: list[str], *, timeout_s: float = 60.0):
        if not prefill_workers or not decode_workers:
            raise ValueError(f"a router needs at least one prefill and one decode worker, got prefill="
                             f"{prefill_workers!r} decode={decode_workers!r}")
        self.prefill_workers, self.decode_workers = list(prefill_workers), list(decode_workers)
        self.timeout_s = timeout_s
        self._rr_p, self._rr_d = itertools.cycle(range(len(prefill_workers))), itertools.cycle(range(len(decode_workers)))
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._stopped = False
        self.engine = None          # no engine here: the workers have them
        self.warmup_info = None

    # -- EngineLoop's interface ---------------------------------------------------------------------------
    def start(self) -> "Router":
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        self._stopped = True
        for t in list(self._tasks.values()):
            t.get_loop().call_soon_threadsafe(t.cancel)

    def inbox_size(self) -> int:
        return 0

    @property
    def alive(self) -> bool:
        return not self._stopped

    @property
    def ready(self) -> bool:
        """Ready at once: the workers report their own readiness; a request to one still warming up fails there."""
        return not self._stopped

    def wait_ready(self, timeout: float | None = None) -> bool:
        return True

    def startup_status(self) -> str:
        return "the router is starting"

    def call(self, fn):
        """No engine in this process: the Future fails with EngineStopped."""
        import concurrent.futures
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_exception(EngineStopped("the router has no engine in this process (its workers do)"))
        return fut

    def submit_many(self, requests) -> None:
        for rid, ids, params, stream in requests:
            self.submit(rid, ids, params, stream)

    def stats(self) -> dict:
        return {"running": len(self._tasks)}

    def submit(self, request_id: str, prompt_token_ids: list[int], params, stream: RequestStream, adder=None) -> None:
        if self._stopped:
            raise EngineStopped("the router is stopped")
        task = stream.loop.create_task(self._run(request_id, list(prompt_token_ids), params, stream))
        self._tasks[request_id] = task
        task.add_done_callback(lambda t, rid=request_id: self._tasks.pop(rid, None)
                               if self._tasks.get(rid) is t else None)

    def abort(self, request_id: str) -> None:
        t = self._tasks.pop(request_id, None)
        if t is not None:
            t.cancel()

    # -- one request --------------------------------------------------------------------------------------
    def _channel(self, target: str) -> grpc.aio.Channel:
        ch = self._channels.get(target)
        if ch is None:
            ch = self._channels[target] = grpc.aio.insecure_channel(target)
        return ch

    def _call(self, target: str, method: str, msg: dict):
        rpc = self._channel(target).unary_stream(f"/{PD_SERVICE}/{method}", request_serializer=lambda b: b,
                                                 response_deserializer=lambda b: b)
        return rpc(dumps(msg))

    async def _next(self, call, what: str):
        try:
            b = await asyncio.wait_for(call.read(), self.timeout_s)
        except asyncio.TimeoutError:
            call.cancel()
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"{what}: no answer within {self.timeout_s:g} s") from None
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                        grpc.StatusCode.DATA_LOSS, grpc.StatusCode.DEADLINE_EXCEEDED):
                code = grpc.StatusCode.UNAVAILABLE if code != grpc.StatusCode.INTERNAL else code
            raise WorkerError(code, f"{what}: {e.code().name}: {e.details()}") from None
        if b is grpc.aio.EOF:
            return None
        return loads(b)

    async def _run(self, rid: str, ids: list[int], params, stream: RequestStream) -> None:
        put = stream.put
        put(Admitted(time.perf_counter()))
        wid = f"{rid}-{uuid.uuid4().hex[:12]}"      # ids on the workers: unique even if clients reuse theirs
        pw = self.prefill_workers[next(self._rr_p)]
        dw = self.decode_workers[next(self._rr_d)]
        pd = params_to_dict(params)
        calls = []
        try:
            pcall = self._call(pw, "Prefill", {"id": wid, "prompt_token_ids": ids, "params": pd, "decode": dw})
            calls.append(pcall)
            m = await self._next(pcall, f"prefill worker {pw}")
            if m is None or "first" not in m:
                raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"prefill worker {pw} ended without a first token")
            f = m["first"]
            done = f["finish_reason"] == "stop" or params.max_tokens <= 1
            reason = f["finish_reason"] if done else None
            put(RequestOutput(rid, f["token_ids"], f["text"], done, reason, f["logprobs"]))
            m = await self._next(pcall, f"KV transfer {pw} -> {dw}")
            if m is None or "done" not in m:
                raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"prefill worker {pw} ended before the KV transfer")
            if done:
                return
            dcall = self._call(dw, "Decode", {"id": wid, "prompt_token_ids": ids, "first_token": f["token_ids"][0],
                                              "params": pd})
            calls.append(dcall)
            while True:
                m = await self._next(dcall, f"decode worker {dw}")
                if m is None:
                    raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"decode worker {dw} ended the stream early")
                put(RequestOutput(rid, m["token_ids"], m["text"], m["finished"], m["finish_reason"], m["logprobs"]))
                if m["finished"]:
                    return
        except asyncio.CancelledError:
            raise
        except WorkerError as e:
            put(e)
        except Exception as e:  # noqa: BLE001 - never leave the client's stream without a terminal item
            log.exception("router task of %s failed", rid)
            put(WorkerError(grpc.StatusCode.INTERNAL, f"router: {type(e).__name__}: {e}"))
        finally:
            for c in calls:
                c.cancel()

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
