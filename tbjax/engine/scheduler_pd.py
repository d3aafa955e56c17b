"""The scheduler's side of prefill/decode disaggregation, as a mixin of ``Scheduler`` (the state it uses is the
scheduler's: ``_hold`` / ``_held`` / ``_reservations``, the ranks, the running list):

- prefill side: ``add(seq, hold_pages=True)`` makes a finishing sequence's pages *held* (``held``, ``num_held``)
  until ``release_held`` (after its KV was exported);
- decode side: ``reserve(key, n_pages)`` takes pages (and a sequence slot) for KV that arrives from elsewhere, the
  late reservation; ``release_reservation`` gives them back; ``add_prefilled(seq, key, first_token)`` starts a
  sequence RUNNING on a reservation that holds its whole prompt's KV.
"""
from __future__ import annotations

import bisect
from typing import Hashable

from .request import FinishReason, Sequence, SequenceStatus

__all__ = ["KVReservationError", "DisaggregationHooks"]


class KVReservationError(RuntimeError):
    """A KV reservation cannot be made (no pages / no sequence slot) or is used wrongly (unknown key, size)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class DisaggregationHooks:
    """Held pages (prefill side) and late reservations (decode side); mixed into ``Scheduler``."""

    # -- held pages (prefill side of disaggregation) ----------------------------------------------------
    def held(self, seq_id: Hashable) -> Sequence | None:
        """A finished sequence whose pages are held (``add(..., hold_pages=True)``), or None."""
        return self._held.get(seq_id)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def release_held(self, seq_id: Hashable) -> bool:
        """Free the pages of a held sequence; False if ``seq_id`` holds none."""
        self._hold.discard(seq_id)
        seq = self._held.pop(seq_id, None)
        if seq is None:
            return False
        self._drop_pages(seq)
        return True

    # -- late reservations and prefilled sequences (decode side) ----------------------------------------
    def _slots_taken(self) -> int:
        """Sequence slots in use: running sequences plus open KV reservations (each becomes a running sequence when
        its transfer completes), so admissions and reservations together never exceed ``max_num_seqs``."""
        return len(self._running) + len(self._reservations)

    def reserve(self, key: Hashable, num_pages: int) -> list[int]:
        """Take ``num_pages`` pages (and one sequence slot) for KV that will be written from elsewhere."""
        if not _is_int(num_pages) or num_pages < 1:
            raise KVReservationError(f"reservation {key!r}: num_pages must be an int >= 1, got {num_pages!r}")
        if key in self._reservations:
            raise KVReservationError(f"reservation {key!r} already exists")
        if num_pages > self.config.usable_pages:
            raise KVReservationError(f"reservation {key!r}: {num_pages} pages wanted but a dp rank has only "
                                     f"{self.config.usable_pages}")
        if self._slots_taken() >= self.config.max_num_seqs:
            raise KVReservationError(f"reservation {key!r}: all {self.config.max_num_seqs} sequence slots are taken "
                                     f"({len(self._running)} running, {len(self._reservations)} reserved)")
        r = max(self.ranks, key=lambda r: (r.headroom, -r.num_running, -r.idx))
        if r.headroom < num_pages:
            raise KVReservationError(f"reservation {key!r}: {num_pages} KV pages wanted, only {max(0, r.headroom)} "
                                     f"obtainable (free + evictable, less reservations)")
        short = num_pages - r.allocator.num_free
        if short > 0 and r.cache is not None:
            r.cache.evict(short)
        pages = r.allocator.allocate(num_pages)
        self._reservations[key] = (r.idx, pages)
        return list(pages)

    def reservation(self, key: Hashable) -> tuple[int, list[int]] | None:
        """(dp rank, page ids) of an open reservation, or None."""
        res = self._reservations.get(key)
        return None if res is None else (res[0], list(res[1]))

    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    def release_reservation(self, key: Hashable) -> bool:
        """Give back the pages of a reservation that will not be used; False if there is none."""
        res = self._reservations.pop(key, None)
        if res is None:
            return False
        self.ranks[res[0]].allocator.decref_all(res[1])
        return True

    def add_prefilled(self, seq: Sequence, key: Hashable, first_token: int) -> FinishReason | None:
        """Start ``seq`` RUNNING on the pages of reservation ``key``, which hold its whole prompt's KV, with
        ``first_token`` (sampled by the prefill side) appended. Returns a finish reason when that token already
        ends the request (its pages are then freed and nothing runs)."""
        self._check_new(seq)
        if isinstance(first_token, bool) or not isinstance(first_token, int) or first_token < 0:
            raise ValueError(f"request {seq.seq_id!r}: first_token must be a non-negative int, got {first_token!r}")
        res = self._reservations.get(key)
        if res is None:
            raise KVReservationError(f"no reservation {key!r} for request {seq.seq_id!r} (released or never made)")
        rank, pages = res
        need = _cdiv(seq.num_prompt_tokens, self.page_size)
        if len(pages) != need:
            raise KVReservationError(f"reservation {key!r} has {len(pages)} pages; the {seq.num_prompt_tokens}-token "
                                     f"prompt of {seq.seq_id!r} fills {need}")
        r = self.ranks[rank]
        extra = 0
        if self.config.preemption == "never":
            extra = max(0, _cdiv(seq.max_kv_tokens, self.page_size) - need)
            if extra > r.headroom:
                raise KVReservationError(f"request {seq.seq_id!r}: {extra} more pages needed for its output, only "
                                         f"{max(0, r.headroom)} obtainable")
        del self._reservations[key]
        seq.arrival = self._arrivals
        self._arrivals += 1
        first = int(first_token)
        seq.token_ids.append(first)
        reason = seq.check_stop(first)
        if reason is None and self.max_model_len is not None and seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            r.allocator.decref_all(pages)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
            if reason is FinishReason.STOP:
                seq.stop_token_id = first
            self.num_finished += 1
            return reason
        seq.dp_rank = rank
        seq.status = SequenceStatus.RUNNING
        seq.block_table = list(pages)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq._reserved_pages = extra
        r.reserved += extra
        r.num_running += 1
        self._seqs[seq.seq_id] = seq
        bisect.insort(self._running, seq, key=lambda s: s.arrival)
        return None
