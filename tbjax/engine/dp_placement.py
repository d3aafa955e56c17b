"""Which dp rank a sequence goes to. A new (or readmitted) request is planned on every rank (its cached prefix
there, the pages its first chunk needs) and placed on the one with the most headroom left after admission, a reused
cached prefix counting as saved pages, then the fewest running; a late KV reservation goes to the rank with the
most headroom. Kept apart from the scheduler so that the placement rule reads in one place."""
from __future__ import annotations

from dataclasses import dataclass

from .dp_ranks import RankPages, cdiv
from .prefix_cache import PrefixMatch
from .request import Sequence

__all__ = ["AdmissionPlan", "plan_on", "place", "roomiest"]


@dataclass
class AdmissionPlan:
    rank: RankPages
    match: PrefixMatch | None
    start: int
    num_tokens: int
    new_pages: int  # pages to take now (recompute) or reserve (never)
    unlocked: int  # cached pages on the match path that locking takes off the evictable count


def plan_on(seq: Sequence, r: RankPages, budget: int, chunk_size: int, reserve_worst_case: bool
            ) -> AdmissionPlan | None:
    """Admission of ``seq`` on rank ``r`` with ``budget`` tokens left in the step, or None if its pages don't fit.
    ``reserve_worst_case`` (``preemption="never"``): pages for all it can ever need, else for the first chunk."""
    g = r.page_size
    tokens = seq.token_ids
    match, unlocked = r.match(tokens)
    m = match.num_pages if match is not None else 0
    start = m * g
    n = min(len(tokens) - start, chunk_size, budget)
    if reserve_worst_case:
        new_pages = cdiv(seq.max_kv_tokens, g) - m
    else:
        new_pages = cdiv(start + n, g) - m
    if new_pages + unlocked > r.headroom:
        return None
    return AdmissionPlan(r, match, start, n, new_pages, unlocked)


def place(seq: Sequence, ranks: list[RankPages], budget: int, chunk_size: int, reserve_worst_case: bool
          ) -> AdmissionPlan | None:
    """The best rank's plan for ``seq``, or None if no rank can take it now."""
    best = None
    for r in ranks:
        plan = plan_on(seq, r, budget, chunk_size, reserve_worst_case)
        if plan is None:
            continue
        # most headroom left after admission, counting a reused cached prefix as saved pages (its pages are
        # resident already and now shared), then fewest running
        reused = plan.match.num_pages if plan.match is not None else 0
        key = (r.headroom - plan.new_pages - plan.unlocked + reused, -r.num_running, -r.idx)
        if best is None or key > best[0]:
            best = (key, plan)
    return None if best is None else best[1]


def roomiest(ranks: list[RankPages]) -> RankPages:
    """The rank with the most headroom, then the fewest running."""
    return max(ranks, key=lambda r: (r.headroom, -r.num_running, -r.idx))
