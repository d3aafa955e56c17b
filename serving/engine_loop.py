"""The engine thread: the only code that touches the (not thread-safe) engine.

The gRPC servicer runs on an asyncio loop; the engine runs here, on one dedicated thread, in a loop of
"take commands (add / abort), run one step, hand outputs out". Commands arrive through a thread-safe
inbox; outputs go back to each request's ``RequestStream`` (an ``asyncio.Queue`` on the servicer's loop),
batched into one ``call_soon_threadsafe`` per loop per step so that a big batch costs one wake-up, not
one per request. When nothing is running the thread sleeps on the inbox.

Whatever happens to a request, its stream gets exactly one terminal item: a finished ``RequestOutput``,
or an exception (``ValueError`` from ``add_request``: the request was refused; ``EngineFailed``: a step
crashed; ``EngineStopped``: the server shut down). An aborted request gets nothing more: its caller
asked for the abort and no longer listens.

Warm-up (``warmup=True``): before it takes any command the thread compiles every program the engine can run
(``warm_up``: ``Engine.warmup``, or one short request for an engine without it); ``ready`` turns True afterwards,
and ``startup_status()`` says how far it got (the servicer refuses requests with it until then). Commands that
arrive meanwhile wait in the inbox.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["EngineLoop", "RequestStream", "Admitted", "EngineFailed", "EngineStopped", "warm_up"]

log = logging.getLogger(__name__)


class EngineFailed(RuntimeError):
    """The engine raised while stepping; every request in flight at that moment gets this."""


class EngineStopped(RuntimeError):
    """The engine loop stopped before the request finished."""


@dataclass(frozen=True)
class Admitted:
    """First item of a stream: the engine thread took the request into the engine at ``time`` (perf_counter)."""

    time: float


class RequestStream:
    """Engine -> servicer channel of one request. Items: Admitted, RequestOutput(s), or one exception.
    The servicer takes everything waiting at once (``get_all``), so a stream that falls behind the engine
    catches up with one message instead of one per token."""

    __slots__ = ("loop", "items", "request_id", "_event")

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str):
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.request_id = request_id
        self._event = asyncio.Event()

    def put(self, item) -> None:  # on the servicer's loop
        self.items.append(item)
        self._event.set()

    async def get_all(self) -> list:
        while not self.items:
            self._event.clear()
            await self._event.wait()
        out = list(self.items)
        self.items.clear()
        return out


def _deliver(items: list) -> None:  # runs on the servicer's loop
    for stream, item in items:
        stream.put(item)


# Engine loops of one process warm up one at a time (e.g. --role split's two engines): compiles use every core
# anyway, and concurrent XLA:CPU compiles in engine threads were a suspect of crashes on the 2-core dev box.
_WARMUP_LOCK = threading.Lock()


def warm_up(engine, *, progress: bool = False) -> dict:
    """Compile every program ``engine`` (a ``tbjax.engine.api.StepEngine``) can run, on the calling thread (the one
    that owns the engine): ``engine.warmup(progress=...)``, unless ``engine.ready`` already. The result also says how
    many XLA compiles this process saw meanwhile (``xla_compiles``, ``xla_compile_seconds``:
    ``tbjax.compile_monitor``) and how the warm-up was done (``how``: "engine" or "already ready")."""
    from tbjax import compile_monitor

    compile_monitor.install()
    c0, s0, t0 = compile_monitor.count(), compile_monitor.seconds(), time.perf_counter()
    if engine.ready:
        info = {"how": "already ready", "programs": 0}
    else:
        info = {"how": "engine", **dict(engine.warmup(progress=progress) or {})}
    info.setdefault("seconds", time.perf_counter() - t0)
    info["xla_compiles"] = compile_monitor.count() - c0
    info["xla_compile_seconds"] = compile_monitor.seconds() - s0
    info.setdefault("programs", info["xla_compiles"])
    return info


def warming_message(phase: str, compiles: int, elapsed_s: float) -> str:
    """What a request hears while the server starts (UNAVAILABLE)."""
    if phase == "loading":
        what = f"loading the model ({elapsed_s:.0f} s so far)"
    else:
        what = f"compiling its programs ({compiles} XLA compiles, {elapsed_s:.0f} s so far)"
    return f"the server is warming up: {what}; retry when gRPC health reports SERVING"


class EngineLoop:
    """Runs ``engine.step()`` on its own thread. ``submit``/``abort``/``call`` are safe from any thread."""

    def __init__(self, engine, metrics=None, *, stats_interval_s: float = 0.25, name: str = "tbjax-engine",
                 warmup: bool = False, warmup_progress: bool = False):
        self.engine = engine
        self.warmup = warmup
        self._warmup_kw = dict(progress=warmup_progress)
        self._ready = threading.Event()
        self._warm_start: tuple[int, float] | None = None   # (compile count, perf_counter) when warm-up began
        self.warmup_info: dict | None = None
        self.warmup_error: BaseException | None = None
        self.metrics = metrics
        self.stats_interval_s = stats_interval_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine-thread only
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = threading.Event()
        self._stats: dict = {}
        self._stats_lock = threading.Lock()
        self.num_steps = 0
        self.fatal: BaseException | None = None

    # -- any thread ----------------------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, request_id: str, prompt_token_ids: list[int], params: Any, stream: RequestStream,
               adder: Callable[[Any], None] | None = None) -> None:
        """Queue a request for the engine; its outputs and fate arrive on ``stream``. ``adder(engine)`` replaces
        ``engine.add_request(request_id, prompt_token_ids, params)`` (e.g. a prefill-only or prefilled request)."""
        if self._stopped.is_set():
            raise EngineStopped("the engine loop is stopped")
        self._inbox.put(("add", request_id, prompt_token_ids, params, stream, adder))

    def submit_many(self, requests: list[tuple[str, list[int], Any, RequestStream]]) -> None:
        """Queue several requests ``(request_id, prompt_token_ids, params, stream)`` as one command, so that the engine
        takes them in the same step (e.g. the n completions of one prompt, whose prompt pages the prefix cache then
        shares)."""
        if self._stopped.is_set():
            raise EngineStopped("the engine loop is stopped")
        self._inbox.put(("group", [("add", rid, ids, params, stream, None) for rid, ids, params, stream in requests]))

    def abort(self, request_id: str) -> None:
        """Abort a request (frees its KV pages); unknown or finished ids are ignored."""
        self._inbox.put(("abort", request_id))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps; the result comes back in a Future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopped.is_set():
            fut.set_exception(EngineStopped("the engine loop is stopped"))
        else:
            self._inbox.put(("call", fn, fut))
        return fut

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the thread; requests still in flight get ``EngineStopped`` and are aborted in the engine."""
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)
        self._stopped.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def ready(self) -> bool:
        """Warmed up (or no warm-up asked for) and serving."""
        return self._ready.is_set() and self.fatal is None and not self._stopped.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the warm-up ended (True) or ``timeout`` passed (False). Raises when it failed or the loop
        stopped before it was ready."""
        if not self._ready.wait(timeout):
            return False
        if self.warmup_error is not None:
            raise RuntimeError(f"engine warm-up failed: {self.warmup_error!r}") from self.warmup_error
        if self.fatal is not None:
            raise EngineFailed(f"the engine loop crashed: {self.fatal!r}")
        return True

    def startup_status(self) -> str:
        """While not ready: what the engine is doing (for the UNAVAILABLE message)."""
        from tbjax import compile_monitor

        start = self._warm_start
        if start is None:
            return warming_message("compiling", 0, 0.0)
        return warming_message("compiling", compile_monitor.count() - start[0], time.perf_counter() - start[1])

    def inbox_size(self) -> int:
        return self._inbox.qsize()

    def stats(self) -> dict:
        """The latest ``engine.stats()`` snapshot (refreshed every ``stats_interval_s`` and when idle)."""
        with self._stats_lock:
            return dict(self._stats)

    # -- engine thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        out: dict[asyncio.AbstractEventLoop, list] = collections.defaultdict(list)
        last_stats = 0.0
        stopping = False
        try:
            if self.warmup:
                from tbjax import compile_monitor

                compile_monitor.install()
                self._warm_start = (compile_monitor.count(), time.perf_counter())
                try:
                    with _WARMUP_LOCK:
                        self.warmup_info = warm_up(self.engine, **self._warmup_kw)
                except BaseException as e:  # noqa: BLE001 - reported by wait_ready; the loop stops
                    self.warmup_error = e
                    raise
                log.info("engine warm-up: %s", self.warmup_info)
            self._ready.set()
            while not stopping:
                busy = self.engine.has_unfinished()
                if not busy and self._streams:  # engine forgot requests without a final output (engine bug)
                    self._fail_all(EngineFailed("the engine dropped the request without finishing it"), out)
                cmds = []
                try:
                    if not busy:
                        self._refresh_stats()
                        last_stats = time.monotonic()
                        cmds.append(self._inbox.get(timeout=1.0))
                    while True:
                        cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    pass
                for cmd in cmds:
                    if cmd[0] == "stop":
                        stopping = True
                    else:
                        self._handle(cmd, out)
                if not stopping and self.engine.has_unfinished():
                    self._step(out)
                self._flush(out)
                if self.metrics is not None:
                    self.metrics.engine_inbox.set(self._inbox.qsize())
                if time.monotonic() - last_stats >= self.stats_interval_s:
                    self._refresh_stats()
                    last_stats = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - a bug in this loop must not strand the callers
            log.exception("engine warm-up failed" if e is self.warmup_error else "engine loop crashed")
            self.fatal = e
        finally:
            self._stopped.set()
            self._ready.set()
            self._fail_all(EngineStopped("the server is shutting down") if self.fatal is None
                           else EngineFailed(f"engine loop crashed: {self.fatal!r}"), out)
            self._flush(out)
            # answer anything still in the inbox so that no caller waits forever
            while True:
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                for c in (cmd[1] if cmd[0] == "group" else [cmd]):
                    if c[0] == "add":
                        out[c[4].loop].append((c[4], EngineStopped("the engine loop is stopped")))
                if cmd[0] == "call":
                    cmd[2].set_exception(EngineStopped("the engine loop is stopped"))
            self._flush(out)
            self._refresh_stats()

    def _handle(self, cmd, out) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, ids, params, stream, adder = cmd
            if rid in self._streams:
                out[stream.loop].append((stream, ValueError(f"request id {rid!r} is already in flight")))
                return
            try:
                if adder is None:
                    self.engine.add_request(rid, ids, params)
                else:
                    adder(self.engine)
            except Exception as e:  # noqa: BLE001 - refused request: the caller maps it to a status
                out[stream.loop].append((stream, e))
                return
            self._streams[rid] = stream
            out[stream.loop].append((stream, Admitted(time.perf_counter())))
        elif kind == "group":
            for c in cmd[1]:
                self._handle(c, out)
        elif kind == "abort":
            rid = cmd[1]
            self._streams.pop(rid, None)
            self.engine.abort(rid)
        elif kind == "call":
            _, fn, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001
                    fut.set_exception(e)

    def _step(self, out) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001
            log.exception("engine step failed; failing the %d requests in flight", len(self._streams))
            self._fail_all(EngineFailed(f"engine step failed: {e!r}"), out)
            return
        finally:
            if self.metrics is not None:
                self.metrics.step.observe(time.perf_counter() - t0)
            self.num_steps += 1
        for o in outputs:
            stream = self._streams.get(o.request_id)
            if stream is None:
                continue
            out[stream.loop].append((stream, o))
            if o.finished:
                del self._streams[o.request_id]

    def _fail_all(self, exc: Exception, out) -> None:
        for rid, stream in list(self._streams.items()):
            out[stream.loop].append((stream, exc))
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - best effort; the engine may be broken
                log.exception("abort of %r failed", rid)
        self._streams.clear()

    def _flush(self, out) -> None:
        for loop, items in out.items():
            if items:
                try:
                    loop.call_soon_threadsafe(_deliver, list(items))
                except RuntimeError:  # that loop is closed: nobody listens any more
                    pass
        out.clear()

    def _refresh_stats(self) -> None:
        try:
            s = dict(self.engine.stats())
        except Exception:  # noqa: BLE001
            log.exception("engine.stats() failed")
            return
        with self._stats_lock:
            self._stats = s
        if self.metrics is not None:
            self.metrics.update_engine(s)
