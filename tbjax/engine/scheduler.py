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

Overlapped scheduling: while one batch is in flight, ``schedule`` may be called once more to build the next
batch before that one's tokens are known, so the host prepares step N+1 while the device runs step N. It is
built as if step N had returned: a sequence that samples in step N decodes that (still unknown) token next
(``ScheduledEntry.from_prev``; the runner reads it from step N's device output), a sequence that certainly ends
in step N (max_tokens / max_model_len) is left out, one that ends on eos / a stop token computes one token that
``on_step_done`` then drops. Such a call never preempts (nor admits after a shortfall): when pages are short it
returns None, and the caller finishes step N first. A sequence that ends in step N frees its pages at
``on_step_done(N)`` although step N+1 still writes its next position there: the device runs steps in order, so
a later owner's writes (step N+2 onward) land after it, and that position is never in a cached (full, computed)
page. At most two batches are in flight; ``on_step_done`` takes them in order.

The pieces: ``batch.py`` (the step's work, what ``schedule`` returns), ``dp_ranks.py`` (one rank's pages, an admission
plan), ``scheduler_pd.py`` (the disaggregation hooks below, a mixin of ``Scheduler``); this module is the policy.

Prefill/decode disaggregation adds three things (the engine's ``export_kv`` / ``reserve_kv`` / ``write_kv_pages``
/ ``add_prefilled_request`` sit on them):
- ``add(seq, hold_pages=True)``: when such a sequence finishes (not on abort) its pages are *held* instead of
  freed, until ``release_held`` (after its KV was exported). Held sequences are not unfinished work.
- ``reserve(key, n_pages)``: take pages for KV that will arrive from elsewhere (the late reservation of a
  decode worker); ``release_reservation(key)`` gives them back.
- ``add_prefilled(seq, key)``: a sequence whose prompt KV sits in reserved pages starts RUNNING at once, with
  ``num_computed_tokens == len(prompt)`` and its first generated token already in ``token_ids``.
"""

from __future__ import annotations

import bisect
import collections
import operator
from dataclasses import dataclass
from typing import Hashable, Mapping

from .batch import ScheduledBatch, ScheduledEntry
from .dp_ranks import AdmissionPlan, RankPages
from .request import FinishReason, Sequence, SequenceStatus, StepOutput
from .scheduler_pd import DisaggregationHooks, KVReservationError

__all__ = ["RequestTooLarge", "KVReservationError", "SchedulerConfig", "ScheduledEntry", "ScheduledBatch", "Scheduler"]

PREEMPTION_MODES = ("recompute", "never")


class RequestTooLarge(ValueError):
    """The request can never be served: prompt + max_tokens exceeds the model's context or one rank's pages."""


class _NeedsSync(Exception):
    """An overlapped schedule() would have to preempt: build no batch until the step in flight is done."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler settings. ``num_pages`` is per dp rank and includes the null page when it is reserved."""

    num_pages: int
    page_size: int = 16
    dp: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None  # None: up to the token budget
    max_model_len: int | None = None  # None: limited only by one rank's pages
    enable_prefix_caching: bool = True
    preemption: str = "recompute"
    reserve_null_page: bool = True
    # speculative decoding: a decode entry also covers up to this many drafted tokens (tbjax/engine/speculative.py)
    num_speculative_tokens: int = 0

    def __post_init__(self):
        for name in ("num_pages", "page_size", "dp", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= 1, got {v!r}")
        for name in ("max_prefill_chunk", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"SchedulerConfig.{name} must be None or an int >= 1, got {v!r}")
        if not _is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 0:
            raise ValueError(f"SchedulerConfig.num_speculative_tokens must be an int >= 0, "
                             f"got {self.num_speculative_tokens!r}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"SchedulerConfig.preemption must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_num_seqs={self.max_num_seqs}: "
                "the budget must hold one decode token for every running sequence")
        if self.num_pages <= int(self.reserve_null_page):
            raise ValueError(f"num_pages={self.num_pages} leaves no usable page per rank")

    @property
    def usable_pages(self) -> int:
        return self.num_pages - int(self.reserve_null_page)

    @property
    def chunk_size(self) -> int:
        c = self.max_prefill_chunk
        return self.max_num_batched_tokens if c is None else min(c, self.max_num_batched_tokens)


class Scheduler(DisaggregationHooks):
    """Continuous batching with chunked prefill over ``dp`` ranks of paged KV (see module docstring)."""

    def __init__(self, config: SchedulerConfig):
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"Scheduler needs a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.page_size = config.page_size
        self.ranks = [RankPages(i, config) for i in range(config.dp)]
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []  # sorted by arrival
        self._seqs: dict[Hashable, Sequence] = {}
        self._arrivals = 0
        self._step = 0
        self._inflight: collections.deque[ScheduledBatch] = collections.deque()   # launched, not yet done
        self._hold: set[Hashable] = set()                      # seq ids whose pages are held when they finish
        self._held: dict[Hashable, Sequence] = {}              # finished, pages held until release_held
        self._reservations: dict[Hashable, tuple[int, list[int]]] = {}   # key -> (rank, pages) (late reservations)
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.max_model_len = config.max_model_len  # None: only one rank's pages limit a request

    # -- requests -------------------------------------------------------------------------------------
    def add(self, seq: Sequence, *, hold_pages: bool = False) -> Sequence:
        """Queue a new request; raises ``RequestTooLarge`` if it could never be served. ``hold_pages``: keep
        its pages when it finishes (see ``release_held``)."""
        self._check_new(seq)
        seq.arrival = self._arrivals
        self._arrivals += 1
        self._seqs[seq.seq_id] = seq
        self._waiting.append(seq)
        if hold_pages:
            self._hold.add(seq.seq_id)
        return seq

    def _check_new(self, seq: Sequence) -> None:
        if not isinstance(seq, Sequence):
            raise TypeError(f"add() takes a tbjax.engine.Sequence, got {type(seq).__name__}")
        if seq.status is not SequenceStatus.WAITING or seq.arrival >= 0:
            raise ValueError(f"sequence {seq.seq_id!r} was already added to a scheduler")
        if seq.seq_id in self._seqs:
            raise ValueError(f"a request with id {seq.seq_id!r} is already queued or running")
        total = seq.num_prompt_tokens + seq.max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise RequestTooLarge(
                f"request {seq.seq_id!r}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.max_tokens}) "
                f"= {total} exceeds max_model_len={self.max_model_len}")
        pages = _cdiv(seq.max_kv_tokens, self.page_size)
        if pages > self.config.usable_pages:
            raise RequestTooLarge(
                f"request {seq.seq_id!r}: prompt ({seq.num_prompt_tokens}) + max_tokens ({seq.max_tokens}) needs "
                f"{pages} KV pages of {self.page_size} tokens but a dp rank has only {self.config.usable_pages}")
        if seq.seq_id in self._held:
            raise ValueError(f"request id {seq.seq_id!r} still holds pages (export or release it first)")

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
        hold = seq.seq_id in self._hold
        self._hold.discard(seq.seq_id)
        if seq.status is SequenceStatus.RUNNING and hold and reason is not FinishReason.ABORT:
            self._running.remove(seq)
            self.ranks[seq.dp_rank].num_running -= 1
            self._held[seq.seq_id] = seq       # pages (and cache lock) stay until release_held
        elif seq.status is SequenceStatus.RUNNING:
            self._release(seq)
            self._running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
        if reason is not FinishReason.ABORT:
            self.num_finished += 1

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

    # -- pages ----------------------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        """Drop everything a running sequence holds: its cache lock, its page references, its reservation."""
        self._drop_pages(seq)
        self.ranks[seq.dp_rank].num_running -= 1

    def _drop_pages(self, seq: Sequence) -> None:
        r = self.ranks[seq.dp_rank]
        if seq._cache_node is not None:
            r.cache.unlock(seq._cache_node)
            seq._cache_node = None
        r.allocator.decref_all(seq.block_table)
        seq.block_table = []
        r.reserved -= seq._reserved_pages
        seq._reserved_pages = 0

    def _tokens_coverable(self, seq: Sequence) -> int:
        """How many more tokens (past those computed or in flight) ``seq`` can get pages for right now."""
        r = self.ranks[seq.dp_rank]
        pages = len(seq.block_table) + seq._reserved_pages + max(0, r.headroom)
        return pages * self.page_size - seq.num_scheduled_tokens

    def _allocate(self, seq: Sequence, upto_tokens: int) -> None:
        """Extend ``seq.block_table`` to cover ``upto_tokens`` tokens (caller checked that it fits)."""
        r = self.ranks[seq.dp_rank]
        need = _cdiv(upto_tokens, self.page_size) - len(seq.block_table)
        if need <= 0:
            return
        short = need - r.allocator.num_free
        if short > 0 and r.cache is not None:
            r.cache.evict(short)
        take = min(need, seq._reserved_pages)
        seq._reserved_pages -= take
        r.reserved -= take
        seq.block_table.extend(r.allocator.allocate(need))  # raises OutOfPages on a bookkeeping bug

    def _preempt(self, seq: Sequence) -> None:
        assert not seq.num_inflight_tokens, f"{seq.seq_id!r} preempted with a step in flight (bug)"
        self._release(seq)
        self._running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.dp_rank = None
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(seq)

    def _newest_running_on(self, rank: int) -> Sequence:
        for s in reversed(self._running):
            if s.dp_rank == rank:
                return s
        raise RuntimeError(f"no running sequence on rank {rank} to preempt")

    # -- admission ------------------------------------------------------------------------------------
    def _plan(self, seq: Sequence, r: RankPages, budget: int) -> AdmissionPlan | None:
        g = self.page_size
        tokens = seq.token_ids
        match = None
        m = 0
        unlocked = 0
        if r.cache is not None:
            match = r.cache.match(tokens, max_pages=(len(tokens) - 1) // g)  # always recompute >= 1 token
            m = match.num_pages
            unlocked = r.cache.num_unlocked_on_path(match.node)
        start = m * g
        n = min(len(tokens) - start, self.config.chunk_size, budget)
        if self.config.preemption == "never":
            new_pages = _cdiv(seq.max_kv_tokens, g) - m
        else:
            new_pages = _cdiv(start + n, g) - m
        if new_pages + unlocked > r.headroom:
            return None
        return AdmissionPlan(r, match, start, n, new_pages, unlocked)

    def _admit(self, seq: Sequence, plan: AdmissionPlan) -> None:
        r = plan.rank
        seq.dp_rank = r.idx
        seq.status = SequenceStatus.RUNNING
        seq.block_table = []
        if plan.match is not None:
            pages = plan.match.pages
            for p in pages:
                r.allocator.incref(p)
            seq.block_table = list(pages)
            if pages:
                r.cache.lock(plan.match.node)
                seq._cache_node = plan.match.node
            r.cache.record_query(seq.num_tokens, plan.start)
        seq.num_computed_tokens = plan.start
        seq.num_cached_tokens = plan.start
        if self.config.preemption == "never":
            seq._reserved_pages = plan.new_pages
            r.reserved += plan.new_pages
        r.num_running += 1
        head = self._waiting.popleft()
        assert head is seq
        bisect.insort(self._running, seq, key=lambda s: s.arrival)
        self._allocate(seq, plan.start + plan.num_tokens)

    # -- the step -------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Build the next batch (allocating its pages); None when there is nothing to run. With a batch in flight
        (overlapped scheduling, see the module docstring) None also means "not before that batch is done"."""
        if len(self._inflight) >= 2:
            raise RuntimeError(f"schedule() called with steps {[b.step for b in self._inflight]} in flight: "
                               "call on_step_done(batch, sampled) for the oldest first")
        if self._inflight and self.config.num_speculative_tokens:
            raise RuntimeError("speculative decoding schedules one step at a time (no overlapped scheduling)")
        try:
            return self._schedule(overlapped=bool(self._inflight))
        except _NeedsSync:
            return None

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """The sample in flight certainly ends ``seq`` (max_tokens or max_model_len reached)."""
        if not seq.num_pending_samples:
            return False
        return seq.num_output_tokens + seq.num_pending_samples >= seq.max_tokens or \
            (self.max_model_len is not None and seq.num_tokens_after_inflight >= self.max_model_len)

    def _shares_inflight_pages(self, seq: Sequence) -> bool:
        """A step in flight computes a full page that ``seq``'s prompt could take from the prefix cache once that
        step is done, beyond what the cache gives it now (so admitting it now would compute the page again)."""
        g = self.page_size
        usable = (len(seq.token_ids) - 1) // g          # as in _plan: at least one token is always recomputed
        for r in self.ranks:
            if r.cache is None:
                continue
            end = (r.cache.match(seq.token_ids, max_pages=usable).num_pages + 1) * g
            if end > usable * g:
                continue
            head = seq.token_ids[:end]
            for s in self._running:
                if s.dp_rank == r.idx and s.num_computed_tokens < end <= s.num_scheduled_tokens and \
                        s.token_ids[:end] == head:
                    return True
        return False

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
            while True:
                cap = self._tokens_coverable(seq)
                if cap >= 1:
                    n = min(want, cap)
                    self._allocate(seq, seq.num_scheduled_tokens + n)
                    return n
                if cfg.preemption == "never":
                    raise RuntimeError(f"sequence {seq.seq_id!r} ran out of reserved pages (bookkeeping bug)")
                if overlapped:
                    raise _NeedsSync
                victim = self._newest_running_on(seq.dp_rank)
                self._preempt(victim)
                preempted.append(victim.seq_id)
                old = scheduled.pop(victim.seq_id, None)
                if old is not None:
                    budget += old.num_tokens
                if victim is seq:
                    return 0

        # 1. decodes, oldest first. Speculative: each with up to k drafted tokens out of the budget that neither
        # the other decodes (one token each) nor the prefill chunks of step 2 and 3 want (drafts never delay a prompt)
        k = cfg.num_speculative_tokens
        decodes = [s for s in self._running if s.status is SequenceStatus.RUNNING and
                   s.num_tokens_after_inflight - s.num_scheduled_tokens == 1 and not self._ends_in_flight(s)]
        spare = budget - len(decodes)
        if k:
            for s in self._running:
                left = s.num_tokens_after_inflight - s.num_scheduled_tokens
                if s.status is SequenceStatus.RUNNING and left > 1:
                    spare -= min(left, cfg.chunk_size)
            if self._waiting and self._slots_taken() < cfg.max_num_seqs:
                spare -= min(self._waiting[0].num_tokens, cfg.chunk_size)
        for seq in decodes:
            if seq.status is not SequenceStatus.RUNNING:     # preempted for an older one
                continue
            nd = 0
            if k:
                nd = min(k, max(spare, 0), seq.max_tokens - seq.num_output_tokens - 1)
                if self.max_model_len is not None:
                    nd = min(nd, self.max_model_len - seq.num_tokens - 1)
                nd = max(nd, 0)
            got = fit(seq, 1 + nd)
            if got:
                nd = got - 1
                spare -= nd
                scheduled[seq.seq_id] = ScheduledEntry(seq, seq.num_scheduled_tokens, 1 + nd, True, True,
                                                       from_prev=seq.num_pending_samples > 0, num_draft=nd)
                budget -= 1 + nd
        # 2. running prefills, oldest first
        for seq in list(self._running):
            if budget <= 0:
                break
            left = seq.num_tokens_after_inflight - seq.num_scheduled_tokens
            if seq.status is not SequenceStatus.RUNNING or left <= 1:
                continue
            want = min(left, cfg.chunk_size, budget)
            n = fit(seq, want)
            if n:
                start = seq.num_scheduled_tokens
                scheduled[seq.seq_id] = ScheduledEntry(seq, start, n, start + n == seq.num_tokens_after_inflight,
                                                       False)
                budget -= n
        # 3. admissions, first come first served (none after a preemption: pages are short)
        if not preempted:
            while self._waiting and budget > 0 and self._slots_taken() < cfg.max_num_seqs:
                seq = self._waiting[0]
                best = None
                for r in self.ranks:
                    plan = self._plan(seq, r, budget)
                    if plan is None:
                        continue
                    # most headroom left after admission, counting a reused cached prefix as saved pages (its pages
                    # are resident already and now shared), then fewest running
                    reused = plan.match.num_pages if plan.match is not None else 0
                    key = (r.headroom - plan.new_pages - plan.unlocked + reused, -r.num_running, -r.idx)
                    if best is None or key > best[0]:
                        best = (key, plan)
                if best is None:
                    break  # the head waits for pages; nobody overtakes it
                if overlapped and self._shares_inflight_pages(seq):
                    break  # admitted next step, when a page the step in flight computes is in the prefix cache
                plan = best[1]
                self._admit(seq, plan)
                n = plan.num_tokens
                scheduled[seq.seq_id] = ScheduledEntry(seq, plan.start, n, plan.start + n == seq.num_tokens, False)
                budget -= n

        if not scheduled:
            if self._seqs and not overlapped:
                raise RuntimeError("scheduler made no progress with requests pending (bug)")
            return None
        entries = sorted(scheduled.values(), key=lambda e: (not e.is_decode, e.seq.arrival))
        for e in entries:
            e.seq.num_inflight_tokens += e.num_tokens
            e.seq.num_pending_samples += e.samples
        batch = ScheduledBatch(self._step, entries, preempted)
        self._step += 1
        self._inflight.append(batch)
        return batch

    def on_step_done(self, batch: ScheduledBatch, sampled: Mapping[Hashable, int]) -> list[StepOutput]:
        """Record a finished step: advance computed tokens, cache new full pages, append sampled tokens,
        apply eos / stop tokens / max_tokens. Returns one ``StepOutput`` per sampling entry still alive.
        Batches in flight are done in the order they were scheduled.

        Speculative decoding: an entry with drafted tokens (``num_draft``) takes a list: the accepted drafts and
        the token sampled after them (1 .. 1 + num_draft tokens). Only the accepted positions' KV counts as
        computed (the rejected ones are rolled back: pages past the computed ones are freed), and the tokens are
        appended one by one, the first that ends the request (eos, stop token, max_tokens) ending the list."""
        if not self._inflight or batch is not self._inflight[0]:
            raise RuntimeError("on_step_done() got a batch that is not the oldest one in flight "
                               "(call schedule(), then on_step_done() with its batch)")
        g = self.page_size
        in_batch = {e.seq_id for e in batch.entries}
        live = {}
        for e in batch.entries:
            if e.seq.status is SequenceStatus.RUNNING and self._seqs.get(e.seq_id) is e.seq:
                live[e.seq_id] = e
        tokens = {}
        for sid, tok in sampled.items():
            if sid not in in_batch:
                raise ValueError(f"sampled token for {sid!r}, which is not in step {batch.step}")
            e = live.get(sid)
            if e is None:
                continue  # aborted / finished since schedule(): its token is dropped
            if not e.samples:
                raise ValueError(f"sampled token for {sid!r}, whose entry in step {batch.step} is an "
                                 "intermediate prefill chunk (it does not sample)")
            run = list(tok) if isinstance(tok, (list, tuple)) else [tok]
            if not 1 <= len(run) <= 1 + e.num_draft:
                raise ValueError(f"{len(run)} tokens for {sid!r}, whose entry in step {batch.step} yields "
                                 f"1..{1 + e.num_draft}")
            ts = []
            for x in run:
                try:
                    t = operator.index(x)
                except TypeError:
                    t = -1
                if isinstance(x, bool) or t < 0:
                    raise ValueError(f"sampled token for {sid!r} must be a non-negative int, got {x!r}")
                ts.append(t)
            tokens[sid] = ts
        for sid, e in live.items():
            if e.samples and sid not in tokens:
                raise ValueError(f"no sampled token for {sid!r}, whose entry in step {batch.step} samples")
        self._inflight.popleft()
        outputs = []
        for sid, e in live.items():
            seq = e.seq
            if seq.num_computed_tokens != e.start:
                raise RuntimeError(f"{sid!r}: computed {seq.num_computed_tokens} tokens but entry starts at {e.start}")
            end = e.end
            if e.num_draft and sid in tokens:       # accepted drafts' KV only; pages past it are freed
                end = e.start + len(tokens[sid])
                self._trim_pages(seq, end)
            seq.num_computed_tokens = end
            seq.num_inflight_tokens -= e.num_tokens
            seq.num_pending_samples -= e.samples
            r = self.ranks[seq.dp_rank]
            known = seq.token_ids + (tokens[sid][:-1] if e.num_draft and sid in tokens else [])
            if r.cache is not None:
                node = seq._cache_node or r.cache.root
                if end // g > node.depth:
                    new = r.cache.insert(node, known[:end], seq.block_table)
                    if new is not node:
                        if node is r.cache.root:
                            r.cache.lock(new)
                        else:
                            r.cache.move_lock(node, new)
                        seq._cache_node = new
            if not e.samples:
                continue
            new, reason = [], None
            for tok in tokens[sid]:
                seq.token_ids.append(tok)
                new.append(tok)
                reason = seq.check_stop(tok)
                if reason is None and self.max_model_len is not None and seq.num_tokens >= self.max_model_len:
                    reason = FinishReason.LENGTH
                if reason is not None:
                    if reason is FinishReason.STOP:
                        seq.stop_token_id = tok
                    self._finish(seq, reason)
                    break
            outputs.append(StepOutput(sid, new, reason is not None, reason, seq.stop_token_id,
                                      seq.num_output_tokens))
        return outputs

    def _trim_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Free the pages of ``seq`` past those ``num_tokens`` positions fill (rejected speculative positions);
        under ``preemption="never"`` they return to its reservation."""
        keep = _cdiv(num_tokens, self.page_size)
        extra = seq.block_table[keep:]
        if not extra:
            return
        del seq.block_table[keep:]
        r = self.ranks[seq.dp_rank]
        r.allocator.decref_all(extra)
        if self.config.preemption == "never":
            seq._reserved_pages += len(extra)
            r.reserved += len(extra)

    # -- counters and checks --------------------------------------------------------------------------
    def stats(self) -> dict:
        ranks = []
        for r in self.ranks:
            a = r.allocator
            d = {
                "pages_total": a.num_usable,
                "pages_free": a.num_free,
                "pages_used": a.num_used,
                "pages_reserved": r.reserved,
                "capacity_tokens": a.capacity_tokens,
                "used_tokens": a.used_tokens,
                "num_running": r.num_running,
            }
            if r.cache is not None:
                d["prefix_cache"] = r.cache.stats()
            ranks.append(d)
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
            "ranks": ranks,
        }

    def check(self) -> None:
        """Verify all page bookkeeping between steps; raises AssertionError (used by tests)."""
        g = self.page_size
        assert len(self._running) <= self.config.max_num_seqs
        inflight_tokens, inflight_samples = collections.Counter(), collections.Counter()
        for b in self._inflight:
            for e in b.entries:
                if self._seqs.get(e.seq_id) is e.seq:
                    inflight_tokens[e.seq_id] += e.num_tokens
                    inflight_samples[e.seq_id] += e.samples
        assert [s.arrival for s in self._running] == sorted(s.arrival for s in self._running)
        for s in self._waiting:
            assert s.status is SequenceStatus.WAITING and not s.block_table and s._cache_node is None
            assert s._reserved_pages == 0 and s.dp_rank is None and s.num_computed_tokens == 0
            assert s.num_inflight_tokens == 0 and s.num_pending_samples == 0
        for r in self.ranks:
            a = r.allocator
            a.check()
            holders = collections.Counter()
            seqs = [s for s in self._running if s.dp_rank == r.idx]
            assert r.num_running == len(seqs)
            for s in self._held.values():
                if s.dp_rank == r.idx:
                    holders.update(s.block_table)
            for rank, pages in self._reservations.values():
                if rank == r.idx:
                    holders.update(pages)
            for s in seqs:
                assert s.status is SequenceStatus.RUNNING
                assert s.num_inflight_tokens == inflight_tokens[s.seq_id], s.seq_id
                assert s.num_pending_samples == inflight_samples[s.seq_id] <= 1, s.seq_id
                assert len(s.block_table) >= _cdiv(s.num_scheduled_tokens, g)
                assert a.null_page is None or a.null_page not in s.block_table
                holders.update(s.block_table)
                if s._cache_node is not None:
                    assert s._cache_node.alive and s._cache_node.lock_ref >= 1
                    assert s._cache_node.path_pages() == s.block_table[:s._cache_node.depth]
            cached = set()
            if r.cache is not None:
                r.cache.check()
                cached = r.cache.cached_pages()
            for p in range(a.num_pages - a.num_usable, a.num_pages):
                want = holders[p] + (p in cached)
                assert a.refcount(p) == want, f"rank {r.idx} page {p}: refcount {a.refcount(p)} != holders {want}"
            assert r.reserved == sum(s._reserved_pages for s in seqs) + \
                sum(s._reserved_pages for s in self._held.values() if s.dp_rank == r.idx)
            if self.config.preemption == "never":
                assert r.headroom >= 0, f"rank {r.idx}: reservations exceed free + evictable pages"
