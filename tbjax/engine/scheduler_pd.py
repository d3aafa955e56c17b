"""The scheduler's side of prefill/decode disaggregation (``DisaggregatedPages``), a collaborator that
``Scheduler`` owns and delegates to:

- prefill side: a sequence added with ``hold_pages=True`` keeps its pages (and cache lock) when it finishes
  (``keep``; ``held``, ``num_held``) until ``release_held``, after its KV was exported;
- decode side: ``reserve(key, n_pages, ...)`` takes pages for KV that arrives from elsewhere, the late reservation;
  ``release_reservation`` gives them back; ``claim`` hands a reservation that holds a whole prompt's KV over to a
  sequence that ``Scheduler.add_prefilled`` starts RUNNING on it.

It owns the hold flags, the held sequences and the reservations, and reaches the pages only through the ranks'
``RankPages``.
"""
from __future__ import annotations

from typing import Hashable

from pallas_kernels.utils import is_int

from .dp_placement import roomiest
from .dp_ranks import RankPages, cdiv
from .request import Sequence

__all__ = ["KVReservationError", "DisaggregatedPages"]


class KVReservationError(RuntimeError):
    """A KV reservation cannot be made (no pages / no sequence slot) or is used wrongly (unknown key, size)."""


class DisaggregatedPages:
    """Held pages (prefill side) and late reservations (decode side) over the scheduler's ranks."""

    def __init__(self, ranks: list[RankPages], config):
        self.ranks = ranks
        self.config = config
        self._hold: set[Hashable] = set()                      # seq ids whose pages are held when they finish
        self._held: dict[Hashable, Sequence] = {}              # finished, pages held until release_held
        self._reservations: dict[Hashable, tuple[int, list[int]]] = {}   # key -> (rank, pages)

    # -- held pages (prefill side) ------------------------------------------------------------------------
    def hold(self, seq_id: Hashable) -> None:
        """Keep the pages of ``seq_id`` when it finishes."""
        self._hold.add(seq_id)

    def take_hold(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` keeps its pages as it finishes; the flag is used up."""
        hold = seq_id in self._hold
        self._hold.discard(seq_id)
        return hold

    def keep(self, seq: Sequence) -> None:
        """``seq`` finished and left the running list; its pages (and cache lock) stay until release_held."""
        self._held[seq.seq_id] = seq

    def held(self, seq_id: Hashable) -> Sequence | None:
        """A finished sequence whose pages are held (``add(..., hold_pages=True)``), or None."""
        return self._held.get(seq_id)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def held_on(self, rank: int) -> list[Sequence]:
        return [s for s in self._held.values() if s.dp_rank == rank]

    def release_held(self, seq_id: Hashable) -> bool:
        """Free the pages of a held sequence; False if ``seq_id`` holds none."""
        self._hold.discard(seq_id)
        seq = self._held.pop(seq_id, None)
        if seq is None:
            return False
        self.ranks[seq.dp_rank].release(seq)
        return True

    # -- late reservations (decode side) ------------------------------------------------------------------
    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    def reserved_on(self, rank: int) -> list[list[int]]:
        return [pages for r, pages in self._reservations.values() if r == rank]

    def reserve(self, key: Hashable, num_pages: int, num_running: int) -> list[int]:
        """Take ``num_pages`` pages (and one sequence slot, next to ``num_running`` running sequences) for KV that
        will be written from elsewhere."""
        cfg = self.config
        if not is_int(num_pages) or num_pages < 1:
            raise KVReservationError(f"reservation {key!r}: num_pages must be an int >= 1, got {num_pages!r}")
        if key in self._reservations:
            raise KVReservationError(f"reservation {key!r} already exists")
        if num_pages > cfg.usable_pages:
            raise KVReservationError(f"reservation {key!r}: {num_pages} pages wanted but a dp rank has only "
                                     f"{cfg.usable_pages}")
        if num_running + len(self._reservations) >= cfg.max_num_seqs:
            raise KVReservationError(f"reservation {key!r}: all {cfg.max_num_seqs} sequence slots are taken "
                                     f"({num_running} running, {len(self._reservations)} reserved)")
        r = roomiest(self.ranks)
        if r.headroom < num_pages:
            raise KVReservationError(f"reservation {key!r}: {num_pages} KV pages wanted, only {max(0, r.headroom)} "
                                     f"obtainable (free + evictable, less reservations)")
        pages = r.take(num_pages)
        self._reservations[key] = (r.idx, pages)
        return list(pages)

    def reservation(self, key: Hashable) -> tuple[int, list[int]] | None:
        """(dp rank, page ids) of an open reservation, or None."""
        res = self._reservations.get(key)
        return None if res is None else (res[0], list(res[1]))

    def release_reservation(self, key: Hashable) -> bool:
        """Give back the pages of a reservation that will not be used; False if there is none."""
        res = self._reservations.pop(key, None)
        if res is None:
            return False
        self.ranks[res[0]].allocator.decref_all(res[1])
        return True

    def claim(self, key: Hashable, seq: Sequence, first_token: int) -> tuple[RankPages, list[int], int]:
        """Hand reservation ``key``, which holds the whole prompt KV of ``seq``, over to it: returns its rank, its
        pages and how many more pages to reserve for the output (``preemption="never"``). The reservation is
        closed; the pages are the caller's from here on."""
        if not is_int(first_token) or first_token < 0:
            raise ValueError(f"request {seq.seq_id!r}: first_token must be a non-negative int, got {first_token!r}")
        res = self._reservations.get(key)
        if res is None:
            raise KVReservationError(f"no reservation {key!r} for request {seq.seq_id!r} (released or never made)")
        rank, pages = res
        g = self.config.page_size
        need = cdiv(seq.num_prompt_tokens, g)
        if len(pages) != need:
            raise KVReservationError(f"reservation {key!r} has {len(pages)} pages; the {seq.num_prompt_tokens}-token "
                                     f"prompt of {seq.seq_id!r} fills {need}")
        r = self.ranks[rank]
        extra = 0
        if self.config.preemption == "never":
            extra = max(0, cdiv(seq.max_kv_tokens, g) - need)
            if extra > r.headroom:
                raise KVReservationError(f"request {seq.seq_id!r}: {extra} more pages needed for its output, only "
                                         f"{max(0, r.headroom)} obtainable")
        del self._reservations[key]
        return r, pages, extra
