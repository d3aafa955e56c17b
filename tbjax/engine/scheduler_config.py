"""The scheduler's settings (``SchedulerConfig``): what can be set and which values are refused, checked when the
config is made so that the scheduler and its collaborators (placement, disaggregation, drafts) can trust them."""
from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels.utils import is_int

__all__ = ["SchedulerConfig", "PREEMPTION_MODES"]

PREEMPTION_MODES = ("recompute", "never")


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
            if not is_int(v) or v < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= 1, got {v!r}")
        for name in ("max_prefill_chunk", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise ValueError(f"SchedulerConfig.{name} must be None or an int >= 1, got {v!r}")
        if not is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 0:
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
