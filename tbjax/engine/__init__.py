"""Engine: paged KV bookkeeping (allocator, prefix cache), request state and the continuous-batching scheduler."""

from .page_allocator import NULL_PAGE, OutOfPages, PageAllocator, PageRefError
from .prefix_cache import CacheNode, PrefixCache, PrefixMatch
from .request import FinishReason, Sequence, SequenceStatus, StepOutput
from .scheduler import RequestTooLarge, ScheduledBatch, ScheduledEntry, Scheduler, SchedulerConfig

__all__ = [
    "NULL_PAGE", "OutOfPages", "PageAllocator", "PageRefError",
    "CacheNode", "PrefixCache", "PrefixMatch",
    "FinishReason", "Sequence", "SequenceStatus", "StepOutput",
    "RequestTooLarge", "ScheduledBatch", "ScheduledEntry", "Scheduler", "SchedulerConfig",
]

from .engine import Engine, EngineConfig, RequestOutput  # noqa: E402

__all__ += ["Engine", "EngineConfig", "RequestOutput"]
