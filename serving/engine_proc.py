"""The engine in its own process: ``EngineProcess``, a drop-in for ``EngineLoop`` whose engine runs in a child.

Why: in one process the engine thread and the gRPC server's asyncio loop share one GIL. Measured on CPU with the fake
engine at H200-like step times (benchmarks/RESULTS.md, "gRPC serving": the front end at H200 engine rates), the engine
thread then waits for the GIL each time it wakes from the device (and again after handing a step's outputs over), so
every step gets longer while the server streams, and gRPC throughput falls below the offline engine's. Here the
engine's loop (take commands, step, send outputs) runs in a child process with its own interpreter: the server's
Python work can no longer stretch an engine step; it can only delay delivery.

Wire: two one-way pipes. Parent -> child: ("add", rid, n, prompt ids, params) / ("abort", rid, n) /
("call", id, fn) / ("stop",). Child -> parent, one message per loop iteration (so a whole step's outputs cost
one pickle and one wake-up): a list of events ``(rid, n, kind, payload)`` -- "admitted" (perf_counter time;
the clock is system-wide), "out" (request output fields as a tuple), "refused" (add_request raised), "error"
(the step failed) -- where ``n`` numbers the submission, so that late events of an aborted request never reach
a new request that reuses its id -- plus the iteration's step durations and, now and then, an ``engine.stats()``
snapshot. A reader thread in the parent unpickles and hands each loop its items in one
``call_soon_threadsafe``, like ``EngineLoop``.

Start-up: the child builds the engine, then (``warmup=True``) compiles every program it can run
(``engine_loop.warm_up``), sending ("warming", compiles so far, seconds) twice a second meanwhile, then
("ready", stats, warm-up info) and only then reads commands. Every stats snapshot carries the child's XLA compile
count (``xla_compiles``, ``xla_compile_seconds``; ``tbjax.compile_monitor``) and the durations of the compiles since
the previous snapshot (``metrics.CHILD_COMPILES_KEY``), which the parent's metrics count as its own.

Same contract as ``EngineLoop``: every stream gets ``Admitted``, outputs, and exactly one terminal item
(finished output, ``ValueError`` refusal, ``EngineFailed``, ``EngineStopped``); an aborted request gets
nothing more. Differences: the engine is built in the child by ``engine_factory`` (a picklable callable,
e.g. ``functools.partial(FakeEngine, ...)``), so ``.engine`` is None here; ``call(fn)`` needs a picklable
``fn`` and a picklable result; ``submit``'s ``adder`` (prefill/decode roles) is not supported -- those roles
keep the in-process ``EngineLoop``.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import multiprocessing as mp
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .engine_loop import Admitted, EngineFailed, EngineStopped, RequestStream, warm_up, warming_message
from .metrics import CHILD_COMPILES_KEY

__all__ = ["EngineProcess", "StreamOutput"]

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class StreamOutput:
    """A request output as it arrives from the child: the fields the servicer reads."""

    request_id: Any
    new_token_ids: Any
    text_delta: Any
    finished: Any
    finish_reason: Any
    logprobs: Any


def _picklable_exc(e: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else one of the same broad kind with its message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return (ValueError if isinstance(e, ValueError) else RuntimeError)(f"{type(e).__name__}: {e}")


class _CompileFeed:
    """The child's engine stats plus its XLA compiles: the running totals and the compiles since the last call."""

    def __init__(self):
        from tbjax import compile_monitor

        compile_monitor.install()
        self._monitor = compile_monitor
        self._seen = 0

    def stats(self, engine) -> dict:
        s = dict(engine.stats())
        n, new = self._monitor.since(self._seen)
        self._seen = n
        s["xla_compiles"] = n
        s["xla_compile_seconds"] = self._monitor.seconds()
        if new:
            s[CHILD_COMPILES_KEY] = new
        return s


def _child_warm_up(engine, out_w, progress: bool) -> dict:
    """``warm_up`` in the child, with a thread that reports progress to the parent meanwhile (the only sender then)."""
    from tbjax import compile_monitor

    c0, t0 = compile_monitor.count(), time.perf_counter()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(0.5):
            try:
                out_w.send(("warming", compile_monitor.count() - c0, time.perf_counter() - t0))
            except Exception:  # noqa: BLE001 - the parent went away: the main thread finds out
                return

    out_w.send(("warming", 0, 0.0))
    th = threading.Thread(target=tick, name="tbjax-warmup-progress", daemon=True)
    th.start()
    try:
        return warm_up(engine, progress=progress)
    finally:
        done.set()
        th.join()


def _child_main(engine_factory, cmd_r, out_w, stats_interval_s: float, warmup: bool = False,  # noqa: C901
                warmup_progress: bool = False) -> None:
    """The child: build the engine, warm it up, then loop: commands, one step, one message with everything it
    produced."""
    try:
        feed = _CompileFeed()   # before the factory: compiles while loading count too
        engine = engine_factory()
    except BaseException as e:  # noqa: BLE001 - report and exit; the parent fails every caller
        out_w.send(("fatal", f"engine factory failed: {e!r}"))
        return
    live: dict[str, int] = {}   # request id -> the parent's submission number (echoed in every event)
    events: list = []
    steps: list = []
    last_stats = 0.0
    try:
        info = None
        if warmup:
            try:
                info = _child_warm_up(engine, out_w, warmup_progress)
            except Exception as e:  # noqa: BLE001 - report and exit; the parent fails every caller
                log.exception("engine warm-up failed")
                out_w.send(("fatal", f"engine warm-up failed: {e!r}"))
                return
        out_w.send(("ready", feed.stats(engine), info))
        stopping = False
        while not stopping:
            busy = engine.has_unfinished()
            if not busy and live:   # the engine forgot requests without a final output (engine bug)
                for rid, gen in live.items():
                    events.append((rid, gen, "error",
                                   EngineFailed("the engine dropped the request without finishing it")))
                live.clear()
            stats = None
            if not busy:
                stats = feed.stats(engine)
                last_stats = time.monotonic()
                if not events:
                    out_w.send(("batch", [], [], stats))
                    stats = None
                    cmd_r.poll(1.0)
            while cmd_r.poll():
                cmd = cmd_r.recv()
                kind = cmd[0]
                if kind == "add":
                    _, rid, gen, ids, params = cmd
                    if rid in live:   # the parent refuses duplicates; this only guards the engine
                        events.append((rid, gen, "refused", ValueError(f"request id {rid!r} is already in flight")))
                        continue
                    try:
                        engine.add_request(rid, ids, params)
                    except Exception as e:  # noqa: BLE001 - refused: the caller maps it to a status
                        events.append((rid, gen, "refused", _picklable_exc(e)))
                        continue
                    live[rid] = gen
                    events.append((rid, gen, "admitted", time.perf_counter()))
                elif kind == "abort":
                    if live.get(cmd[1]) == cmd[2]:
                        del live[cmd[1]]
                        engine.abort(cmd[1])
                elif kind == "call":
                    _, cid, blob = cmd
                    try:
                        res = ("ok", pickle.loads(blob)(engine))
                        pickle.dumps(res)
                    except BaseException as e:  # noqa: BLE001
                        res = ("exc", _picklable_exc(e))
                    out_w.send(("result", cid, res))
                elif kind == "stop":
                    stopping = True
                    break
            if not stopping and engine.has_unfinished():
                t0 = time.perf_counter()
                try:
                    outputs = engine.step()
                except Exception as e:  # noqa: BLE001
                    log.exception("engine step failed; failing the %d requests in flight", len(live))
                    err = EngineFailed(f"engine step failed: {e!r}")
                    for rid, gen in live.items():
                        events.append((rid, gen, "error", err))
                        try:
                            engine.abort(rid)
                        except Exception:  # noqa: BLE001 - best effort
                            pass
                    live.clear()
                    outputs = ()
                steps.append(time.perf_counter() - t0)
                for o in outputs:
                    rid = o.request_id
                    gen = live.get(rid)
                    if gen is None:
                        continue
                    events.append((rid, gen, "out", (list(o.new_token_ids), o.text_delta, o.finished,
                                                     o.finish_reason, o.logprobs)))
                    if o.finished:
                        del live[rid]
            if stats is None and time.monotonic() - last_stats >= stats_interval_s:
                stats = feed.stats(engine)
                last_stats = time.monotonic()
            if events or steps or stats is not None:
                out_w.send(("batch", events, steps, stats))
                events, steps = [], []
        # stopping: the requests still running end with EngineStopped (the parent delivers it)
        for rid in live:
            try:
                engine.abort(rid)
            except Exception:  # noqa: BLE001
                pass
        out_w.send(("stopped", feed.stats(engine)))
    except (BrokenPipeError, EOFError, KeyboardInterrupt):
        pass
    except BaseException as e:  # noqa: BLE001 - a bug in this loop: tell the parent, which fails every caller
        log.exception("engine process loop crashed")
        try:
            out_w.send(("fatal", f"engine loop crashed: {e!r}"))
        except Exception:  # noqa: BLE001
            pass


class EngineProcess:
    """``EngineLoop``'s interface with the engine in a child process (see the module docstring)."""

    engine = None   # lives in the child

    def __init__(self, engine_factory: Callable[[], Any], metrics=None, *, stats_interval_s: float = 0.25,
                 start_timeout_s: float = 600.0, name: str = "tbjax-engine", warmup: bool = False,
                 warmup_progress: bool = False):
        if not callable(engine_factory):
            raise TypeError(f"engine_factory must be a picklable callable returning an engine, got {engine_factory!r}")
        self.metrics = metrics
        self.stats_interval_s = stats_interval_s
        self.start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("spawn")   # not fork: the parent runs gRPC's threads
        self._cmd_r, self._cmd_w = self._ctx.Pipe(duplex=False)
        self._out_r, self._out_w = self._ctx.Pipe(duplex=False)
        _grow_pipe(self._out_w)   # room for many steps of outputs before a slow reader stalls the engine
        self._proc = self._ctx.Process(target=_child_main, name=name, daemon=True,
                                       args=(engine_factory, self._cmd_r, self._out_w, stats_interval_s, warmup,
                                             warmup_progress))
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()           # guards _streams, _calls, _pending_adds
        self._streams: dict[str, tuple[RequestStream, int]] = {}   # request id -> (stream, submission number)
        self._gens = itertools.count()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._pending_adds = 0
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._stop_requested = False
        self._stats: dict = {}
        self.num_steps = 0
        self.fatal: BaseException | None = None
        self.warmup = warmup
        self.warmup_info: dict | None = None
        self.engine = None         # it lives in the child process
        self._phase = "loading"              # -> "compiling" (warm-up) -> ready
        self._progress = (0, 0.0)            # warm-up: (XLA compiles so far, seconds)
        self._t_start: float | None = None

    # -- any thread ----------------------------------------------------------------------------------------
    def start(self, wait: bool = True) -> "EngineProcess":
        """Start the child; ``wait``: return once it is ready (built, warmed up), else at once (``wait_ready``)."""
        self._t_start = time.perf_counter()
        self._proc.start()
        self._cmd_r.close()   # the child's ends
        self._out_w.close()
        self._reader.start()
        if not wait:
            return self
        if not self._ready.wait(self.start_timeout_s):
            self.stop(timeout=5)
            raise TimeoutError(f"the engine process did not start within {self.start_timeout_s} s")
        if self.fatal is not None:
            raise RuntimeError(f"the engine process failed to start: {self.fatal}")
        return self

    def _send(self, msg) -> None:
        with self._send_lock:
            self._cmd_w.send(msg)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: Any, stream: RequestStream,
               adder: Callable[[Any], None] | None = None) -> None:
        if adder is not None:
            raise NotImplementedError("EngineProcess does not take an adder (prefill/decode roles run EngineLoop)")
        if self._stopped.is_set():
            raise EngineStopped("the engine loop is stopped")
        gen = next(self._gens)
        with self._lock:
            dup = request_id in self._streams
            if not dup:
                self._streams[request_id] = (stream, gen)
                self._pending_adds += 1
        if dup:
            _post(stream.loop, [(stream, ValueError(f"request id {request_id!r} is already in flight"))])
            return
        try:
            self._send(("add", request_id, gen, list(prompt_token_ids), params))
        except (OSError, ValueError) as e:   # child gone, or params do not pickle
            with self._lock:
                self._streams.pop(request_id, None)
                self._pending_adds -= 1
            if isinstance(e, OSError):
                raise EngineStopped("the engine process is gone") from e
            raise

    def submit_many(self, requests: list[tuple[str, list[int], Any, RequestStream]]) -> None:
        """Several requests (``EngineHandle.submit_many``): sent back to back, so the child usually takes them in one
        step."""
        for rid, ids, params, stream in requests:
            self.submit(rid, ids, params, stream)

    def abort(self, request_id: str) -> None:
        with self._lock:
            entry = self._streams.pop(request_id, None)
        if entry is None:   # unknown or finished: nothing to abort
            return
        try:
            self._send(("abort", request_id, entry[1]))
        except OSError:
            pass

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` in the child between steps (``fn`` and its result must pickle)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopped.is_set():
            fut.set_exception(EngineStopped("the engine loop is stopped"))
            return fut
        try:
            blob = pickle.dumps(fn)   # here, so that an unpicklable fn fails its caller, not the child
        except Exception as e:  # noqa: BLE001
            fut.set_exception(TypeError(f"call() runs fn in the engine process, so fn must pickle: {e}"))
            return fut
        cid = next(self._call_ids)
        with self._lock:
            self._calls[cid] = fut
        try:
            self._send(("call", cid, blob))
        except OSError:
            with self._lock:
                self._calls.pop(cid, None)
            fut.set_exception(EngineStopped("the engine process is gone"))
        return fut

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the child; requests still in flight get ``EngineStopped`` (aborted in the engine)."""
        self._stop_requested = True
        if self._proc.is_alive():
            try:
                self._send(("stop",))
            except OSError:
                pass
            if not self._ready.is_set():   # still loading / compiling: it reads no command until done
                self._proc.join(min(2.0, timeout) if timeout is not None else 2.0)
                if self._proc.is_alive():
                    self._proc.terminate()
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        if self._reader.is_alive():
            self._reader.join(timeout)
        self._stopped.set()
        self._fail_all(EngineStopped("the server is shutting down"))

    @property
    def pid(self) -> int | None:
        """The child's process id (None before start)."""
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.is_alive() and not self._stopped.is_set()

    @property
    def ready(self) -> bool:
        """The child has built and warmed up its engine and serves."""
        return self._ready.is_set() and self.fatal is None and not self._stopped.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the child is ready (True) or ``timeout`` passed (False); raises when it failed to start."""
        if not self._ready.wait(timeout):
            return False
        if self.fatal is not None:
            raise RuntimeError(f"the engine process failed to start: {self.fatal}")
        if self._stopped.is_set():
            raise EngineStopped("the engine process stopped before it was ready")
        return True

    def startup_status(self) -> str:
        """While not ready: what the child is doing (for the UNAVAILABLE message)."""
        if self._phase == "loading":
            return warming_message("loading", 0, time.perf_counter() - (self._t_start or time.perf_counter()))
        return warming_message("compiling", *self._progress)

    def inbox_size(self) -> int:
        return self._pending_adds

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    # -- reader thread -------------------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                try:
                    msg = self._out_r.recv()
                except (EOFError, OSError):
                    if self.fatal is None and not self._stop_requested:   # the child went away on its own
                        self._proc.join(2.0)
                        what = "before it was ready" if not self._ready.is_set() else "unexpectedly"
                        self.fatal = RuntimeError(f"the engine process exited {what} (exit code {self._proc.exitcode})")
                        log.error("%s", self.fatal)
                    break
                kind = msg[0]
                if kind == "batch":
                    self._on_batch(msg[1], msg[2], msg[3])
                elif kind == "result":
                    with self._lock:
                        fut = self._calls.pop(msg[1], None)
                    if fut is not None and fut.set_running_or_notify_cancel():
                        status, value = msg[2]
                        if status == "ok":
                            fut.set_result(value)
                        else:
                            fut.set_exception(value)
                elif kind == "warming":
                    self._phase, self._progress = "compiling", (msg[1], msg[2])
                elif kind == "ready":
                    self._set_stats(msg[1])
                    self.warmup_info = msg[2]
                    self._phase = "ready"
                    self._ready.set()
                elif kind == "stopped":
                    self._set_stats(msg[1])
                elif kind == "fatal":
                    log.error("engine process: %s", msg[1])
                    self.fatal = RuntimeError(msg[1])
        except BaseException as e:  # noqa: BLE001 - never strand the callers
            log.exception("engine process reader crashed")
            self.fatal = e
        finally:
            self._stopped.set()
            self._ready.set()
            self._fail_all(EngineStopped("the engine loop is stopped") if self.fatal is None
                           else EngineFailed(f"engine process failed: {self.fatal}"))

    def _on_batch(self, events, steps, stats) -> None:
        out: dict[asyncio.AbstractEventLoop, list] = collections.defaultdict(list)
        with self._lock:
            streams = self._streams
            for rid, gen, kind, payload in events:
                if kind in ("admitted", "refused"):
                    self._pending_adds -= 1
                entry = streams.get(rid)
                if entry is None or entry[1] != gen:   # aborted (maybe resubmitted since): its caller left
                    continue
                stream = entry[0]
                if kind == "admitted":
                    out[stream.loop].append((stream, Admitted(payload)))
                elif kind == "out":
                    ids, text, finished, reason, lps = payload
                    out[stream.loop].append((stream, StreamOutput(rid, ids, text, finished, reason, lps)))
                    if finished:
                        del streams[rid]
                else:   # "refused" at add, or "error": the step failed / the engine lost it
                    del streams[rid]
                    out[stream.loop].append((stream, payload))
        for loop, items in out.items():
            _post(loop, items)
        if steps:
            self.num_steps += len(steps)
            if self.metrics is not None:
                for s in steps:
                    self.metrics.step.observe(s)
        if stats is not None:
            self._set_stats(stats)
        if self.metrics is not None:
            self.metrics.engine_inbox.set(self._pending_adds)

    def _set_stats(self, stats: dict) -> None:
        stats = dict(stats)
        new_compiles = stats.pop(CHILD_COMPILES_KEY, None)
        with self._lock:
            self._stats = stats
        if self.metrics is not None:
            for sec in new_compiles or ():
                self.metrics.observe_compile(float(sec))
            self.metrics.update_engine(stats)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
        out: dict[asyncio.AbstractEventLoop, list] = collections.defaultdict(list)
        for stream, _ in streams.values():
            out[stream.loop].append((stream, exc))
        for loop, items in out.items():
            _post(loop, items)
        for fut in calls.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineStopped("the engine loop is stopped"))


def _grow_pipe(conn, size: int = 1 << 20) -> None:
    """Best effort: a bigger kernel buffer for a pipe (Linux F_SETPIPE_SZ; 64 KiB by default)."""
    try:
        import fcntl
        fcntl.fcntl(conn.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
    except (ImportError, OSError):
        pass


def _deliver(items: list) -> None:  # runs on the servicer's loop
    for stream, item in items:
        stream.put(item)


def _post(loop: asyncio.AbstractEventLoop, items: list) -> None:
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:  # that loop is closed: nobody listens any more
        pass
