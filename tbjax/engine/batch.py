"""What one step computes: the scheduler's output (``ScheduledBatch`` of ``ScheduledEntry``), read by the engine to
build the step's inputs and handed back to ``Scheduler.on_step_done``."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Mapping

from .request import Sequence

__all__ = ["ScheduledEntry", "ScheduledBatch"]


@dataclass(frozen=True, eq=False)
class ScheduledEntry:
    """Compute ``seq.token_ids[start:start+num_tokens]`` (positions start..start+num_tokens-1) of ``seq``;
    ``samples``: the last of them yields a new token (decodes and final prefill chunks)."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool
    is_decode: bool
    from_prev: bool = False  # its one token is the sample of the batch in flight before it (unknown when built)
    # speculative decoding: a decode entry's tokens are its known last token + up to num_draft drafted ones (not in
    # seq.token_ids: the engine supplies them); num_tokens = 1 + num_draft, pages and budget cover them all
    num_draft: int = 0

    @property
    def seq_id(self) -> Hashable:
        return self.seq.seq_id

    @property
    def dp_rank(self) -> int:
        return self.seq.dp_rank

    @property
    def block_table(self) -> list[int]:
        return self.seq.block_table

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.start + self.num_tokens - self.num_draft]

    @property
    def end(self) -> int:
        """Context length after this step (positions computed so far + this chunk)."""
        return self.start + self.num_tokens


@dataclass(eq=False)
class ScheduledBatch:
    """One step's work: decode entries first, then prefill chunks."""

    step: int
    entries: list[ScheduledEntry]
    preempted: list[Hashable] = field(default_factory=list)  # seq ids preempted while building this batch

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)

    @property
    def num_seqs(self) -> int:
        return len(self.entries)

    @property
    def num_decodes(self) -> int:
        return sum(e.is_decode for e in self.entries)

    @property
    def decode_entries(self) -> list[ScheduledEntry]:
        return [e for e in self.entries if e.is_decode]

    @property
    def prefill_entries(self) -> list[ScheduledEntry]:
        return [e for e in self.entries if not e.is_decode]

    @property
    def max_num_pages(self) -> int:
        return max((len(e.seq.block_table) for e in self.entries), default=0)

    def by_rank(self, dp: int) -> list[list[ScheduledEntry]]:
        out = [[] for _ in range(dp)]
        for e in self.entries:
            out[e.seq.dp_rank].append(e)
        return out

    def sampled_tokens(self, sampled: Mapping[Hashable, object], live: Mapping[Hashable, ScheduledEntry]
                       ) -> dict[Hashable, list[int]]:
        """Check the tokens a finished step sampled (seq id -> token, or for an entry with drafts a list of 1 ..
        1 + num_draft tokens) against this batch; returns seq id -> tokens for the ``live`` entries (those still
        running: tokens for the others are dropped). Raises ValueError on a token for an entry that does not
        sample, a missing one, or one that is not a non-negative int."""
        in_batch = {e.seq_id for e in self.entries}
        tokens = {}
        for sid, tok in sampled.items():
            if sid not in in_batch:
                raise ValueError(f"sampled token for {sid!r}, which is not in step {self.step}")
            e = live.get(sid)
            if e is None:
                continue  # aborted / finished since schedule(): its token is dropped
            if not e.samples:
                raise ValueError(f"sampled token for {sid!r}, whose entry in step {self.step} is an "
                                 "intermediate prefill chunk (it does not sample)")
            run = list(tok) if isinstance(tok, (list, tuple)) else [tok]
            if not 1 <= len(run) <= 1 + e.num_draft:
                raise ValueError(f"{len(run)} tokens for {sid!r}, whose entry in step {self.step} yields "
                                 f"1..{1 + e.num_draft}")
            tokens[sid] = [_token(sid, x) for x in run]
        for sid, e in live.items():
            if e.samples and sid not in tokens:
                raise ValueError(f"no sampled token for {sid!r}, whose entry in step {self.step} samples")
        return tokens

    def __iter__(self) -> Iterator[ScheduledEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def _token(sid: Hashable, x) -> int:
    try:
        t = operator.index(x)
    except TypeError:
        t = -1
    if isinstance(x, bool) or t < 0:
        raise ValueError(f"sampled token for {sid!r} must be a non-negative int, got {x!r}")
    return t
