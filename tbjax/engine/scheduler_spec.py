"""The scheduler's side of speculative decoding (``DraftBudget``; the drafting itself is
tbjax/engine/speculative.py). A decode entry may also cover up to ``k`` drafted tokens, paid for out of the budget
that neither the other decodes (one token each) nor this step's prefill chunks want, so drafts never delay a prompt.
When the step is done, only the accepted drafts' KV counts as computed: the entry's tokens are the accepted drafts
and the token sampled after them, and the pages past them are given back."""
from __future__ import annotations

from .batch import ScheduledEntry
from .dp_ranks import RankPages
from .request import Sequence, SequenceStatus

__all__ = ["DraftBudget"]


class DraftBudget:
    """How many drafted tokens each decode of a step gets; off (always 0) when ``k == 0``."""

    def __init__(self, k: int, chunk_size: int, max_model_len: int | None):
        self.k = k
        self.chunk_size = chunk_size
        self.max_model_len = max_model_len

    def spare(self, budget: int, decodes: list[Sequence], running: list[Sequence],
              head: Sequence | None) -> int:
        """Tokens left for drafts: ``budget`` less one token per decode, less the chunks the running prefills
        and the queue's ``head`` (None when it cannot be admitted this step) want."""
        spare = budget - len(decodes)
        if not self.k:
            return spare
        for s in running:
            left = s.num_tokens_after_inflight - s.num_scheduled_tokens
            if s.status is SequenceStatus.RUNNING and left > 1:
                spare -= min(left, self.chunk_size)
        if head is not None:
            spare -= min(head.num_tokens, self.chunk_size)
        return spare

    def num_draft(self, seq: Sequence, spare: int) -> int:
        """Drafted tokens for decode ``seq`` given ``spare`` budget: at most ``k``, and none past its max_tokens or
        the model's context."""
        if not self.k:
            return 0
        nd = min(self.k, max(spare, 0), seq.max_tokens - seq.num_output_tokens - 1)
        if self.max_model_len is not None:
            nd = min(nd, self.max_model_len - seq.num_tokens - 1)
        return max(nd, 0)

    @staticmethod
    def settle(e: ScheduledEntry, tokens: list[int] | None, rank: RankPages, to_reservation: bool
               ) -> tuple[int, list[int]]:
        """Settle a finished entry of ``e.seq`` (on ``rank``) that sampled ``tokens``: returns the context length
        its KV now really covers (only accepted drafts count; the pages past it are given back, ``to_reservation``
        under ``preemption="never"``) and the tokens known up to there (``token_ids`` plus the accepted drafts,
        which are not appended yet)."""
        if not e.num_draft or tokens is None:
            return e.end, e.seq.token_ids
        end = e.start + len(tokens)
        rank.trim(e.seq, end, to_reservation)
        return end, e.seq.token_ids + tokens[:-1]
