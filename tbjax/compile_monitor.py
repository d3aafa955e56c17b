"""Counts the XLA compiles of this process (and how long they took), from the moment ``install()`` is called.

Why it exists: a serving process must compile every program it will run *before* it reports ready; a compile that
happens later stalls every request in the batch for seconds to minutes. To check that (in tests, and in production
through the ``tbjax_xla_compiles_total`` / ``tbjax_xla_compile_seconds`` metrics) we need the number of compiles as
JAX sees them, whatever code triggered them (the engine's runner, a sampler, a jnp op outside any jit). JAX reports
each backend compile through ``jax.monitoring``: the event ``/jax/core/compile/backend_compile_duration``
(``jax._src.dispatch.BACKEND_COMPILE_EVENT`` in jax 0.11.2), one per call of ``compiler.compile_or_get_cached``, i.e.
per XLA executable built. A program loaded from the persistent compilation cache counts too (it is still one
executable built, just faster); a jit call served from JAX's in-memory cache does not (no event).

``install()`` is idempotent (``jax.monitoring`` has no way to remove a listener, so it registers one, once).
``count()`` / ``seconds()``: compiles and their total seconds so far; ``durations()``: each compile's seconds, in
order (the last ``MAX_HISTORY``); ``since(n)``: the count and the compiles after the first ``n``; ``add_listener(fn)``: ``fn(duration_s)`` is called after each later compile (on the
compiling thread; exceptions are logged, never raised into JAX), e.g. to feed Prometheus metrics. All thread-safe.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

__all__ = ["EVENT", "install", "installed", "count", "seconds", "durations", "since", "add_listener",
           "remove_listener", "MAX_HISTORY"]

log = logging.getLogger(__name__)

EVENT = "/jax/core/compile/backend_compile_duration"
MAX_HISTORY = 100_000    # durations kept for replay (a process that compiles more than this has a bigger problem)

_lock = threading.RLock()   # reentrant: a listener may remove itself while it is replayed
_installed = False
_count = 0
_seconds = 0.0
_history: collections.deque = collections.deque(maxlen=MAX_HISTORY)
_listeners: list[Callable[[float], None]] = []


def _on_event(event: str, duration_secs: float, **_kw) -> None:
    if event != EVENT:
        return
    global _count, _seconds
    d = float(duration_secs)
    with _lock:
        _count += 1
        _seconds += d
        _history.append(d)
        listeners = list(_listeners)
    for fn in listeners:
        try:
            fn(d)
        except Exception:  # noqa: BLE001 - a broken listener must never break a compile
            log.exception("compile listener %r failed", fn)


def install() -> None:
    """Start counting (once per process; later calls do nothing)."""
    global _installed
    with _lock:
        if _installed:
            return
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _installed = True


def installed() -> bool:
    return _installed


def count() -> int:
    """XLA compiles in this process since ``install()``."""
    with _lock:
        return _count


def seconds() -> float:
    """Total seconds of those compiles."""
    with _lock:
        return _seconds


def durations() -> list[float]:
    """Seconds of each compile since ``install()`` (the last ``MAX_HISTORY``), oldest first."""
    with _lock:
        return list(_history)


def since(n: int) -> tuple[int, list[float]]:
    """(compiles so far, seconds of compiles number ``n`` onwards): what happened since a caller saw ``n`` compiles,
    read atomically (durations that fell out of the history are missing from the list, never from the count)."""
    with _lock:
        new = max(0, min(_count - n, len(_history)))
        return _count, list(_history)[len(_history) - new:]


def add_listener(fn: Callable[[float], None], *, replay: bool = False) -> Callable[[float], None]:
    """Call ``fn(duration_s)`` after every later compile (installs the monitor if needed). ``replay``: first call it
    for each compile already recorded, atomically with the registration (none is missed or seen twice). Returns
    ``fn`` (the handle for ``remove_listener``)."""
    install()
    with _lock:
        past = list(_history) if replay else []
        _listeners.append(fn)
        # replayed under the lock: a compile on another thread waits until the replay is done, then is reported
        for d in past:
            try:
                fn(d)
            except Exception:  # noqa: BLE001
                log.exception("compile listener %r failed", fn)
    return fn


def remove_listener(fn: Callable[[float], None]) -> None:
    """Stop calling ``fn`` (unknown listeners are ignored)."""
    with _lock:
        try:
            _listeners.remove(fn)
        except ValueError:
            pass
