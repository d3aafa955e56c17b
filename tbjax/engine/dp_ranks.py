"""One dp rank's pages as the scheduler sees them (``RankPages``: allocator, prefix cache, reservations, load) and
an admission plan on a rank (``AdmissionPlan``). The scheduler places each new request on the rank with the most
headroom (a reused cached prefix counts as saved pages), then the fewest running."""
from __future__ import annotations

from dataclasses import dataclass

from .page_allocator import PageAllocator
from .prefix_cache import PrefixCache, PrefixMatch

__all__ = ["RankPages", "AdmissionPlan"]


class RankPages:
    """Pages of one dp rank: allocator, prefix cache, worst-case reservations ("never" mode)."""

    def __init__(self, idx: int, cfg):
        self.idx = idx
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


@dataclass
class AdmissionPlan:
    rank: RankPages
    match: PrefixMatch | None
    start: int
    num_tokens: int
    new_pages: int  # pages to take now (recompute) or reserve (never)
    unlocked: int  # cached pages on the match path that locking takes off the evictable count
