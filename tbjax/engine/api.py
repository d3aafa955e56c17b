"""The interface every engine implements (``StepEngine``), so that callers — ``tbjax.LLM``, the serving engine loop,
the prefill/decode workers — call declared members instead of probing engines with ``getattr`` / ``hasattr``.

Implemented by ``tbjax.engine.Engine`` (the engine), ``tbjax.prefill_pipeline.PipelinePrefillEngine`` (prefill only,
over a ``pp`` pipeline) and ``serving.fake_engine.FakeEngine`` (the serving tests' double). Capabilities beyond the
step loop are protocols of their own, checked with ``isinstance``:

- ``KVExporter``: hands a prefilled request's KV out (a prefill worker's engine);
- ``KVImporter``: takes a prompt's KV in and decodes from it (a decode worker's engine);
- ``PromptScorer``: computes prompt logprobs itself (engines without the model's weights in this process).

One step loop runs an engine on one thread; the serving layer's handles to a loop (in-process, child process,
router) have their own interface, ``serving.engine_api.EngineHandle``.
"""
from __future__ import annotations

from typing import Any, Hashable, Protocol, runtime_checkable

__all__ = ["StepEngine", "KVExporter", "KVImporter", "PromptScorer"]


@runtime_checkable
class StepEngine(Protocol):
    """Requests in, one ``step()`` at a time, outputs out (``RequestOutput``-like: request_id, new_token_ids, text,
    finished, finish_reason)."""

    tokenizer: Any
    max_model_len: int          # context of one sequence (prompt + output)
    prefill_only: bool          # True: only ``add_request(..., prefill_only=True)``; a request ends at its first token

    @property
    def ready(self) -> bool:
        """Every program a request can need is compiled (``warmup`` ran)."""

    @property
    def kv_tokens_per_sequence(self) -> int | None:
        """KV positions one sequence can hold in this engine's page pool (None: the engine does not page)."""

    def warmup(self, progress: bool = False) -> dict:
        """Compile before serving; returns at least {"programs": int, "seconds": float}."""

    def add_request(self, request_id: Hashable, prompt_token_ids: list[int], params: Any, **kwargs) -> None:
        """Queue a request (raises ValueError naming the problem for a bad one)."""

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request and free what it holds; False if the engine does not know it."""

    def has_unfinished(self) -> bool:
        """Anything left to step (queued, running, or outputs not yet returned)."""

    def step(self) -> list:
        """One iteration; the outputs it produced."""

    def stats(self) -> dict:
        """Counters for metrics (running, waiting, KV pages)."""


@runtime_checkable
class KVExporter(Protocol):
    def export_kv(self, request_id: Hashable, *, on_device: bool = False) -> Any:
        """The KV of a request that finished its prefill (``prefill_only``), in the transfer layout."""


@runtime_checkable
class KVImporter(Protocol):
    def reserve_kv(self, request_id: Hashable, n_tokens: int) -> list[int]:
        """Pages for ``n_tokens`` of prompt KV under ``request_id`` (raises when they do not fit)."""

    def write_kv_pages(self, request_id: Hashable, layer_pages, layer_scales=None, first_page: int = 0, **kwargs) -> None:
        """Write received pages into the reservation."""

    def add_prefilled_request(self, request_id: Hashable, prompt_token_ids: list[int], first_token: int,
                              params: Any) -> None:
        """Decode a request whose prompt KV is in its reservation, after the prefill side's first token."""

    def release_reservation(self, request_id: Hashable) -> bool:
        """Free a reservation whose transfer never completed."""


@runtime_checkable
class PromptScorer(Protocol):
    def prompt_logprobs(self, token_ids: list[int], k: int) -> list:
        """Per prompt token: None for the first, then (logprob, [(id, logprob)] of the k most likely)."""
