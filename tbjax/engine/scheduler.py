"""Continuous-batching scheduler: decides, step by step, which tokens of which sequences run on which dp rank.

Each step (``schedule``) builds a decode-maximal batch under a token budget:
1. every running sequence with one token left (a decode) gets that token, oldest first;
2. running sequences still prefilling get their next chunk (at most ``max_prefill_chunk`` tokens);
3. while budget and sequence slots remain, the head of the waiting queue is admitted (first come, first
   served: the head is never skipped, so nobody starves) to the dp rank where it fits best, reusing
   any cached prefix there, and gets its first chunk.
A prefill chunk samples only when it reaches the sequence's last token; a readmitted sequence simply
prefills prompt + output again.

Pages: each dp rank has its own ``PageAllocator`` and (optionally) ``PrefixCache``. A step allocates the
pages that its tokens need, evicting unused cached pages first. When a rank is out of pages:
- ``preemption="recompute"``: the newest running sequence of that rank (by arrival) is preempted: its
  computed full pages go to the prefix cache, the rest is freed, and it goes back to the front of the
  waiting queue. Admission needs pages only for the first chunk.
- ``preemption="never"``: admission reserves the worst case (prompt + max_tokens - 1 KV positions, less
  the cached prefix) up front, so a running sequence never runs out and nothing is ever preempted.

A request that could never fit (over ``max_model_len``, or more pages than one rank has) is refused by
``add`` with ``RequestTooLarge``. Protocol: ``schedule`` -> run the batch -> ``on_step_done``; ``abort`` /
``finish`` free a sequence's pages at once. Block tables can change between steps (page deduplication when
prefixes are inserted), so read ``seq.block_table`` fresh every step.

This module is the policy: admission, the budget, preemption, the step plan and recording a finished step. The
rest sits in collaborators, each behind a small interface:
- ``dp_ranks.RankPages``: one rank's pages and every change to the pages a sequence holds there (block table,
  prefix-cache lock, reservation);
- ``dp_placement``: which rank a sequence (or a late reservation) goes to;
- ``scheduler_overlap.InFlight`` (``self.inflight``): the batches in flight, for overlapped scheduling (step N+1
  built while step N runs; such a call never preempts and returns None when pages are short);
- ``scheduler_pd.DisaggregatedPages`` (``self.disagg``): held pages and late reservations for prefill/decode
  disaggregation; ``held`` / ``release_held`` / ``reservation`` / ``release_reservation`` pass straight to it,
  while ``add(..., hold_pages=True)``, ``reserve`` and ``add_prefilled`` also use the scheduler's own state;
- ``scheduler_spec.DraftBudget`` (``self.drafts``): the drafted tokens of speculative decoding;
- ``batch``: what ``schedule`` returns; ``scheduler_config``: the settings.
"""

from __future__ import annotations

import bisect
import collections
from typing import Hashable, Mapping

from .batch import ScheduledBatch, ScheduledEntry
from .dp_placement import AdmissionPlan, place
from .dp_ranks import RankPages, cdiv
from .request import FinishReason, Sequence, SequenceStatus, StepOutput
from .scheduler_config import SchedulerConfig
from .scheduler_overlap import InFlight, NeedsSync
from .scheduler_pd import DisaggregatedPages, KVReservationError
from .scheduler_spec import DraftBudget

__all__ = ["RequestTooLarge", "KVReservationError", "SchedulerConfig", "ScheduledEntry", "ScheduledBatch", "Scheduler"]

RUNNING, WAITING = SequenceStatus.RUNNING, SequenceStatus.WAITING


class RequestTooLarge(ValueError):
    """The request can never be served: prompt + max_tokens exceeds the model's context or one rank's pages."""


class Scheduler:
    """Continuous batching with chunked prefill over ``dp`` ranks of paged KV (see module docstring)."""

    def __init__(self, config: SchedulerConfig):
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"Scheduler needs a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.page_size = config.page_size
        self.max_model_len = config.max_model_len  # None: only one rank's pages limit a request
        self.ranks = [RankPages(i, config) for i in range(config.dp)]
        self.inflight = InFlight(config.max_model_len)
        self.disagg = DisaggregatedPages(self.ranks, config)
        self.drafts = DraftBudget(config.num_speculative_tokens, config.chunk_size, config.max_model_len)
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []  # sorted by arrival
        self._seqs: dict[Hashable, Sequence] = {}
        self._arrivals = 0
        self._step = 0
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_aborted = 0

    # -- requests -------------------------------------------------------------------------------------
    def add(self, seq: Sequence, *, hold_pages: bool = False) -> Sequence:
        """Queue a new request; raises ``RequestTooLarge`` if it could never be served. ``hold_pages``: keep
        its pages when it finishes (see ``release_held``)."""
        self._check_new(seq)
        self._number(seq)
        self._seqs[seq.seq_id] = seq
        self._waiting.append(seq)
        if hold_pages:
            self.disagg.hold(seq.seq_id)
        return seq

    def _check_new(self, seq: Sequence) -> None:
        if not isinstance(seq, Sequence):
            raise TypeError(f"add() takes a tbjax.engine.Sequence, got {type(seq).__name__}")
        if seq.status is not WAITING or seq.arrival >= 0:
            raise ValueError(f"sequence {seq.seq_id!r} was already added to a scheduler")
        if seq.seq_id in self._seqs:
            raise ValueError(f"a request with id {seq.seq_id!r} is already queued or running")
        total = seq.num_prompt_tokens + seq.max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise RequestTooLarge(
                f"request {seq.seq_id!r}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.max_tokens}) "
                f"= {total} exceeds max_model_len={self.max_model_len}")
        pages = cdiv(seq.max_kv_tokens, self.page_size)
        if pages > self.config.usable_pages:
            raise RequestTooLarge(
                f"request {seq.seq_id!r}: prompt ({seq.num_prompt_tokens}) + max_tokens ({seq.max_tokens}) needs "
                f"{pages} KV pages of {self.page_size} tokens but a dp rank has only {self.config.usable_pages}")
        if self.disagg.held(seq.seq_id) is not None:
            raise ValueError(f"request id {seq.seq_id!r} still holds pages (export or release it first)")

    def _number(self, seq: Sequence) -> None:
        seq.arrival = self._arrivals
        self._arrivals += 1

    def get(self, seq_id: Hashable) -> Sequence | None:
        return self._seqs.get(seq_id)

    def abort(self, seq_id: Hashable) -> bool:
        """Cancel a waiting or running request, freeing its pages now. False if unknown or already done."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, FinishReason.ABORT)
        self.num_aborted += 1
        return True

    def finish(self, seq_id: Hashable, reason: FinishReason = FinishReason.STOP) -> bool:
        """Finish a request early (e.g. a stop string the caller detected), freeing its pages now."""
        if not isinstance(reason, FinishReason):
            raise ValueError(f"finish reason must be a FinishReason, got {reason!r}")
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, reason)
        return True

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        hold = self.disagg.take_hold(seq.seq_id)
        if seq.status is RUNNING and hold and reason is not FinishReason.ABORT:
            self._leave_running(seq)
            self.disagg.keep(seq)              # pages (and cache lock) stay until release_held
        elif seq.status is RUNNING:
            self.ranks[seq.dp_rank].release(seq)
            self._leave_running(seq)
        elif seq.status is WAITING:
            self._waiting.remove(seq)
        seq.mark_finished(reason)
        del self._seqs[seq.seq_id]
        if reason is not FinishReason.ABORT:
            self.num_finished += 1

    # -- prefill/decode disaggregation (the state is self.disagg's) ------------------------------------
    def held(self, seq_id: Hashable) -> Sequence | None:
        return self.disagg.held(seq_id)

    def release_held(self, seq_id: Hashable) -> bool:
        return self.disagg.release_held(seq_id)

    @property
    def num_held(self) -> int:
        return self.disagg.num_held

    def reservation(self, key: Hashable) -> tuple[int, list[int]] | None:
        return self.disagg.reservation(key)

    @property
    def num_reservations(self) -> int:
        return self.disagg.num_reservations

    def release_reservation(self, key: Hashable) -> bool:
        return self.disagg.release_reservation(key)

    def reserve(self, key: Hashable, num_pages: int) -> list[int]:
        """Take ``num_pages`` pages (and one sequence slot) for KV that will be written from elsewhere."""
        return self.disagg.reserve(key, num_pages, num_running=len(self._running))

    def add_prefilled(self, seq: Sequence, key: Hashable, first_token: int) -> FinishReason | None:
        """Start ``seq`` RUNNING on the pages of reservation ``key``, which hold its whole prompt's KV, with
        ``first_token`` (sampled by the prefill side) appended. Returns a finish reason when that token already
        ends the request (its pages are then freed and nothing runs)."""
        self._check_new(seq)
        r, pages, extra = self.disagg.claim(key, seq, first_token)
        self._number(seq)
        reason = seq.append_token(int(first_token), self.max_model_len)
        if reason is not None:
            r.allocator.decref_all(pages)
            seq.mark_finished(reason)
            self.num_finished += 1
            return reason
        seq.start_running(r.idx, pages, seq.num_prompt_tokens)
        r.reserve_for(seq, extra)
        self._seqs[seq.seq_id] = seq
        self._enter_running(seq)
        return None

    def _slots_taken(self) -> int:
        """Sequence slots in use: running sequences plus open KV reservations (each becomes a running sequence when
        its transfer completes), so admissions and reservations together never exceed ``max_num_seqs``."""
        return len(self._running) + self.disagg.num_reservations

    # -- queries --------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> list[Sequence]:
        return list(self._waiting)

    @property
    def running(self) -> list[Sequence]:
        return list(self._running)

    @property
    def capacity_tokens(self) -> int:
        """KV tokens all ranks can hold."""
        return sum(r.allocator.capacity_tokens for r in self.ranks)

    @property
    def kv_tokens_per_sequence(self) -> int:
        """KV positions one sequence can hold: one dp rank's usable pages x page size."""
        return self.config.usable_pages * self.page_size

    # -- admission and preemption ---------------------------------------------------------------------
    def _enter_running(self, seq: Sequence) -> None:
        self.ranks[seq.dp_rank].num_running += 1
        bisect.insort(self._running, seq, key=lambda s: s.arrival)

    def _leave_running(self, seq: Sequence) -> None:
        self._running.remove(seq)
        self.ranks[seq.dp_rank].num_running -= 1

    def _admit(self, seq: Sequence, plan: AdmissionPlan) -> None:
        r = plan.rank
        seq.start_running(r.idx, [], plan.start, num_cached_tokens=plan.start)
        if plan.match is not None:
            r.share_prefix(seq, plan.match)
        if self.config.preemption == "never":
            r.reserve_for(seq, plan.new_pages)
        head = self._waiting.popleft()
        assert head is seq
        self._enter_running(seq)
        r.grow(seq, plan.start + plan.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        assert not seq.num_inflight_tokens, f"{seq.seq_id!r} preempted with a step in flight (bug)"
        self.ranks[seq.dp_rank].release(seq)
        self._leave_running(seq)
        seq.return_to_waiting()
        self.num_preemptions += 1
        self._waiting.appendleft(seq)

    def _newest_running_on(self, rank: int) -> Sequence:
        for s in reversed(self._running):
            if s.dp_rank == rank:
                return s
        raise RuntimeError(f"no running sequence on rank {rank} to preempt")

    # -- the step -------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Build the next batch (allocating its pages); None when there is nothing to run. With a batch in flight
        (overlapped scheduling) None also means "not before that batch is done"."""
        self.inflight.check_can_schedule(speculative=bool(self.config.num_speculative_tokens))
        try:
            return self._schedule(overlapped=bool(self.inflight))
        except NeedsSync:
            return None

    def _schedule(self, overlapped: bool) -> ScheduledBatch | None:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: dict[Hashable, ScheduledEntry] = {}
        preempted: list[Hashable] = []

        def fit(seq: Sequence, want: int) -> int:
            """Pages for up to ``want`` tokens of ``seq``, preempting the newest sequences of its rank if
            needed; returns the tokens granted (0 if ``seq`` itself was preempted)."""
            nonlocal budget
            if len(seq.block_table) * self.page_size - seq.num_scheduled_tokens >= want:
                return want  # its pages already cover the tokens
            r = self.ranks[seq.dp_rank]
            while True:
                cap = r.coverable(seq)
                if cap >= 1:
                    n = min(want, cap)
                    r.grow(seq, seq.num_scheduled_tokens + n)
                    return n
                if cfg.preemption == "never":
                    raise RuntimeError(f"sequence {seq.seq_id!r} ran out of reserved pages (bookkeeping bug)")
                if overlapped:
                    raise NeedsSync
                victim = self._newest_running_on(seq.dp_rank)
                self._preempt(victim)
                preempted.append(victim.seq_id)
                old = scheduled.pop(victim.seq_id, None)
                if old is not None:
                    budget += old.num_tokens
                if victim is seq:
                    return 0

        # 1. decodes, oldest first, each with up to k drafted tokens when speculative (DraftBudget)
        decodes = [s for s in self._running if s.status is RUNNING and
                   s.num_tokens_after_inflight - s.num_scheduled_tokens == 1 and not self.inflight.ends(s)]
        head = self._waiting[0] if self._waiting and self._slots_taken() < cfg.max_num_seqs else None
        spare = self.drafts.spare(budget, decodes, self._running, head)
        for seq in decodes:
            if seq.status is not RUNNING:     # preempted for an older one
                continue
            got = fit(seq, 1 + self.drafts.num_draft(seq, spare))
            if got:
                spare -= got - 1
                scheduled[seq.seq_id] = ScheduledEntry(seq, seq.num_scheduled_tokens, got, True, True,
                                                       from_prev=seq.num_pending_samples > 0, num_draft=got - 1)
                budget -= got
        # 2. running prefills, oldest first
        for seq in list(self._running):
            if budget <= 0:
                break
            left = seq.num_tokens_after_inflight - seq.num_scheduled_tokens
            if seq.status is not RUNNING or left <= 1:
                continue
            n = fit(seq, min(left, cfg.chunk_size, budget))
            if n:
                start = seq.num_scheduled_tokens
                scheduled[seq.seq_id] = ScheduledEntry(seq, start, n, start + n == seq.num_tokens_after_inflight,
                                                       False)
                budget -= n
        # 3. admissions, first come first served (none after a preemption: pages are short)
        if not preempted:
            while self._waiting and budget > 0 and self._slots_taken() < cfg.max_num_seqs:
                seq = self._waiting[0]
                plan = place(seq, self.ranks, budget, cfg.chunk_size, cfg.preemption == "never")
                if plan is None:
                    break  # the head waits for pages; nobody overtakes it
                if overlapped and self.inflight.computes_prefix_of(seq, self.ranks, self._running):
                    break  # admitted next step, when a page the step in flight computes is in the prefix cache
                self._admit(seq, plan)
                n = plan.num_tokens
                scheduled[seq.seq_id] = ScheduledEntry(seq, plan.start, n, plan.start + n == seq.num_tokens, False)
                budget -= n

        if not scheduled:
            if self._seqs and not overlapped:
                raise RuntimeError("scheduler made no progress with requests pending (bug)")
            return None
        entries = sorted(scheduled.values(), key=lambda e: (not e.is_decode, e.seq.arrival))
        batch = ScheduledBatch(self._step, entries, preempted)
        self._step += 1
        self.inflight.launch(batch)
        return batch

    def on_step_done(self, batch: ScheduledBatch, sampled: Mapping[Hashable, int]) -> list[StepOutput]:
        """Record a finished step: advance computed tokens, cache new full pages, append sampled tokens,
        apply eos / stop tokens / max_tokens. Returns one ``StepOutput`` per sampling entry still alive.
        Batches in flight are done in the order they were scheduled.

        Speculative decoding: an entry with drafted tokens (``num_draft``) takes a list: the accepted drafts and
        the token sampled after them (1 .. 1 + num_draft tokens). Only the accepted positions' KV counts as
        computed (the rejected ones are rolled back: pages past the computed ones are freed), and the tokens are
        appended one by one, the first that ends the request (eos, stop token, max_tokens) ending the list."""
        self.inflight.check_oldest(batch)
        live = {e.seq_id: e for e in batch.entries if e.seq.status is RUNNING and self._seqs.get(e.seq_id) is e.seq}
        tokens = batch.sampled_tokens(sampled, live)
        self.inflight.pop_oldest()
        never = self.config.preemption == "never"
        outputs = []
        for sid, e in live.items():
            seq = e.seq
            if seq.num_computed_tokens != e.start:
                raise RuntimeError(f"{sid!r}: computed {seq.num_computed_tokens} tokens but entry starts at {e.start}")
            r = self.ranks[seq.dp_rank]
            end, known = self.drafts.settle(e, tokens.get(sid), r, to_reservation=never)
            seq.num_computed_tokens = end
            seq.num_inflight_tokens -= e.num_tokens
            seq.num_pending_samples -= e.samples
            r.cache_computed(seq, known, end)
            if not e.samples:
                continue
            new, reason = [], None
            for tok in tokens[sid]:
                new.append(tok)
                reason = seq.append_token(tok, self.max_model_len)
                if reason is not None:
                    self._finish(seq, reason)
                    break
            outputs.append(StepOutput(sid, new, reason is not None, reason, seq.stop_token_id,
                                      seq.num_output_tokens))
        return outputs

    # -- counters and checks --------------------------------------------------------------------------
    def stats(self) -> dict:
        caches = [r.cache for r in self.ranks if r.cache is not None]
        q = sum(c.query_tokens for c in caches)
        h = sum(c.hit_tokens for c in caches)
        return {
            "step": self._step,
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
            "num_preemptions": self.num_preemptions,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "capacity_tokens": self.capacity_tokens,
            "pages_used": sum(r.allocator.num_used for r in self.ranks),
            "pages_free": sum(r.allocator.num_free for r in self.ranks),
            "pages_cached": sum(c.num_nodes for c in caches),
            "pages_evictable": sum(c.num_evictable for c in caches),
            "prefix_queries": sum(c.num_queries for c in caches),
            "prefix_query_tokens": q,
            "prefix_hit_tokens": h,
            "prefix_hit_rate": h / q if q else 0.0,
            "ranks": [r.stats() for r in self.ranks],
        }

    def clear_prefix_caches(self) -> list[tuple[int, int]]:
        """Between steps: verify the page bookkeeping (``check``), drop every rank's unlocked prefix-cache pages, and
        return each rank's (free, usable) page counts."""
        self.check()
        out = []
        for r in self.ranks:
            if r.cache is not None:
                r.cache.clear()
            out.append((r.allocator.num_free, r.allocator.num_usable))
        return out

    def check(self) -> None:
        """Verify all page bookkeeping between steps; raises AssertionError (used by tests)."""
        assert len(self._running) <= self.config.max_num_seqs
        inflight_tokens, inflight_samples = self.inflight.counts(lambda s: self._seqs.get(s.seq_id) is s)
        assert [s.arrival for s in self._running] == sorted(s.arrival for s in self._running)
        for s in self._waiting:
            assert s.status is WAITING and not s.block_table and s.cache_node is None
            assert s.reserved_pages == 0 and s.dp_rank is None and s.num_computed_tokens == 0
            assert s.num_inflight_tokens == 0 and s.num_pending_samples == 0
        for s in self._running:
            assert s.status is RUNNING
            assert s.num_inflight_tokens == inflight_tokens[s.seq_id], s.seq_id
            assert s.num_pending_samples == inflight_samples[s.seq_id] <= 1, s.seq_id
        for r in self.ranks:
            r.check([s for s in self._running if s.dp_rank == r.idx], self.disagg.held_on(r.idx),
                    self.disagg.reserved_on(r.idx), never=self.config.preemption == "never")
