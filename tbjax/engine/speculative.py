"""Speculative decoding with a sliding-window draft whose KV per sequence is a fixed ring of pages.

Why: a decode step reads every weight once for one token per sequence; a draft that proposes k tokens lets one
target step (k + 1 query rows per sequence, the ragged step the runner already has) emit up to k + 1 tokens. The
draft's attention is a sliding window (``window`` tokens, 128 by default), so its KV per sequence never grows with
the context: it lives in a ring of ``ring_pages`` pages (logical page j of the draft's sequence sits in ring slot
j % R), in a page pool of its own (``max_num_seqs`` rings per dp rank), separate from the target's budget.

The draft is the target's own weights run with the window ("self", the default model's draft: no second copy of
the weights, ``ModelRunner(shared_params=...)``) or a separate small model with the same vocabulary. It runs
through the same runner machinery as the target (one shard_map step program per token bucket, on the target's
mesh), with its own step programs: its spec differs only in the window (``draft_spec``).

One engine step with speculation (``Engine.step`` -> ``SpeculativeDecoder``):
1. the scheduler gives every decode 1 + num_draft tokens of budget and pages (num_draft <= k, fewer near
   max_tokens / the context limit or when the budget is short);
2. the draft catches up on the tokens it has not seen (1 or 2 after a round: the correction or the last draft and
   the bonus token) and proposes d_1; then k - 1 one-token steps, each taking the previous proposal on the device
   (the runner's ``src_T``), propose d_2..d_k. Each step stores the distribution q it drew from (the sampling
   transforms applied) in a device buffer [R * max_num_seqs * k, V];
3. the target runs [last token, d_1..d_k] and samples every row: row i accepts d_{i+1} with probability
   min(1, p/q) (greedy: iff it is the argmax), else draws from max(0, p - q) / Z (``tbjax.sampling.verify_draft``);
   the last row samples freely (the bonus). The emitted run is the accepted drafts and the first non-accepted row's
   token: exactly the target's distribution.
4. the scheduler appends the run token by token (eos, stop tokens, max_tokens end it early), counts only the
   accepted positions' KV as computed and frees pages past them; the engine applies stop strings token by token.

Why the draft's prefill is only the last ``window`` tokens (a new sequence, one readmitted after preemption, one
whose KV came from a prefill worker, one that fell behind): the draft is only a proposer (acceptance keeps the
target's distribution whatever it proposes), and its KV must fit its ring: it runs the context's last
min(window, n) tokens at draft positions 0.. (the draft's positions are shifted by ``off``; RoPE only sees
differences, so the shift changes nothing but rounding). Its cost and memory are then constant in the context.

Ring size: a step writes KV before it attends, and rejected drafts leave writes ahead of the rolled-back length,
so the ring holds the window plus how far writes can run ahead of the earliest row that still reads the window
(``ahead`` = max(1, k - 2) positions: the rejected tail k - 2, or a two-token catch-up): R = ceil((window + ahead -
1) / page_size) + 1 pages, which is ceil(window / page_size) + 1 for k <= 3 and a window that is a multiple of the
page size. Catch-ups longer than ahead + 1 tokens rebuild the ring instead.

Randomness: the target's acceptance uniform and residual draw use the request's seed folded with the position
(other streams than plain sampling's); the draft samples with a seed derived from the request's (independent of
the target's), also at the target position of the token, so a seeded request is reproducible and each position's
noise is fresh for the decision it enters.

Not supported (refused with a clear error): overlapped scheduling (the draft's proposals are needed before the
target step is built), MLA drafts (the latent attention path takes no window), drafts with another vocabulary.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Hashable

import jax
import numpy as np

from pallas_kernels.utils import is_int
from tbjax.engine.kv_cache import KVCacheConfig
from tbjax.engine.page_allocator import PageAllocator
from tbjax.engine.request import SequenceStatus
from tbjax.model.quant import params_dtype
from tbjax.spec import ModelSpec

log = logging.getLogger(__name__)

MAX_SPEC_TOKENS = 16
_KEYS = ("draft", "num_tokens", "window")


class SpeculativeConfigError(ValueError):
    """A speculative-decoding setting is wrong; the message names it."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """``draft``: "self" (the target's weights with the sliding window), a model path the loaders read (same
    tokenizer and vocabulary), or an in-memory ``(spec, params)`` / ``(spec, params, tokenizer)``;
    ``num_tokens``: drafted tokens per step (k); ``window``: the draft's attention window in tokens."""
    draft: object = "self"
    num_tokens: int = 4
    window: int = 128

    def __post_init__(self):
        d = self.draft
        if not (d == "self" or (isinstance(d, str) and d) or (isinstance(d, tuple) and len(d) in (2, 3))):
            raise SpeculativeConfigError(f"speculative draft must be 'self', a model path or (spec, params), "
                                         f"got {d!r}")
        for name, hi in (("num_tokens", MAX_SPEC_TOKENS), ("window", 1 << 20)):
            v = getattr(self, name)
            if not is_int(v) or not 1 <= v <= hi:
                raise SpeculativeConfigError(f"speculative {name} must be an int in 1..{hi}, got {v!r}")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """None / False / "" / "off" -> None (off); a SpeculativeConfig; a dict with the keys draft, num_tokens,
        window; a JSON object string; or "draft=self,num_tokens=4,window=128" (any subset of the keys)."""
        if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("", "off")):
            return None
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as e:
                    raise SpeculativeConfigError(f"speculative settings are not valid JSON: {e}") from None
            else:
                value = {}
                for part in filter(None, (p.strip() for p in text.split(","))):
                    k, eq, v = part.partition("=")
                    if not eq:
                        raise SpeculativeConfigError(f"speculative setting {part!r} is not key=value "
                                                     f"(keys: {', '.join(_KEYS)})")
                    k = k.strip()
                    if k in ("num_tokens", "window"):
                        try:
                            v = int(v)
                        except ValueError:
                            raise SpeculativeConfigError(f"speculative {k} must be an int, got {v!r}") from None
                    value[k] = v.strip() if isinstance(v, str) else v
        if not isinstance(value, dict):
            raise SpeculativeConfigError(f"speculative settings must be a dict, a string or a SpeculativeConfig, "
                                         f"got {type(value).__name__}")
        bad = sorted(set(value) - set(_KEYS))
        if bad:
            raise SpeculativeConfigError(f"unknown speculative setting(s) {bad}; the keys are {list(_KEYS)}")
        return cls(**value)

    def ring_pages(self, page_size: int) -> int:
        return ring_pages(self.window, page_size, self.num_tokens)


def ahead_positions(num_tokens: int) -> int:
    """How far the draft's KV writes can run ahead of the earliest row that still reads the window."""
    return max(1, num_tokens - 2)


def ring_pages(window: int, page_size: int, num_tokens: int) -> int:
    """Pages of one sequence's draft KV ring (see the module docstring)."""
    return -(-(window + ahead_positions(num_tokens) - 1) // page_size) + 1


def draft_spec(spec: ModelSpec, window: int) -> ModelSpec:
    """``spec`` with every layer attending over a sliding window of ``window`` tokens."""
    if spec.mla is not None:
        raise NotImplementedError(f"speculative decoding with an MLA draft ({spec.arch}) is not supported: the latent "
                                  "attention path takes no sliding window")
    return dataclasses.replace(spec, sliding_window=int(window), sliding_window_layers=tuple(range(spec.n_layers)))


def draft_seed(seed: int) -> int:
    """The draft's sampling seed for a request seed: another PRNG stream than the target's."""
    return (int(seed) * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF


def _vocab_of(tok):
    for attr in ("tk", "_tk", "tokenizer"):
        inner = getattr(tok, attr, None)
        if inner is not None and hasattr(inner, "get_vocab"):
            return inner.get_vocab(with_added_tokens=True)
    return None


def resolve_draft(cfg: SpeculativeConfig, spec: ModelSpec, tokenizer, dtype: str | None):
    """(draft spec with the window, params or None for "self"). A separate draft must share the target's vocabulary
    (size and, when both tokenizers are known, the token -> id table)."""
    if cfg.draft == "self":
        return draft_spec(spec, cfg.window), None
    d_tok = None
    if isinstance(cfg.draft, tuple):
        d_spec, d_params = cfg.draft[0], cfg.draft[1]
        d_tok = cfg.draft[2] if len(cfg.draft) == 3 else None
    else:
        from tbjax.weights import load_model
        try:
            d_spec, d_params, d_tok = load_model(cfg.draft, dtype=dtype, progress=False)
        except (OSError, ValueError) as e:
            raise SpeculativeConfigError(f"speculative draft {cfg.draft!r} cannot be loaded: {e}") from e
    if d_spec.vocab_size != spec.vocab_size:
        raise SpeculativeConfigError(f"the draft's vocabulary ({d_spec.vocab_size} tokens) differs from the target's "
                                     f"({spec.vocab_size}): a draft must use the same tokenizer")
    if d_tok is not None and tokenizer is not None:
        a, b = _vocab_of(d_tok), _vocab_of(tokenizer)
        if a is not None and b is not None and a != b:
            diff = sorted(set(a.items()) ^ set(b.items()))[:3]
            raise SpeculativeConfigError(f"the draft's tokenizer differs from the target's (e.g. {diff}): a draft "
                                         "must use the same tokenizer")
    return draft_spec(d_spec, cfg.window), d_params


@dataclasses.dataclass
class _DraftState:
    """One sequence's draft KV: its ring pages (rank-local ids), and which target positions it holds: [off, end)
    at draft positions [0, end - off) (only the last ``window`` of them are read)."""
    rank: int
    preemptions: int
    pages: list
    off: int = 0
    end: int = 0


@dataclasses.dataclass
class _Proposal:
    drafts: list                           # d_1..d_nd
    q_rows: list                           # the draft-buffer row of each
    n_known: int                           # tokens of the sequence when drafted (n)


def accepted_prefix(accepted_rows) -> int:
    """How many drafts a verify entry keeps: its leading accepted rows (acceptance stops at the first rejection)."""
    return int(np.argmin(np.append(np.asarray(accepted_rows), 0)))


class SpeculativeDecoder:
    """The draft side of speculative decoding for one engine: the draft runner, its ring pools and allocators,
    per-sequence draft state, the draft-distribution buffer, and the proposal rounds. The engine builds the
    verify step from ``propose`` and reports its outcome with ``commit``."""

    def __init__(self, cfg: SpeculativeConfig, engine):
        from tbjax.engine.runner import ModelRunner
        self.cfg = cfg
        self.k = cfg.num_tokens
        ec = engine.config
        target = engine.runner
        self.page_size = G = ec.page_size
        self.spec, params = resolve_draft(cfg, engine.spec, engine.tokenizer, params_dtype(engine.params))
        self.self_draft = params is None
        self.ring = cfg.ring_pages(G)
        self.max_append = ahead_positions(self.k) + 1
        self.runner = ModelRunner(
            self.spec, params, mesh=target.mesh, layout=target.layout, page_size=G,
            max_num_seqs=ec.max_num_seqs, max_num_batched_tokens=ec.max_num_batched_tokens,
            max_pages_per_seq=target.max_pages, attn_impl=ec.attn_impl, matmul_impl=ec.matmul_impl,
            layer_buffers=ec.layer_buffers if params is not None else target.layer_buffers,
            fold_norms=ec.fold_norms and params is not None, spec_role="draft", spec_tokens=self.k,
            deterministic=ec.deterministic,
            shared_params=target.params if params is None else None)
        self.num_ranks = self.runner.num_ranks
        self.pages_per_rank = ec.max_num_seqs * self.ring + 1          # + the null page
        self.kv_config = KVCacheConfig(num_pages=self.pages_per_rank, page_size=G, dtype=ec.kv_dtype)
        self.runner.init_caches(self.kv_config)
        self.allocators = [PageAllocator(self.pages_per_rank, G) for _ in range(self.num_ranks)]
        self.qbuf = self.runner.new_qbuf()
        self.cap = self.runner.buckets[-1]                              # draft tokens per rank and step
        self.states: dict[Hashable, _DraftState] = {}
        self._pending: dict[Hashable, _Proposal] = {}
        self.num_draft_tokens = 0          # proposed (and verified)
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0          # target steps that verified at least one draft
        self.num_emitted_tokens = 0        # tokens those steps' verify entries emitted
        self.num_verify_entries = 0        # (sequence, step) pairs that verified drafts
        self.num_draft_steps = 0
        self.num_rebuilds = 0

    # ---- pages ------------------------------------------------------------------------------------------
    def release(self, seq_id: Hashable) -> None:
        st = self.states.pop(seq_id, None)
        if st is not None:
            self.allocators[st.rank].decref_all(st.pages)

    def gc(self, scheduler) -> None:
        """Free the rings of sequences that are no longer running (finished, aborted, preempted)."""
        for sid in list(self.states):
            seq = scheduler.get(sid)
            st = self.states[sid]
            if seq is None or seq.status is not SequenceStatus.RUNNING or seq.dp_rank != st.rank or \
                    seq.num_preemptions != st.preemptions:
                self.release(sid)

    def _table(self, st: _DraftState, upto: int) -> list[int]:
        return [st.pages[j % self.ring] for j in range(-(-upto // self.page_size))]

    # ---- one round ----------------------------------------------------------------------------------------
    def propose(self, batch, reqs, scheduler) -> dict[Hashable, _Proposal]:
        """Run the draft for every decode entry of ``batch`` that has drafted tokens; returns seq id -> proposal
        (possibly fewer drafts than the entry has room for; none when its catch-up did not fit the draft step)."""
        self.gc(scheduler)
        self._pending = {}
        todo = [e for e in batch.entries if e.is_decode and e.num_draft > 0 and e.seq_id in reqs]
        if not todo:
            return {}
        R = self.num_ranks
        used, slot = [0] * R, [0] * R
        first, plan = [], []         # step-1 entries; per entry (seq, n, nd, draft start of step 2, state, q slot)
        smp_of = {}
        for e in todo:
            seq, r = e.seq, e.dp_rank
            n = e.start + 1
            st = self.states.get(e.seq_id)
            gap = n - st.end if st is not None else 0
            if st is not None and 1 <= gap <= self.max_append:
                ids, dstart, fresh = seq.token_ids[st.end:n], st.end - st.off, False
            else:
                c = min(self.cfg.window, n, self.cap)
                ids, dstart, fresh = seq.token_ids[n - c:n], 0, True
            if used[r] + len(ids) > self.cap:
                continue                               # no room in this draft step: a plain decode this time
            if st is None:
                pages = self.allocators[r].allocate(self.ring)
                st = self.states[e.seq_id] = _DraftState(r, seq.num_preemptions, pages)
            if fresh:
                st.off, st.end = n - len(ids), n - len(ids)
                self.num_rebuilds += 1
            used[r] += len(ids)
            p = reqs[e.seq_id].params
            smp = (p.temperature, p.top_k, p.top_p, p.min_p, draft_seed(reqs[e.seq_id].seed))
            smp_of[e.seq_id] = smp
            q0 = slot[r] * self.k
            slot[r] += 1
            nd = e.num_draft
            span = dstart + len(ids) + nd - 1                  # draft positions this round writes
            first.append(((r, ids, dstart, self._table(st, span)), smp, n, q0))
            plan.append((e, seq, n, nd, dstart + len(ids), st, q0))
            st.end = n
        if not first:
            return {}
        outs, rows = [], []
        inp = self.runner.build_inputs([f[0] for f in first], [f[1] for f in first],
                                       sample_pos=[f[2] for f in first], q_dst=[f[3] for f in first])
        out = self.runner.launch(inp, qbuf=self.qbuf)
        self.qbuf = out["qbuf"]
        outs.append(out)
        rows.append({pl[0].seq_id: (inp.rows[i], inp.local_rows[i]) for i, pl in enumerate(plan)})
        for j in range(1, max(pl[3] for pl in plan)):
            ents, smp, pos, dst, prev_rows, sids = [], [], [], [], [], []
            for e, seq, n, nd, d1, st, q0 in plan:
                if nd <= j:
                    continue
                ents.append((e.dp_rank, [0], d1 + j - 1, self._table(st, d1 + nd - 1)))
                smp.append(smp_of[e.seq_id])
                pos.append(n + j)
                dst.append(q0 + j)
                prev_rows.append(rows[-1][e.seq_id][1])
                sids.append(e.seq_id)
            inp = self.runner.build_inputs(ents, smp, prev_rows, sample_pos=pos, q_dst=dst)
            out = self.runner.launch(inp, prev=outs[-1], qbuf=self.qbuf)
            self.qbuf = out["qbuf"]
            outs.append(out)
            rows.append({sid: (inp.rows[i], inp.local_rows[i]) for i, sid in enumerate(sids)})
        self.num_draft_steps += len(outs)
        toks = jax.device_get([o["tokens"] for o in outs])
        props = {}
        for e, seq, n, nd, d1, st, q0 in plan:
            drafts = [int(np.asarray(toks[j])[rows[j][e.seq_id][0]]) for j in range(nd)]
            props[e.seq_id] = _Proposal(drafts, [q0 + j for j in range(nd)], n)
        self._pending = dict(props)
        return props

    def commit(self, seq_id: Hashable, accepted: int) -> None:
        """The target accepted ``accepted`` of the proposal's drafts: the draft's valid KV ends after the last
        accepted draft it has computed (its last proposal is never computed by the draft)."""
        prop = self._pending.pop(seq_id, None)
        st = self.states.get(seq_id)
        if prop is None or st is None:
            return
        nd = len(prop.drafts)
        st.end = prop.n_known + min(accepted, nd - 1)
        self.num_draft_tokens += nd
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += accepted + 1
        self.num_verify_entries += 1

    # ---- bookkeeping --------------------------------------------------------------------------------------
    def stats(self) -> dict:
        used = sum(a.num_used for a in self.allocators)
        return {"spec_draft_tokens": self.num_draft_tokens, "spec_accepted_tokens": self.num_accepted_tokens,
                "spec_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
                if self.num_draft_tokens else 0.0,
                "spec_verify_steps": self.num_verify_steps, "spec_emitted_tokens": self.num_emitted_tokens,
                "spec_verify_entries": self.num_verify_entries,
                # tokens one sequence gains per verify step (1 + accepted drafts): the speed-up's upper bound
                "spec_tokens_per_step": self.num_emitted_tokens / self.num_verify_entries
                if self.num_verify_entries else 0.0,
                "spec_draft_steps": self.num_draft_steps, "spec_draft_rebuilds": self.num_rebuilds,
                "spec_draft_pages_used": used, "spec_draft_pages_total": sum(a.num_usable for a in self.allocators),
                "spec_ring_pages": self.ring}

    def check(self) -> None:
        """Every live draft state holds exactly one ring; allocator counts match (tests)."""
        for a in self.allocators:
            a.check()
        for sid, st in self.states.items():
            assert len(st.pages) == self.ring, (sid, len(st.pages))
        for r, a in enumerate(self.allocators):
            assert a.num_used == self.ring * sum(st.rank == r for st in self.states.values())


__all__ = ["SpeculativeConfig", "SpeculativeConfigError", "SpeculativeDecoder", "draft_spec", "ring_pages",
           "resolve_draft", "MAX_SPEC_TOKENS"]
