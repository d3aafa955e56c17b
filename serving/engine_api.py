"""The interface of a handle to an engine's step loop (``EngineHandle``), which the gRPC servicer and the HTTP front
end use without probing: ``EngineLoop`` (the engine on a thread of this process), ``EngineProcess`` (the engine in a
child process) and ``Router`` (no engine here: prefill and decode workers elsewhere) implement it.

The engines themselves implement ``tbjax.engine.api.StepEngine``; ``engine`` below is that engine where it lives in
this process (``EngineLoop``), else None.
"""
from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Protocol, runtime_checkable

__all__ = ["EngineHandle"]


@runtime_checkable
class EngineHandle(Protocol):
    engine: Any            # the in-process StepEngine, or None (child process, router)
    warmup_info: dict | None

    def start(self) -> "EngineHandle": ...

    def stop(self, timeout: float | None = 30.0) -> None: ...

    def submit(self, request_id: str, prompt_token_ids: list[int], params: Any, stream: Any,
               adder: Callable[[Any], None] | None = None) -> None:
        """Queue a request; its outputs and fate arrive on ``stream`` (a ``RequestStream``)."""

    def submit_many(self, requests: list[tuple[str, list[int], Any, Any]]) -> None:
        """Several requests at once (the engine takes them in one step where it can)."""

    def abort(self, request_id: str) -> None: ...

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """``fn(engine)`` on the engine's thread between steps (fails with EngineStopped where there is none)."""

    @property
    def alive(self) -> bool: ...

    @property
    def ready(self) -> bool: ...

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once warmed up, False after ``timeout``; raises when the start failed."""

    def startup_status(self) -> str:
        """While not ready: what it is doing (the UNAVAILABLE message)."""

    def inbox_size(self) -> int: ...

    def stats(self) -> dict: ...
