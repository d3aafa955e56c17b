"""The batches launched and not yet done (``InFlight``), for overlapped scheduling: while step N runs on the device,
``Scheduler.schedule`` builds step N+1 as if N had returned. This module holds what that needs to know about the
steps in flight: which sequences they certainly end, whether they compute a page the head of the queue could take
from the prefix cache, and the in-flight counters they add to each sequence. At most two batches are in flight and
they are done in launch order."""
from __future__ import annotations

import collections
from typing import Callable

from .batch import ScheduledBatch
from .dp_ranks import RankPages
from .request import Sequence

__all__ = ["InFlight", "NeedsSync"]

MAX_IN_FLIGHT = 2


class NeedsSync(Exception):
    """An overlapped schedule() would have to preempt: build no batch until the step in flight is done."""


class InFlight:
    """Launched, unfinished batches, oldest first."""

    def __init__(self, max_model_len: int | None):
        self.max_model_len = max_model_len
        self._batches: collections.deque[ScheduledBatch] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self._batches)

    def check_can_schedule(self, speculative: bool) -> None:
        """Raise unless one more batch may be built now."""
        if len(self._batches) >= MAX_IN_FLIGHT:
            raise RuntimeError(f"schedule() called with steps {[b.step for b in self._batches]} in flight: "
                               "call on_step_done(batch, sampled) for the oldest first")
        if self._batches and speculative:
            raise RuntimeError("speculative decoding schedules one step at a time (no overlapped scheduling)")

    def launch(self, batch: ScheduledBatch) -> None:
        """Count ``batch``'s tokens and samples as in flight on its sequences."""
        for e in batch.entries:
            e.seq.num_inflight_tokens += e.num_tokens
            e.seq.num_pending_samples += e.samples
        self._batches.append(batch)

    def check_oldest(self, batch: ScheduledBatch) -> None:
        if not self._batches or batch is not self._batches[0]:
            raise RuntimeError("on_step_done() got a batch that is not the oldest one in flight "
                               "(call schedule(), then on_step_done() with its batch)")

    def pop_oldest(self) -> ScheduledBatch:
        return self._batches.popleft()

    def counts(self, is_live: Callable[[Sequence], bool]) -> tuple[collections.Counter, collections.Counter]:
        """Tokens and samples in flight per seq id, over the sequences ``is_live`` accepts."""
        tokens, samples = collections.Counter(), collections.Counter()
        for b in self._batches:
            for e in b.entries:
                if is_live(e.seq):
                    tokens[e.seq_id] += e.num_tokens
                    samples[e.seq_id] += e.samples
        return tokens, samples

    def ends(self, seq: Sequence) -> bool:
        """The sample in flight certainly ends ``seq`` (max_tokens or max_model_len reached)."""
        if not seq.num_pending_samples:
            return False
        return seq.num_output_tokens + seq.num_pending_samples >= seq.max_tokens or \
            (self.max_model_len is not None and seq.num_tokens_after_inflight >= self.max_model_len)

    @staticmethod
    def computes_prefix_of(seq: Sequence, ranks: list[RankPages], running: list[Sequence]) -> bool:
        """A step in flight computes a full page that ``seq``'s prompt could take from the prefix cache once that
        step is done, beyond what the cache gives it now (so admitting it now would compute the page again)."""
        for r in ranks:
            if r.cache is None:
                continue
            g = r.page_size
            usable = (len(seq.token_ids) - 1) // g      # as in RankPages.match: at least one token is recomputed
            end = (r.cache.match(seq.token_ids, max_pages=usable).num_pages + 1) * g
            if end > usable * g:
                continue
            head = seq.token_ids[:end]
            for s in running:
                if s.dp_rank == r.idx and s.num_computed_tokens < end <= s.num_scheduled_tokens and \
                        s.token_ids[:end] == head:
                    return True
        return False
