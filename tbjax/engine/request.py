"""Per-request state the scheduler tracks: tokens, stop rules, progress, and the pages a sequence holds.

A ``Sequence`` is one generation request as the scheduler sees it. Its tokens are ``token_ids`` =
prompt + generated output; ``num_computed_tokens`` of them have their KV written in the pages listed by
``block_table`` (on rank ``dp_rank``). The next step for a sequence always computes
``token_ids[num_computed_tokens:...]``; when that reaches the last token, the step samples a new one.
So a decode is simply "one token left to compute", and a preempted sequence that comes back just
prefills prompt + output again. Sampling settings live with the caller (``tbjax.sampling``): only the
stop rules the scheduler applies are here, as plain arguments.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable

__all__ = ["SequenceStatus", "FinishReason", "Sequence", "StepOutput"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # queued (new, or preempted and holding no pages)
    RUNNING = "running"    # admitted to a dp rank, holds pages
    FINISHED = "finished"  # done (see finish_reason); holds nothing


class FinishReason(str, enum.Enum):
    STOP = "stop"      # eos, a stop token, or a stop string (reported by the caller)
    LENGTH = "length"  # max_tokens reached (or the model's context)
    ABORT = "abort"    # cancelled


def _token_id(what: str, t) -> int:
    """``t`` as a Python int (numpy integers accepted); ValueError for bools, non-ints and negatives."""
    if isinstance(t, bool):
        raise ValueError(f"{what} {t!r} is a bool, not a token id")
    try:
        v = operator.index(t)
    except TypeError:
        raise ValueError(f"{what} {t!r} is not an int token id") from None
    if v < 0:
        raise ValueError(f"{what} {t!r} is negative")
    return v


def _token_set(name: str, ids: Iterable[int] | None) -> frozenset[int]:
    if ids is None:
        return frozenset()
    if isinstance(ids, int):
        ids = (ids,)
    return frozenset(_token_id(name, t) for t in ids)


@dataclass(eq=False)
class Sequence:
    """One request. Arguments are validated; progress fields are owned by the scheduler, which changes the page
    holdings (cache node, reservation) and the status only through the methods below."""

    seq_id: Hashable
    prompt_token_ids: list[int]
    max_tokens: int
    stop_token_ids: Iterable[int] | None = None
    eos_token_ids: Iterable[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    data: Any = None  # free slot for the caller (sampling params, detokenizer state, stream handle...)

    # progress (scheduler-owned)
    token_ids: list[int] = field(init=False, default_factory=list)
    status: SequenceStatus = field(init=False, default=SequenceStatus.WAITING)
    finish_reason: FinishReason | None = field(init=False, default=None)
    stop_token_id: int | None = field(init=False, default=None)
    dp_rank: int | None = field(init=False, default=None)
    block_table: list[int] = field(init=False, default_factory=list)
    num_computed_tokens: int = field(init=False, default=0)
    num_cached_tokens: int = field(init=False, default=0)  # prefix-cache hit at the last admission
    num_preemptions: int = field(init=False, default=0)
    # overlapped scheduling: tokens of steps launched but not yet done, and samples of those steps whose token is
    # not in token_ids yet (0 or 1); both 0 when no step is in flight
    num_inflight_tokens: int = field(init=False, default=0)
    num_pending_samples: int = field(init=False, default=0)
    arrival: int = field(init=False, default=-1)  # order of add(); lower = older = higher priority
    _cache_node: Any = field(init=False, default=None, repr=False)
    _reserved_pages: int = field(init=False, default=0, repr=False)

    def __post_init__(self):
        try:
            prompt = list(self.prompt_token_ids)
        except TypeError:
            raise ValueError(f"prompt_token_ids must be a sequence of ints, got {type(self.prompt_token_ids).__name__}")
        if not prompt:
            raise ValueError(f"request {self.seq_id!r}: prompt_token_ids is empty")
        prompt = [_token_id(f"request {self.seq_id!r}: prompt token", t) for t in prompt]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"request {self.seq_id!r}: max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"request {self.seq_id!r}: min_tokens must be an int in 0..max_tokens, "
                             f"got {self.min_tokens!r}")
        self.prompt_token_ids = prompt
        self.stop_token_ids = _token_set("stop_token_ids", self.stop_token_ids)
        self.eos_token_ids = _token_set("eos_token_ids", self.eos_token_ids)
        self.token_ids = list(prompt)

    # -- derived --------------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled (1 = decode)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens whose KV is written or being written by a launched step (computed + in flight)."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_tokens_after_inflight(self) -> int:
        """Length of token_ids once the steps in flight have returned their samples."""
        return len(self.token_ids) + self.num_pending_samples

    @property
    def is_decoding(self) -> bool:
        return self.status is SequenceStatus.RUNNING and self.num_uncomputed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_kv_tokens(self) -> int:
        """KV positions this request can ever need: prompt + max_tokens - 1 (the last sampled token is
        never fed back)."""
        return len(self.prompt_token_ids) + self.max_tokens - 1

    # -- what the scheduler changes ---------------------------------------------------------------------
    @property
    def cache_node(self) -> Any:
        """The deepest prefix-cache node this sequence holds a lock on (on rank ``dp_rank``), or None."""
        return self._cache_node

    @property
    def reserved_pages(self) -> int:
        """Pages set aside for this sequence's later tokens (``preemption="never"``), not yet in ``block_table``."""
        return self._reserved_pages

    def set_cache_node(self, node: Any) -> None:
        self._cache_node = node

    def clear_cache_node(self) -> Any:
        """Forget the locked cache node; returns it (None if there was none) for the caller to unlock."""
        node, self._cache_node = self._cache_node, None
        return node

    def reserve_pages(self, n: int) -> None:
        self._reserved_pages += n

    def take_reserved(self, n: int) -> int:
        """Use up to ``n`` reserved pages; returns how many were reserved and are now used."""
        take = min(n, self._reserved_pages)
        self._reserved_pages -= take
        return take

    def drop_reserved(self) -> int:
        """Give up the whole reservation; returns its size."""
        n, self._reserved_pages = self._reserved_pages, 0
        return n

    def start_running(self, dp_rank: int, block_table: list[int], num_computed_tokens: int,
                      num_cached_tokens: int = 0) -> None:
        self.status = SequenceStatus.RUNNING
        self.dp_rank = dp_rank
        self.block_table = list(block_table)
        self.num_computed_tokens = num_computed_tokens
        self.num_cached_tokens = num_cached_tokens

    def return_to_waiting(self) -> None:
        """Preempted (its pages already released): queued again, to recompute prompt + output from scratch."""
        self.status = SequenceStatus.WAITING
        self.dp_rank = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions += 1

    def mark_finished(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def append_token(self, token: int, max_model_len: int | None = None) -> FinishReason | None:
        """Append a sampled token; returns the finish reason it triggers (``check_stop``, then the model's context
        ``max_model_len``), recording ``stop_token_id`` on a stop."""
        self.token_ids.append(token)
        reason = self.check_stop(token)
        if reason is None and max_model_len is not None and self.num_tokens >= max_model_len:
            reason = FinishReason.LENGTH
        if reason is FinishReason.STOP:
            self.stop_token_id = token
        return reason

    def check_stop(self, token: int) -> FinishReason | None:
        """The finish reason that appending ``token`` (already appended) triggers, if any."""
        n_out = self.num_output_tokens
        if n_out >= self.min_tokens:
            if token in self.stop_token_ids or (not self.ignore_eos and token in self.eos_token_ids):
                return FinishReason.STOP
        if n_out >= self.max_tokens:
            return FinishReason.LENGTH
        return None


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one sequence, for streaming."""

    seq_id: Hashable
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_output_tokens: int = 0
