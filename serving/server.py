"""The gRPC front end: the tbjax.v1 servicer, health checking, reflection, and the server's life cycle.

``Server`` puts together a ``grpc.aio`` server on one asyncio loop, the ``EngineLoop`` thread that owns
the engine (or, with ``engine_factory``, an ``EngineProcess``: the engine in a child process, off this
process's GIL), and the Prometheus endpoint. The servicer never touches the engine: it validates a request
(``limits``), hands it to the engine thread and streams what comes back. Whatever ends an RPC early (the
client goes away, its deadline passes, the server drains) runs the handler's ``finally``, which aborts the
request in the engine and so frees its KV pages.

Start-up (``Server.start`` = ``listen`` + ``wait_ready``): the server listens first, with health NOT_SERVING (for ""
and tbjax.v1.Tbjax) and ``tbjax_ready`` 0; with ``warmup=True`` the engine thread (or the engine's child process)
then compiles every program the engine can run before it takes a request; meanwhile ``Generate`` is refused with
UNAVAILABLE saying how far the warm-up got (never queued: a client must not hang on a server that is compiling).
Then health turns SERVING and ``tbjax_ready`` 1. ``Tokenize`` and ``ModelInfo`` never touch the engine and answer
throughout.

Admission (``TbjaxServicer.admit``, shared with HTTP): ``max_concurrent_requests`` requests run (are handed to the
engine) at once; more wait in the server's queue, oldest first, up to ``max_queued_requests``; beyond that
RESOURCE_EXHAUSTED. Validation (tokenizing in threads, ``limits.max_tokenize_concurrency`` at once) runs while a
request waits.

Security (``Server(tls_cert=, tls_key=, api_key=, reflection=)``, the CLI's ``--tls-cert`` / ``--tls-key`` /
``--api-key`` / ``--no-reflection``): TLS for gRPC (``grpc.ssl_server_credentials``) and the HTTP API; with an API
key every RPC but gRPC health checking needs ``authorization: Bearer <key>`` metadata (``ApiKeyInterceptor``; health
stays open for probes and says only SERVING / NOT_SERVING), else UNAUTHENTICATED.

``ServerThread`` runs a ``Server`` on a loop in a background thread (tests, notebooks, the load tool).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .api import API_VERSION, FINISH_REASONS, METHODS, SERVICE_NAME, Undecodable, lenient_deserializer, pb
from .engine_loop import Admitted, EngineFailed, EngineLoop, EngineStopped, RequestStream
from .limits import (SHOWN_CHARS, Limits, RequestError, StreamFailed, build_params, check_generate, check_request_id,
                     check_tokenize, shown, take_stops)
from .metrics import ServerMetrics
from .model import ServedModel

__all__ = ["TbjaxServicer", "Server", "ServerThread", "new_event_loop", "Chunk", "StreamFailed", "Slot"]

log = logging.getLogger(__name__)
# one INFO line per finished request (id, protocol, prompt / output tokens, TTFT, duration, finish reason or outcome)
request_log = logging.getLogger("tbjax.requests")


def _top_msgs(top) -> list:
    items = top.items() if isinstance(top, dict) else (top or ())
    return [pb.TopLogprob(token_id=int(t), logprob=float(v)) for t, v in items]


def _logprobs_msgs(token_ids: list[int], lps) -> list:
    """Engine logprobs -> TokenLogprob messages. Per new token the engine gives
    ``(token_logprob, [(id, logprob), ...top-n])``; a ``{id: logprob}`` dict (top-n plus the sampled token)
    is accepted too."""
    msgs = []
    for tok, lp in zip(token_ids, lps or ()):
        if isinstance(lp, dict):
            top = sorted(lp.items(), key=lambda kv: -kv[1])
            msgs.append(pb.TokenLogprob(token_id=tok, logprob=float(lp.get(tok, float("nan"))), top=_top_msgs(top)))
        else:
            value, top = lp
            msgs.append(pb.TokenLogprob(token_id=tok, logprob=float(value), top=_top_msgs(top)))
    return msgs


@dataclass
class Chunk:
    """What one request's stream hands its front end at a time: new tokens (merged when the front end fell behind),
    their text and logprobs; the last one has ``finished`` and ``finish_reason``."""

    token_ids: list
    text: str
    logprobs: list
    finished: bool = False
    finish_reason: str | None = None


class Slot:
    """One accepted request's place in the server's admission counters: running (it may be handed to the engine)
    or waiting (queued) for a running place; ``wait_turn()`` waits until it runs. ``release()`` gives it back once,
    counting the request under ``outcome``, and lets the oldest waiting request run."""

    __slots__ = ("servicer", "queued", "outcome", "released", "_turn")

    def __init__(self, servicer: "TbjaxServicer", running: bool):
        self.servicer = servicer
        self.queued = not running
        self.outcome = "cancelled"
        self.released = False
        self._turn: asyncio.Future | None = None if running else asyncio.get_running_loop().create_future()

    async def wait_turn(self) -> None:
        """Return once this request holds a running place (at once when it was admitted as running)."""
        if self._turn is not None and self.queued:
            await asyncio.shield(self._turn)

    def dequeue(self) -> None:   # waiting -> running (the servicer's _promote)
        if self.queued:
            self.queued = False
            self.servicer.num_queued -= 1
            if self._turn is not None and not self._turn.done():
                self._turn.set_result(None)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        sv = self.servicer
        if self.queued:
            self.queued = False
            sv.num_queued -= 1
            with contextlib.suppress(ValueError):
                sv._waiting.remove(self)
        sv.num_inflight -= 1
        sv._promote()
        sv._set_gauges()
        sv.metrics.requests.labels(outcome=self.outcome).inc()


async def _send(context, resp, rid: str) -> None:
    """Write one streamed response. A write the transport refuses means the client reset or cancelled the stream
    (the cancellation may not have reached grpc yet): end the handler as cancelled, which grpc logs at DEBUG,
    instead of letting the failed batch surface as an ERROR traceback per stream."""
    try:
        await context.write(resp)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - ExecuteBatchError / UsageError from a dead call
        log.debug("request %s: write failed (%s): the client is gone", shown(rid), type(e).__name__)
        raise asyncio.CancelledError() from e


class TbjaxServicer:
    """Implements tbjax.v1.Tbjax over an ``EngineLoop``. Runs on the server's asyncio loop only. Its admission
    (``admit``) and request streams (``stream``) are shared with the HTTP front end (serving/http_api.py), so that
    both count against the same limits and metrics."""

    def __init__(self, model: ServedModel, engine_loop: EngineLoop, limits: Limits, metrics: ServerMetrics,
                 role: str = "colocated"):
        self.model = model
        self.engine_loop = engine_loop
        self.limits = limits
        self.metrics = metrics
        self.role = role
        self._active: dict[str, RequestStream] = {}
        self.num_inflight = 0   # accepted, not finished (running + queued)
        self.num_queued = 0     # accepted, waiting for a running place (limit max_queued_requests)
        self._waiting: collections.deque[Slot] = collections.deque()   # the queued slots, oldest first
        self.ready = False      # set by Server once the engine is warmed up
        # tokenizing (and chat templates) runs in threads, at most this many at once (gRPC and HTTP together)
        self.tokenize_sem = asyncio.Semaphore(limits.max_tokenize_concurrency)
        # the prompt token limit that applies: the configured one, no larger than the model's context less one and
        # than what the KV cache holds for one sequence (StepEngine.kv_tokens_per_sequence)
        cap = limits.prompt_limit(model.max_context)
        kv = self.kv_tokens = None if engine_loop.engine is None else engine_loop.engine.kv_tokens_per_sequence
        self.prompt_cap = cap if kv is None else max(1, min(cap, kv))
        # the most tokens one request can generate here (one prompt token at least; the KV pool bounds both)
        self.max_tokens_cap = min(limits.max_tokens, model.max_context - 1, *(() if kv is None else (kv,)))
        self.prompt_cap_note = (f" (what the KV cache's pages hold for one sequence: {kv} tokens)"
                                if kv is not None and kv < cap else "")

    @property
    def num_running(self) -> int:
        """Accepted and holding a running place: handed (or about to be handed) to the engine, not finished."""
        return self.num_inflight - self.num_queued

    async def tokenize(self, fn, *args, **kw):
        """``fn(*args, **kw)`` in a thread, at most ``limits.max_tokenize_concurrency`` at once."""
        async with self.tokenize_sem:
            return await asyncio.to_thread(fn, *args, **kw)

    def _startup_message(self) -> str:
        return self.engine_loop.startup_status()

    # -- helpers -------------------------------------------------------------------------------------------
    async def _reject(self, context, code: grpc.StatusCode, message: str):
        self.metrics.rejected.labels(code=code.name).inc()
        try:
            await context.abort(code, message)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - the status could not be sent: the client is gone (see _send)
            log.debug("status %s not sent (%s): the client is gone", code.name, type(e).__name__)
            raise asyncio.CancelledError() from e

    def _set_gauges(self) -> None:
        self.metrics.inflight.set(self.num_inflight)
        self.metrics.queued.set(self.num_queued)

    # -- shared by the front ends --------------------------------------------------------------------------
    def admit(self, n: int = 1) -> list[Slot]:
        """Take ``n`` places for requests, or raise ``RequestError(RESOURCE_EXHAUSTED)`` naming the limit (nothing
        taken then). A request runs (is handed to the engine) while fewer than ``max_concurrent_requests`` run;
        otherwise it waits in the server's queue (``Slot.wait_turn``), which holds at most ``max_queued_requests``.
        The ``n`` requests of one HTTP call all run or all wait (behind the ones waiting already)."""
        lim = self.limits
        need = f", this one needs {n}" if n > 1 else ""
        if n > lim.max_concurrent_requests:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"server busy: this request needs {n} running requests at once, more than the limit "
                               f"of {lim.max_concurrent_requests}")
        running = self.num_running
        if not self._waiting and running + n <= lim.max_concurrent_requests:
            slots = [Slot(self, running=True) for _ in range(n)]
        elif self.num_queued + n <= lim.max_queued_requests:
            slots = [Slot(self, running=False) for _ in range(n)]
            self._waiting.extend(slots)
            self.num_queued += n
        else:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"server busy: {running} requests running (limit {lim.max_concurrent_requests}) and "
                               f"{self.num_queued} waiting, queue full (limit {lim.max_queued_requests}{need}); "
                               "retry later")
        self.num_inflight += n
        self._set_gauges()
        return slots

    def _promote(self) -> None:
        """Let the oldest waiting requests run while there is room."""
        while self._waiting and self.num_running < self.limits.max_concurrent_requests:
            self._waiting.popleft().dequeue()

    def submit(self, slot: Slot, rid: str, prompt_ids: list[int], params) -> RequestStream:
        """Hand an admitted, validated request to the engine; returns its stream (for ``stream``). Raises
        RequestError (ALREADY_EXISTS for an id in flight, UNAVAILABLE when the engine has stopped)."""
        if rid in self._active:
            slot.outcome = "rejected"
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request id {shown(rid)} is already in flight")
        stream = RequestStream(asyncio.get_running_loop(), rid)
        try:
            self.engine_loop.submit(rid, prompt_ids, params, stream)
        except EngineStopped as e:
            slot.outcome = "unavailable"
            raise RequestError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        self._active[rid] = stream
        return stream

    async def stream(self, slot: Slot, stream: RequestStream, n_prompt: int, t_arrival: float, t_validated: float,
                     protocol: str = "grpc", stops=()):
        """The chunks of a submitted request (async generator; close it, e.g. with ``contextlib.aclosing``, when
        the caller stops early: that aborts the request in the engine and frees its KV pages). Raises
        ``StreamFailed`` when the engine refuses or fails it. ``stops``: the request's stop strings (``take_stops``),
        applied here; one found ends the request (and aborts it in the engine). Times and counts it in the metrics,
        and logs one INFO line when it ends."""
        rid = stream.request_id
        finished = False          # the engine does not hold the request any more (or we stopped it)
        engine_done = False
        matcher = None
        if stops:
            from tbjax.tokenizer import StopStrings
            tok = self.model.tokenizer
            matcher = StopStrings(stops, lambda ids: tok.decode(ids, skip_special_tokens=True))
        t_admit = t_validated
        t_first = t_last = None
        n_out = 0
        reason = None
        try:
            while True:
                batch = await stream.get_all()
                new_ids, text, lps, error = [], [], [], None
                for item in batch:    # Admitted / outputs (merged into one chunk) / an exception
                    if isinstance(item, Admitted):
                        t_admit = item.time
                        self.metrics.phase.labels(phase="queue").observe(t_admit - t_validated)
                        self.metrics.prompt_tokens.inc(n_prompt)
                    elif isinstance(item, BaseException):
                        error = item
                        break
                    else:
                        new_ids.extend(item.new_token_ids)
                        text.append(item.text_delta or "")
                        if item.logprobs:
                            lps.extend(item.logprobs)
                        if item.finished:
                            finished, reason = True, item.finish_reason or "stop"
                            break
                if error is not None:
                    finished = True   # the engine does not hold the request any more
                engine_done = finished
                if matcher is not None and error is None and (new_ids or finished):
                    kept, out, hit = matcher.feed(new_ids, "".join(text), final=finished)
                    if hit:
                        lps = lps[:len(kept)]
                        finished, reason = True, "stop"
                    new_ids, text = kept, [out]
                now = time.perf_counter()
                if new_ids:
                    if t_first is None:
                        t_first = now
                        self.metrics.ttft.observe(now - t_arrival)
                        self.metrics.phase.labels(phase="first_token").observe(now - t_admit)
                    else:
                        self.metrics.itl.observe(now - t_last)
                    t_last = now
                    n_out += len(new_ids)
                    self.metrics.output_tokens.inc(len(new_ids))
                if finished and error is None:
                    slot.outcome = reason
                    self.metrics.e2e.observe(now - t_arrival)
                    if t_first is not None:
                        self.metrics.phase.labels(phase="decode").observe(now - t_first)
                        if n_out > 1:
                            self.metrics.tpot.observe((t_last - t_first) / (n_out - 1))
                if new_ids or (finished and error is None):
                    yield Chunk(new_ids, "".join(text), lps, finished and error is None,
                                reason if error is None else None)
                if error is not None:
                    if isinstance(getattr(error, "code", None), grpc.StatusCode):   # a worker's status (router)
                        code = error.code
                        slot.outcome = "unavailable" if code == grpc.StatusCode.UNAVAILABLE else "error"
                    elif isinstance(error, EngineStopped):
                        slot.outcome, code = "unavailable", grpc.StatusCode.UNAVAILABLE
                    elif isinstance(error, EngineFailed):
                        slot.outcome, code = "error", grpc.StatusCode.INTERNAL
                    elif isinstance(error, ValueError):   # refused by the engine (e.g. RequestTooLarge)
                        slot.outcome, code = "rejected", grpc.StatusCode.INVALID_ARGUMENT
                    else:
                        slot.outcome, code = "error", grpc.StatusCode.INTERNAL
                    msg = str(error) or type(error).__name__
                    if len(rid) > SHOWN_CHARS:   # engine messages name the request: never echo a long id
                        msg = msg.replace(repr(rid), shown(rid))
                    raise StreamFailed(code, msg[:2048])
                if finished:
                    return
        finally:
            if not engine_done:
                self.engine_loop.abort(rid)   # client gone / deadline / drain / stop string: free its pages now
            self._active.pop(rid, None)
            now = time.perf_counter()
            request_log.info("request %s (%s): %d prompt + %d output tokens, ttft %s, %.3f s, finish %s", rid,
                             protocol, n_prompt, n_out, "-" if t_first is None else f"{t_first - t_arrival:.3f} s",
                             now - t_arrival, reason if finished and reason else slot.outcome)

    # -- RPCs ----------------------------------------------------------------------------------------------
    async def Generate(self, request, context):
        t_arrival = time.perf_counter()
        if isinstance(request, Undecodable):
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"cannot parse {request.type_name}: {request.reason[:200]}")
        if not self.ready:   # still compiling: say so at once rather than queue behind the warm-up
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, self._startup_message())
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await self._reject(context, grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline has already passed")
        try:
            check_request_id(request.request_id, self.limits)
            slot, = self.admit()
        except RequestError as e:
            await self._reject(context, e.code, e.message)
        try:
            m = self.model
            try:
                kw = dict(model_name=m.name, tokenizer=m.tokenizer, vocab_size=m.vocab_size,
                          max_context=m.max_context, limits=self.limits, prompt_cap=self.prompt_cap,
                          prompt_cap_note=self.prompt_cap_note, kv_tokens=self.kv_tokens)
                if request.WhichOneof("input") == "prompt_token_ids" and len(request.prompt_token_ids.ids) <= 4096:
                    checked = check_generate(request, **kw)   # ~0.15 ms for 1k ids: cheaper than a thread hop
                else:   # tokenizing / chat templates can take milliseconds: off the loop, a few at a time
                    checked = await self.tokenize(check_generate, request, **kw)
                params = build_params(m.make_params, checked.params, m.vocab_size)
            except RequestError as e:
                slot.outcome = "rejected"
                await self._reject(context, e.code, e.message)
            await slot.wait_turn()   # over max_concurrent_requests: wait in the queue (validated meanwhile)
            rid = request.request_id or uuid.uuid4().hex
            t_validated = time.perf_counter()
            self.metrics.phase.labels(phase="tokenize").observe(t_validated - t_arrival)
            n_prompt = len(checked.prompt_token_ids)
            stops = take_stops(params)
            try:
                stream = self.submit(slot, rid, checked.prompt_token_ids, params)
            except RequestError as e:
                await self._reject(context, e.code, e.message)
            n_out = 0
            async with contextlib.aclosing(self.stream(slot, stream, n_prompt, t_arrival, t_validated,
                                                       stops=stops)) as chunks:
                try:
                    async for ch in chunks:
                        n_out += len(ch.token_ids)
                        resp = pb.GenerateResponse(request_id=rid, token_ids=ch.token_ids, text=ch.text)
                        if ch.logprobs:
                            resp.logprobs.extend(_logprobs_msgs(ch.token_ids, ch.logprobs))
                        if ch.finished:
                            resp.finish_reason = FINISH_REASONS.get(ch.finish_reason, pb.FINISH_REASON_ABORT)
                            resp.usage.prompt_tokens = n_prompt
                            resp.usage.completion_tokens = n_out
                        await _send(context, resp, rid)
                except StreamFailed as e:
                    await self._reject(context, e.code, e.message)
                except (asyncio.CancelledError, GeneratorExit):   # the client went away / its deadline passed
                    log.debug("request %s: cancelled by the client or its deadline", shown(rid))
                    raise
        finally:
            slot.release()

    async def Tokenize(self, request, context):
        if isinstance(request, Undecodable):
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"cannot parse {request.type_name}: {request.reason[:200]}")
        m = self.model
        try:
            ids = await self.tokenize(check_tokenize, request, model_name=m.name, tokenizer=m.tokenizer,
                                      vocab_size=m.vocab_size, limits=self.limits, max_context=self.prompt_cap + 1)
        except RequestError as e:
            await self._reject(context, e.code, e.message)
        return pb.TokenizeResponse(token_ids=ids)

    async def ModelInfo(self, request, context):
        m, lim = self.model, self.limits
        return pb.ModelInfoResponse(
            model=m.name, arch=m.arch, vocab_size=m.vocab_size, max_context=m.max_context,
            max_prompt_tokens=self.prompt_cap, max_tokens_limit=self.max_tokens_cap,
            default_max_tokens=min(lim.default_max_tokens, self.max_tokens_cap), eos_token_ids=list(m.eos_token_ids),
            has_chat_template=m.has_chat_template, role=self.role, api_version=API_VERSION)


def _generic_handler(servicer: TbjaxServicer) -> grpc.GenericRpcHandler:
    handlers = {}
    for name, (req_cls, resp_cls, streaming) in METHODS.items():
        make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(getattr(servicer, name), request_deserializer=lenient_deserializer(req_cls),
                              response_serializer=resp_cls.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


class _ReadyGate(grpc.GenericRpcHandler):
    """Wraps a service of a prefill / decode worker (tbjax.pd.v1.Worker, tbjax.kv.v1): while the engine warms up,
    each of its RPCs is refused at once with UNAVAILABLE instead of waiting behind the warm-up in the engine's
    inbox (a router then fails the request with that status, as for a worker that is down)."""

    def __init__(self, inner: grpc.GenericRpcHandler, servicer: TbjaxServicer):
        self.inner = inner
        self.servicer = servicer

    def service(self, handler_call_details):
        h = self.inner.service(handler_call_details)
        if h is None or self.servicer.ready:
            return h
        message = self.servicer._startup_message()

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)

        kw = dict(request_deserializer=h.request_deserializer, response_serializer=h.response_serializer)
        if h.unary_unary:
            return grpc.unary_unary_rpc_method_handler(refuse, **kw)
        if h.unary_stream:
            return grpc.unary_stream_rpc_method_handler(refuse, **kw)
        if h.stream_unary:
            return grpc.stream_unary_rpc_method_handler(refuse, **kw)
        return grpc.stream_stream_rpc_method_handler(refuse, **kw)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """``--api-key``: every RPC must carry ``authorization: Bearer <key>`` metadata, else UNAUTHENTICATED (compared
    in constant time). gRPC health checking (grpc.health.v1.Health) stays open, so that load balancers and
    orchestrators can probe the server without the key; it says only SERVING / NOT_SERVING. Reflection and the
    worker services need the key like tbjax.v1."""

    OPEN_PREFIX = "/grpc.health.v1.Health/"

    def __init__(self, api_key: str, metrics: ServerMetrics | None = None):
        self._expected = ("Bearer " + api_key).encode()
        self.metrics = metrics

    def authorized(self, metadata) -> bool:
        for k, v in metadata or ():
            if k == "authorization":
                got = v.encode() if isinstance(v, str) else bytes(v)
                return hmac.compare_digest(got, self._expected)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(self.OPEN_PREFIX) or \
                self.authorized(handler_call_details.invocation_metadata):
            return handler
        metrics = self.metrics

        async def refuse(request, context):
            if metrics is not None:
                metrics.rejected.labels(code="UNAUTHENTICATED").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong API key: send the metadata 'authorization: Bearer <key>'")

        return _same_kind(handler, refuse)


def _same_kind(h, behaviour):
    """A method handler of ``h``'s kind (unary / streaming) and serializers that runs ``behaviour`` instead."""
    kw = dict(request_deserializer=h.request_deserializer, response_serializer=h.response_serializer)
    if h.unary_unary:
        return grpc.unary_unary_rpc_method_handler(behaviour, **kw)
    if h.unary_stream:
        return grpc.unary_stream_rpc_method_handler(behaviour, **kw)
    if h.stream_unary:
        return grpc.stream_unary_rpc_method_handler(behaviour, **kw)
    return grpc.stream_stream_rpc_method_handler(behaviour, **kw)


ROLES = ("colocated", "prefill", "decode", "router")


class Server:
    """A tbjax gRPC server. Roles: ``colocated`` (one engine does prefill and decode; the default),
    ``prefill`` / ``decode`` (a worker of disaggregated serving: the public API plus the worker service
    ``tbjax.pd.v1.Worker``, and for decode the KV transfer service), ``router`` (the public API over workers:
    ``prefill_workers`` / ``decode_workers`` addresses; no engine runs). ``engine_factory`` (colocated only): a
    picklable callable that builds the engine; it then runs in a child process (``engine_proc.EngineProcess``),
    off this process's GIL, and ``model.engine`` is not used by the server. ``warmup``: compile every program of the
    engine before serving (``engine_loop.warm_up``; ``warmup_progress`` shows a progress bar on stderr); see the module
    docstring for the order of start-up."""

    def __init__(self, model: ServedModel, *, host: str = "127.0.0.1", port: int = 0, limits: Limits | None = None,
                 metrics_host: str = "127.0.0.1", metrics_port: int | None = 0, role: str = "colocated",
                 prefill_workers: list[str] | None = None, decode_workers: list[str] | None = None,
                 kv_timeout_s: float = 10.0, kv_chunk_pages: int = 16, worker_timeout_s: float = 60.0,
                 kv_shm_bytes: int = 256 << 20, kv_copier: str = "auto", kv_ipc_bytes: int = 256 << 20,
                 engine_factory=None, warmup: bool = False, warmup_progress: bool = False,
                 http_port: int | None = None, http_host: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, api_key: str | None = None, reflection: bool = True):
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {ROLES}")
        if engine_factory is not None and role != "colocated":
            raise ValueError(f"engine_factory (the engine in its own process) is for role 'colocated', not {role!r}")
        self.model = model
        self.host, self.port = host, port
        self.limits = limits or Limits()
        self.metrics_host, self.metrics_port = metrics_host, metrics_port
        self.role = role
        self.metrics = ServerMetrics(role, model_name=model.name)
        self.pd_service = None
        self.engine_in_child = engine_factory is not None
        if role == "router":
            from .router import Router
            self.engine_loop = Router(prefill_workers or [], decode_workers or [], timeout_s=worker_timeout_s)
        elif engine_factory is not None:
            from .engine_proc import EngineProcess
            self.engine_loop = EngineProcess(engine_factory, self.metrics, warmup=warmup,
                                             warmup_progress=warmup_progress)
        else:
            self.engine_loop = EngineLoop(model.engine, self.metrics, warmup=warmup, warmup_progress=warmup_progress)
            if role == "prefill":
                from .pd_worker import PrefillService
                self.pd_service = PrefillService(self.engine_loop, model.make_params, timeout_s=worker_timeout_s,
                                                 chunk_pages=kv_chunk_pages, shm=kv_shm_bytes > 0, copier=kv_copier)
            elif role == "decode":
                from .pd_worker import DecodeService
                self.pd_service = DecodeService(self.engine_loop, model.make_params, timeout_s=kv_timeout_s,
                                                metrics=self.metrics, shm_bytes=kv_shm_bytes, copier=kv_copier,
                                                ipc_bytes=kv_ipc_bytes)
        self.servicer = TbjaxServicer(model, self.engine_loop, self.limits, self.metrics, role)
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._stopping = False
        self.bound_port: int | None = None
        self.bound_metrics_port: int | None = None
        self.warmup_info: dict | None = None
        # the OpenAI-compatible HTTP API (serving/http_api.py) on this loop and engine loop; None: off
        self.http_host, self.http_port = http_host or host, http_port
        self.http = None
        self.bound_http_port: int | None = None
        # security switches (see SECURITY in the module docstring): TLS for gRPC and HTTP, a bearer token, reflection
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key (PEM files)")
        self.tls_cert, self.tls_key = tls_cert, tls_key
        if api_key is not None and not api_key:
            raise ValueError("api_key must not be empty (None: no authentication)")
        self.api_key = api_key
        self.reflection = reflection

    @property
    def ready(self) -> bool:
        """Listening, warmed up, SERVING (and not draining)."""
        return self.servicer.ready and not self._stopping

    @property
    def address(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"{h}:{self.bound_port}"

    @property
    def http_url(self) -> str | None:
        """http://host:port of the OpenAI-compatible API (its routes are under /v1), or None when it is off."""
        if self.bound_http_port is None:
            return None
        h = f"[{self.http_host}]" if ":" in self.http_host else self.http_host
        return f"{'https' if self.tls_cert else 'http'}://{h}:{self.bound_http_port}"

    async def start(self) -> int:
        """``listen()``, then ``wait_ready()``: returns the port once the server serves."""
        port = await self.listen()
        await self.wait_ready()
        return port

    async def listen(self) -> int:
        """Listen (health NOT_SERVING, Generate refused with UNAVAILABLE) and start the engine loop, which warms the
        engine up first when asked to; ``wait_ready`` then waits for it. Returns the bound port."""
        mb = self.limits.max_message_bytes
        credentials = None
        if self.tls_cert is not None:
            with open(self.tls_key, "rb") as f:
                key = f.read()
            with open(self.tls_cert, "rb") as f:
                cert = f.read()
            credentials = grpc.ssl_server_credentials([(key, cert)])
        interceptors = [ApiKeyInterceptor(self.api_key, self.metrics)] if self.api_key is not None else []
        server = grpc.aio.server(interceptors=interceptors, options=[
            # a decode worker receives KV chunks (a few MB each): the public limit applies to tbjax.v1 requests
            # only through Limits' own check there
            ("grpc.max_receive_message_length", max(mb, 64 << 20) if self.role == "decode" else mb),
            ("grpc.max_send_message_length", max(mb, 4 << 20)),
            ("grpc.so_reuseport", 0),
        ])
        server.add_generic_rpc_handlers((_generic_handler(self.servicer),))
        if self.pd_service is not None:
            from .pd_worker import worker_handler
            server.add_generic_rpc_handlers((_ReadyGate(worker_handler(self.pd_service), self.servicer),))
            if self.role == "decode":
                server.add_generic_rpc_handlers((_ReadyGate(self.pd_service.handler(), self.servicer),))
                self.pd_service.start()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if self.reflection:
            reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        h = f"[{self.host}]" if ":" in self.host else self.host
        if credentials is not None:
            port = server.add_secure_port(f"{h}:{self.port}", credentials)
        else:
            port = server.add_insecure_port(f"{h}:{self.port}")
        if port == 0:
            raise OSError(f"cannot listen on {h}:{self.port}")
        self.metrics.ready.set(0)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.engine_in_child:   # EngineProcess: spawn the child; it loads and warms up while we listen
            await asyncio.to_thread(self.engine_loop.start, False)
        else:
            self.engine_loop.start()
        await server.start()
        self._server = server
        self.bound_port = port
        if self.http_port is not None:
            from .http_api import HTTPFrontend   # local: FastAPI (~0.2 s to import) only with the HTTP API on
            self.http = HTTPFrontend(self)
            try:
                self.bound_http_port = await self.http.start(self.http_host, self.http_port)
            except OSError:
                self.http = None
                await server.stop(0)
                self._server = None
                await asyncio.to_thread(self.engine_loop.stop)
                raise
        if self.metrics_port is not None:
            self.bound_metrics_port = self.metrics.start_http(self.metrics_host, self.metrics_port)
        return port

    async def wait_ready(self, poll_s: float = 0.05) -> dict | None:
        """Wait (polling, so that the loop stays free) until the engine loop is ready, then turn health SERVING and
        ``tbjax_ready`` 1. Returns the warm-up's result (None without a warm-up). Raises RuntimeError when the engine
        failed to start or warm up, EngineStopped when the server stopped meanwhile."""
        el = self.engine_loop
        delay = min(0.002, poll_s)
        while not el.wait_ready(0):
            if self._stopping:
                raise EngineStopped("the server stopped while it was warming up")
            await asyncio.sleep(delay)
            delay = min(delay * 2, poll_s)
        if self._stopping:
            raise EngineStopped("the server stopped while it was warming up")
        self.warmup_info = el.warmup_info
        self.servicer.ready = True
        self.metrics.ready.set(1)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.warmup_info

    async def stop(self, grace: float | None = 10.0) -> None:
        """Drain, then stop: health says NOT_SERVING, new RPCs are refused, RPCs in flight get ``grace``
        seconds to finish (then they are cancelled, which aborts them in the engine), then the engine
        thread and the metrics endpoint stop. Calling it again (e.g. with grace 0) while a drain runs
        cuts the drain short."""
        if self._server is None:
            return
        if self._stopping:
            if self.http is not None and not grace:
                self.http.force_stop()
            await self._server.stop(grace)
            return
        self._stopping = True
        self.metrics.ready.set(0)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.http is not None:   # HTTP and gRPC drain side by side (new HTTP requests get 503 meanwhile)
            await asyncio.gather(self._server.stop(grace), self.http.stop(grace))
            self.http = None
        else:
            await self._server.stop(grace)
        if self.pd_service is not None:
            await (self.pd_service.stop() if self.role == "decode" else self.pd_service.close())
        if self.role == "router":
            await self.engine_loop.close()
        await asyncio.to_thread(self.engine_loop.stop)
        self.metrics.stop_http()
        self.metrics.close()
        self._server = None

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


EVENT_LOOPS = ("asyncio", "uvloop")


def new_event_loop(kind: str = "asyncio") -> asyncio.AbstractEventLoop:
    """A new event loop: ``asyncio`` (the standard library's) or ``uvloop`` (libuv; must be installed)."""
    if kind == "asyncio":
        return asyncio.new_event_loop()
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError as e:
            raise ValueError("event loop 'uvloop' needs the uvloop package (pip install uvloop)") from e
        return uvloop.new_event_loop()
    raise ValueError(f"event loop {kind!r} is not one of {EVENT_LOOPS}")


class ServerThread:
    """Runs a ``Server`` on its own event loop (``event_loop``: see ``new_event_loop``) in a daemon thread.
    ``start()`` returns once it serves (``start(wait_ready=False)``: once it listens, still warming up;
    ``wait_ready()`` then waits for the rest)."""

    def __init__(self, model: ServedModel, *, event_loop: str = "asyncio", **server_kwargs):
        self.server = Server(model, **server_kwargs)
        self.loop = new_event_loop(event_loop)
        self._thread = threading.Thread(target=self._run, name="tbjax-grpc", daemon=True)
        self._listening = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._grace = 5.0

    @property
    def port(self) -> int:
        return self.server.bound_port

    @property
    def address(self) -> str:
        return self.server.address

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())
        self.loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        try:
            await self.server.listen()
        except BaseException as e:  # noqa: BLE001
            self._error = e
            self._listening.set()
            self._ready.set()
            await asyncio.to_thread(self.server.engine_loop.stop)
            return
        self._listening.set()
        ready = asyncio.ensure_future(self.server.wait_ready())
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready.exception() is not None:
            self._error = ready.exception()
        elif not ready.done():
            self._error = EngineStopped("the server was stopped while it was warming up")
        self._ready.set()
        if self._error is None:
            await stop
        else:
            stop.cancel()
        await self.server.stop(self._grace if self._error is None else 0)
        if not ready.done():
            await asyncio.wait({ready}, timeout=5)
        if ready.done() and not ready.cancelled():
            ready.exception()   # retrieved (EngineStopped when the stop came first)

    def start(self, timeout: float = 60.0, wait_ready: bool = True) -> "ServerThread":
        self._thread.start()
        if not self._listening.wait(timeout):
            raise TimeoutError("server did not start listening")
        if self._error is not None:
            raise self._error
        return self.wait_ready(timeout) if wait_ready else self

    def wait_ready(self, timeout: float = 60.0) -> "ServerThread":
        """Wait until the server serves (warm-up done); raises what made it fail."""
        if not self._ready.wait(timeout):
            raise TimeoutError("server did not become ready")
        if self._error is not None:
            raise self._error
        return self

    def run_coro(self, coro, timeout: float | None = 30.0):
        """Run a coroutine on the server's loop (e.g. to read servicer state) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = 5.0, timeout: float = 60.0) -> None:
        if not self._thread.is_alive():
            return
        self._grace = grace
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
