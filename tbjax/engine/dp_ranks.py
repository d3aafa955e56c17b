"""One dp rank's pages as the scheduler sees them (``RankPages``): its allocator, its prefix cache, the pages
reserved for worst cases, its load, and every change to the pages a sequence holds there (its block table, its lock
in the prefix cache, its reservation). The scheduler decides *when* a sequence gains or loses pages; this module
keeps the allocator, the cache and the sequence agreeing while it does."""
from __future__ import annotations

import collections
from typing import Iterable

from .page_allocator import PageAllocator
from .prefix_cache import PrefixCache, PrefixMatch
from .request import Sequence

__all__ = ["RankPages", "cdiv"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RankPages:
    """Pages of one dp rank: allocator, prefix cache, worst-case reservations ("never" mode)."""

    def __init__(self, idx: int, cfg):
        self.idx = idx
        self.page_size = cfg.page_size
        self.allocator = PageAllocator(cfg.num_pages, cfg.page_size, reserve_null_page=cfg.reserve_null_page)
        self.cache = PrefixCache(self.allocator) if cfg.enable_prefix_caching else None
        self.reserved = 0
        self.num_running = 0

    @property
    def evictable(self) -> int:
        return self.cache.num_evictable if self.cache is not None else 0

    @property
    def headroom(self) -> int:
        """Pages obtainable now (free + evictable) that no reservation has claimed."""
        return self.allocator.num_free + self.evictable - self.reserved

    # -- pages ------------------------------------------------------------------------------------------
    def take(self, n: int) -> list[int]:
        """``n`` fresh pages, evicting unlocked cached pages first when the free list is short."""
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.allocator.allocate(n)  # raises OutOfPages on a bookkeeping bug

    def reserve_for(self, seq: Sequence, n: int) -> None:
        """Set ``n`` pages aside for ``seq``'s later tokens."""
        seq.reserve_pages(n)
        self.reserved += n

    def coverable(self, seq: Sequence) -> int:
        """How many more tokens (past those computed or in flight) ``seq`` can get pages for right now."""
        pages = len(seq.block_table) + seq.reserved_pages + max(0, self.headroom)
        return pages * self.page_size - seq.num_scheduled_tokens

    def grow(self, seq: Sequence, upto_tokens: int) -> None:
        """Extend ``seq.block_table`` to cover ``upto_tokens`` tokens (the caller checked that it fits), using its
        reservation first."""
        need = cdiv(upto_tokens, self.page_size) - len(seq.block_table)
        if need <= 0:
            return
        self.reserved -= seq.take_reserved(need)
        seq.block_table.extend(self.take(need))

    def trim(self, seq: Sequence, num_tokens: int, to_reservation: bool) -> None:
        """Free the pages of ``seq`` past those ``num_tokens`` positions fill; ``to_reservation``: they go back to
        its reservation (``preemption="never"``)."""
        keep = cdiv(num_tokens, self.page_size)
        extra = seq.block_table[keep:]
        if not extra:
            return
        del seq.block_table[keep:]
        self.allocator.decref_all(extra)
        if to_reservation:
            self.reserve_for(seq, len(extra))

    def release(self, seq: Sequence) -> None:
        """Drop everything ``seq`` holds here: its cache lock, its page references, its reservation."""
        node = seq.clear_cache_node()
        if node is not None:
            self.cache.unlock(node)
        self.allocator.decref_all(seq.block_table)
        seq.block_table = []
        self.reserved -= seq.drop_reserved()

    # -- prefix cache -----------------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> tuple[PrefixMatch | None, int]:
        """The cached prefix ``tokens`` can reuse (at least one token is always left to compute) and how many of
        its pages are unlocked now (locking takes them off the evictable count); (None, 0) without a cache."""
        if self.cache is None:
            return None, 0
        match = self.cache.match(tokens, max_pages=(len(tokens) - 1) // self.page_size)
        return match, self.cache.num_unlocked_on_path(match.node)

    def share_prefix(self, seq: Sequence, match: PrefixMatch) -> None:
        """Give ``seq`` (no pages yet) the matched cached pages as the start of its block table and lock them."""
        for p in match.pages:
            self.allocator.incref(p)
        seq.block_table = list(match.pages)
        if match.pages:
            self.cache.lock(match.node)
            seq.set_cache_node(match.node)
        self.cache.record_query(seq.num_tokens, match.num_pages * self.page_size)

    def cache_computed(self, seq: Sequence, known_tokens: list[int], num_computed: int) -> None:
        """Insert ``seq``'s full computed pages (``known_tokens[:num_computed]``) into the prefix cache and move its
        lock down to the deepest node."""
        if self.cache is None:
            return
        node = seq.cache_node or self.cache.root
        if num_computed // self.page_size <= node.depth:
            return
        new = self.cache.insert(node, known_tokens[:num_computed], seq.block_table)
        if new is node:
            return
        if node is self.cache.root:
            self.cache.lock(new)
        else:
            self.cache.move_lock(node, new)
        seq.set_cache_node(new)

    # -- counters and checks ----------------------------------------------------------------------------
    def stats(self) -> dict:
        a = self.allocator
        d = {
            "pages_total": a.num_usable,
            "pages_free": a.num_free,
            "pages_used": a.num_used,
            "pages_reserved": self.reserved,
            "capacity_tokens": a.capacity_tokens,
            "used_tokens": a.used_tokens,
            "num_running": self.num_running,
        }
        if self.cache is not None:
            d["prefix_cache"] = self.cache.stats()
        return d

    def check(self, running: list[Sequence], held: list[Sequence], reservations: Iterable[list[int]],
              never: bool) -> None:
        """Every page's refcount equals its holders (the running and held sequences' block tables, the late
        reservations, the cache); locks sit on the sequences' cache paths; reservations add up."""
        a = self.allocator
        a.check()
        assert self.num_running == len(running)
        holders = collections.Counter()
        for s in held:
            holders.update(s.block_table)
        for pages in reservations:
            holders.update(pages)
        for s in running:
            assert len(s.block_table) >= cdiv(s.num_scheduled_tokens, self.page_size)
            assert a.null_page is None or a.null_page not in s.block_table
            holders.update(s.block_table)
            node = s.cache_node
            if node is not None:
                assert node.alive and node.lock_ref >= 1
                assert node.path_pages() == s.block_table[:node.depth]
        cached = set()
        if self.cache is not None:
            self.cache.check()
            cached = self.cache.cached_pages()
        for p in range(a.num_pages - a.num_usable, a.num_pages):
            want = holders[p] + (p in cached)
            assert a.refcount(p) == want, f"rank {self.idx} page {p}: refcount {a.refcount(p)} != holders {want}"
        assert self.reserved == sum(s.reserved_pages for s in running) + sum(s.reserved_pages for s in held)
        if never:
            assert self.headroom >= 0, f"rank {self.idx}: reservations exceed free + evictable pages"
