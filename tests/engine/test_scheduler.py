"""Scheduler end to end with a fake paged "model" (no JAX).

The fake model keeps a real page pool per dp rank (``pool[page, slot]``). Each step it writes every
scheduled token's (token, position) code into the slot its block table names, refusing to write into a
page that anyone else references (copy-on-write violation) or into the null page; when an entry samples,
it reads the whole context back through the block table, checks it against the sequence's tokens (so a
page freed too early, shared wrongly or overwritten is caught), and emits a deterministic hash of it.
Free pages are poisoned after every step. Outputs must equal each request generated alone by the same
hash, whatever the batching, chunking, prefix sharing, preemption policy, page size or dp.
"""

import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tbjax.engine import (FinishReason, RequestTooLarge, Scheduler, SchedulerConfig, Sequence,
                          SequenceStatus)
from tbjax.engine.scheduler import KVReservationError

VOCAB = 13
EOS = 0


def next_token(tokens) -> int:
    h = 17
    for i, t in enumerate(tokens):
        h = (h * 1000003 + t * 31 + i) % 2147483647
    return h % VOCAB


def reference(prompt, max_tokens, stop=(), eos=(), ignore_eos=False, min_tokens=0):
    """The request run alone: (output tokens, finish reason)."""
    toks = list(prompt)
    out = []
    while True:
        t = next_token(toks)
        toks.append(t)
        out.append(t)
        if len(out) >= min_tokens and (t in stop or (not ignore_eos and t in eos)):
            return out, FinishReason.STOP
        if len(out) >= max_tokens:
            return out, FinishReason.LENGTH


class FakeModel:
    def __init__(self, sched: Scheduler):
        cfg = sched.config
        self.sched = sched
        self.g = cfg.page_size
        self.pools = [np.full((cfg.num_pages, cfg.page_size), -1, np.int64) for _ in range(cfg.dp)]

    @staticmethod
    def code(tok, pos):
        return tok * 100003 + pos

    def run(self, batch, prev=None) -> dict:
        """Run ``batch`` as the device would, right when it is launched. ``prev``: the samples of the batch in
        flight before it (overlapped scheduling), where its ``from_prev`` entries take their token."""
        g = self.g

        def tokens(e):
            if e.from_prev:
                assert len(e.seq.token_ids) == e.start, "from_prev entry whose token is already known"
                return e.seq.token_ids + [prev[e.seq_id]]
            return e.seq.token_ids
        for e in batch.entries:
            alloc = self.sched.ranks[e.dp_rank].allocator
            pool = self.pools[e.dp_rank]
            assert len(e.block_table) * g >= e.end, "block table does not cover the scheduled tokens"
            toks = tokens(e)
            for pos in range(e.start, e.end):
                page = e.block_table[pos // g]
                assert page != alloc.null_page, "write into the null page"
                assert alloc.refcount(page) == 1, f"write into shared page {page} (refcount {alloc.refcount(page)})"
                pool[page, pos % g] = self.code(toks[pos], pos)
        sampled = {}
        for e in batch.entries:
            if not e.samples:
                continue
            pool = self.pools[e.dp_rank]
            bt = e.block_table
            ctx = [int(pool[bt[i // g], i % g]) for i in range(e.end)]
            want = [self.code(t, i) for i, t in enumerate(tokens(e)[:e.end])]
            assert ctx == want, f"KV of {e.seq_id!r} corrupted at positions " \
                                f"{[i for i in range(e.end) if ctx[i] != want[i]][:5]}"
            sampled[e.seq_id] = next_token([c // 100003 for c in ctx])
        return sampled

    def poison_free_pages(self):
        for r, pool in zip(self.sched.ranks, self.pools):
            free = r.allocator.free_pages()
            if free:
                pool[free] = -1


class TracingScheduler(Scheduler):
    """Checks that every preemption frees pages where they are short: a victim comes from a rank that has
    no headroom left (never from another dp rank)."""

    def _preempt(self, seq):
        assert self.ranks[seq.dp_rank].headroom == 0, "preempted a sequence on a rank that still had pages"
        super()._preempt(seq)


def run_engine(sched, requests, arrivals=None, aborts=None, max_steps=3000, overlap=False):
    """Drive the scheduler with the fake model, checking per-step invariants. requests: list of Sequence.
    arrivals[i]: step at which request i is added; aborts: {step: [seq ids]}. Returns {seq_id: Sequence}.
    ``overlap``: schedule step N+1 before step N is done (the engine's overlapped loop): the fake device runs each
    batch when it is launched, and ``on_step_done(N)`` comes after step N+1 was scheduled and run."""
    model = FakeModel(sched)
    cfg = sched.config
    arrivals = arrivals or [0] * len(requests)
    aborts = aborts or {}
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    done = {}
    streamed = {r.seq_id: [] for r in requests}
    first_admitted = []  # arrival order of first admissions: first come, first served
    step = 0
    inflight = None      # overlap: (batch, sampled) launched and not yet done

    def finish(batch, sampled):
        for out in sched.on_step_done(batch, sampled):
            streamed[out.seq_id] += out.new_token_ids
            if out.finished:
                seq = requests_by_id(requests)[out.seq_id]
                assert seq.status is SequenceStatus.FINISHED and not seq.block_table
                assert streamed[out.seq_id] == seq.output_token_ids
                done[out.seq_id] = seq

    while pending or sched.has_unfinished() or inflight:
        assert step < max_steps, "requests starved / livelock"
        while pending and arrivals[pending[0]] <= step:
            sched.add(requests[pending.pop(0)])
        for sid in aborts.get(step, []):
            seq = sched.get(sid)
            if seq is not None:
                rank = seq.dp_rank
                held = len(seq.block_table)
                free_before = sched.ranks[rank].allocator.num_free if rank is not None else None
                assert sched.abort(sid)
                assert seq.status is SequenceStatus.FINISHED and seq.finish_reason is FinishReason.ABORT
                assert not seq.block_table
                if rank is not None and not cfg.enable_prefix_caching:
                    assert sched.ranks[rank].allocator.num_free == free_before + held  # freed at once
                done[sid] = seq
        decoding_before = {s.seq_id for s in sched.running
                           if s.num_tokens_after_inflight - s.num_scheduled_tokens == 1 and not sched.inflight.ends(s)}
        batch = sched.schedule()
        step += 1
        if batch is None:
            if inflight is None:
                assert not sched.has_unfinished()
            else:   # overlapped schedule gave up (pages short / nothing to do before step N is back)
                finish(*inflight)
                inflight = None
                sched.check()
                model.poison_free_pages()
            continue
        # step invariants
        assert 0 < batch.num_tokens <= cfg.max_num_batched_tokens
        assert len(batch.entries) == len({e.seq_id for e in batch.entries}) <= cfg.max_num_seqs
        assert sched.num_running <= cfg.max_num_seqs
        ids = {e.seq_id for e in batch.entries}
        assert decoding_before - set(batch.preempted) <= ids, "a running decode was left out"
        kinds = [e.is_decode for e in batch.entries]
        assert kinds == sorted(kinds, reverse=True), "decodes must come first"
        for e in batch.entries:
            if e.seq.seq_id not in streamed or e.seq.arrival in first_admitted:
                pass
            elif e.seq.num_preemptions == 0 and e.start == e.seq.num_cached_tokens:
                first_admitted.append(e.seq.arrival)
                assert first_admitted == sorted(first_admitted), "a later request overtook a waiting one"
            assert e.seq.status is SequenceStatus.RUNNING
            assert e.end == e.seq.num_scheduled_tokens and e.num_tokens >= 1
            # (the batch's own sample already counts as pending)
            assert (e.end + 1 == e.seq.num_tokens_after_inflight) if e.samples else \
                (e.end < e.seq.num_tokens_after_inflight)
            assert e.is_decode <= (e.num_tokens == 1 and e.samples)
            assert e.from_prev <= (inflight is not None and e.is_decode)
            if not e.is_decode:
                assert e.num_tokens <= cfg.chunk_size
        if cfg.preemption == "never" or inflight is not None:
            assert not batch.preempted
        sampled = model.run(batch, inflight[1] if inflight else None)
        if inflight is not None:
            finish(*inflight)
        if overlap:
            inflight = (batch, sampled)
        else:
            finish(batch, sampled)
        sched.check()
        model.poison_free_pages()
    # everything returned: only cached pages remain, and clearing the cache frees them all
    for r in sched.ranks:
        if r.cache is not None:
            assert r.allocator.num_used == r.cache.num_nodes == r.cache.num_evictable
            r.cache.clear()
        assert r.allocator.num_free == r.allocator.num_usable and r.reserved == 0
    return done


_BY_ID = {}


def requests_by_id(requests):
    key = id(requests)
    if key not in _BY_ID:
        _BY_ID.clear()
        _BY_ID[key] = {r.seq_id: r for r in requests}
    return _BY_ID[key]


def check_outputs(done, requests, aborted=()):
    for r in requests:
        seq = done[r.seq_id]
        want, reason = reference(r.prompt_token_ids, r.max_tokens, r.stop_token_ids, r.eos_token_ids,
                                 r.ignore_eos, r.min_tokens)
        if r.seq_id in aborted and seq.finish_reason is FinishReason.ABORT:
            assert seq.output_token_ids == want[:len(seq.output_token_ids)]
        else:
            assert seq.output_token_ids == want, f"{r.seq_id}: output differs from running alone"
            assert seq.finish_reason is reason


def make_requests(rng, n, max_prompt=14, max_out=10, eos=True):
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(0, max_prompt))] for _ in range(3)]
    reqs = []
    for i in range(n):
        prompt = (rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 5))])[:max_prompt]
        if not prompt:
            prompt = [rng.randrange(VOCAB)]
        max_tokens = rng.randint(1, max_out)
        reqs.append(Sequence(
            f"r{i}", prompt, max_tokens=max_tokens,
            stop_token_ids={rng.randrange(VOCAB)} if rng.random() < 0.3 else None,
            eos_token_ids={EOS} if eos else None,
            ignore_eos=rng.random() < 0.3, min_tokens=rng.randint(0, max_tokens) if rng.random() < 0.3 else 0))
    return reqs


# ---------------------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 2, 3, 4]), dp=st.sampled_from([1, 2]),
       preemption=st.sampled_from(["recompute", "never"]), caching=st.booleans(),
       max_num_seqs=st.integers(1, 6), extra_budget=st.integers(0, 12),
       chunk=st.sampled_from([None, 1, 2, 5]), extra_pages=st.integers(0, 8), overlap=st.booleans())
def test_random_workloads_match_running_alone(seed, page_size, dp, preemption, caching, max_num_seqs,
                                              extra_budget, chunk, extra_pages, overlap):
    rng = random.Random(seed)
    reqs = make_requests(rng, rng.randint(1, 10), max_out=12)
    need = max(-(-(r.num_prompt_tokens + r.max_tokens - 1) // page_size) for r in reqs)
    cfg = SchedulerConfig(num_pages=need + 1 + extra_pages, page_size=page_size, dp=dp,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs + extra_budget,
                          max_prefill_chunk=chunk, enable_prefix_caching=caching, preemption=preemption)
    arrivals = [rng.randint(0, 6) for _ in reqs]
    aborts = {}
    aborted = set()
    for r in reqs:
        if rng.random() < 0.15:
            aborts.setdefault(rng.randint(0, 12), []).append(r.seq_id)
            aborted.add(r.seq_id)
    sched = TracingScheduler(cfg)
    done = run_engine(sched, reqs, arrivals, aborts, overlap=overlap)
    assert set(done) == {r.seq_id for r in reqs}
    check_outputs(done, reqs, aborted)
    if preemption == "never":
        assert sched.num_preemptions == 0


def _tight(preemption, caching, page_size=2, dp=1):
    rng = random.Random(5)
    reqs = [Sequence(f"s{i}", [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 9))], max_tokens=12,
                     eos_token_ids={EOS}, ignore_eos=True) for i in range(6)]
    need = max(-(-(r.num_prompt_tokens + r.max_tokens - 1) // page_size) for r in reqs)
    cfg = SchedulerConfig(num_pages=need + 2, page_size=page_size, dp=dp, max_num_seqs=4,
                          max_num_batched_tokens=8, max_prefill_chunk=3, enable_prefix_caching=caching,
                          preemption=preemption)
    return TracingScheduler(cfg), reqs


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("caching", [False, True])
def test_cache_too_small_preempts_and_still_correct(caching, overlap):
    sched, reqs = _tight("recompute", caching)
    done = run_engine(sched, reqs, overlap=overlap)
    check_outputs(done, reqs)
    assert sched.num_preemptions > 0
    assert any(done[r.seq_id].num_preemptions for r in reqs)
    if caching:  # preempted sequences come back through their own cached pages
        assert sched.stats()["prefix_hit_tokens"] > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_never_policy_reserves_and_never_preempts(overlap):
    sched, reqs = _tight("never", True)
    done = run_engine(sched, reqs, overlap=overlap)
    check_outputs(done, reqs)
    assert sched.num_preemptions == 0


def test_request_that_can_never_fit_is_rejected_at_add():
    sched = Scheduler(SchedulerConfig(num_pages=5, page_size=4, dp=2, max_model_len=20))
    # 4 usable pages x 4 tokens per rank = 16 KV positions; dp does not help a single request
    with pytest.raises(RequestTooLarge, match="needs 5 KV pages"):
        sched.add(Sequence("a", [1] * 10, max_tokens=8))
    with pytest.raises(RequestTooLarge, match="max_model_len=20"):
        sched.add(Sequence("b", [1] * 10, max_tokens=11))
    sched.add(Sequence("c", [1] * 10, max_tokens=7))  # 16 positions: fits exactly
    with pytest.raises(ValueError, match="already queued"):
        sched.add(Sequence("c", [1], max_tokens=1))
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        Sequence("d", [], max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens"):
        Sequence("d", [1], max_tokens=0)
    with pytest.raises(ValueError, match="negative"):
        Sequence("d", [1, -2], max_tokens=1)
    assert sched.num_waiting == 1


def test_config_validation():
    with pytest.raises(ValueError, match="preemption"):
        SchedulerConfig(num_pages=8, preemption="swap")
    with pytest.raises(ValueError, match="one decode token for every running sequence"):
        SchedulerConfig(num_pages=8, max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="page_size"):
        SchedulerConfig(num_pages=8, page_size=0)
    with pytest.raises(ValueError, match="no usable page"):
        SchedulerConfig(num_pages=1)


def _step(sched, model):
    batch = sched.schedule()
    return batch, sched.on_step_done(batch, model.run(batch))


def test_abort_and_finish_free_pages_at_once():
    sched = Scheduler(SchedulerConfig(num_pages=20, page_size=2, max_num_batched_tokens=64,
                                      enable_prefix_caching=False))
    model = FakeModel(sched)
    a = sched.add(Sequence("a", [1, 2, 3, 4, 5], max_tokens=10, ignore_eos=True))
    b = sched.add(Sequence("b", [6, 7, 8], max_tokens=10))
    _step(sched, model)
    alloc = sched.ranks[0].allocator
    assert alloc.num_used == 3 + 2
    assert sched.abort("a") and alloc.num_used == 2 and a.finish_reason is FinishReason.ABORT
    assert not sched.abort("a") and not sched.abort("nope")
    # abort while a step is in flight: the step's token for it is dropped
    batch = sched.schedule()
    sampled = model.run(batch)
    assert sched.finish("b", FinishReason.STOP) and alloc.num_used == 0
    assert sched.on_step_done(batch, sampled) == [] and b.finish_reason is FinishReason.STOP
    # a waiting request can be aborted too
    sched.add(Sequence("c", [1], max_tokens=2))
    assert sched.abort("c") and not sched.has_unfinished() and sched.schedule() is None


def test_chunked_prefill_entries_and_protocol_errors():
    sched = Scheduler(SchedulerConfig(num_pages=20, page_size=4, max_num_seqs=2, max_num_batched_tokens=8,
                                      max_prefill_chunk=3))
    model = FakeModel(sched)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    sched.add(Sequence("p", prompt, max_tokens=3, ignore_eos=True))
    batch = sched.schedule()
    (e,) = batch.entries
    assert (e.start, e.num_tokens, e.samples, e.is_decode) == (0, 3, False, False)
    batch2 = sched.schedule()             # overlapped: the next chunk, scheduled while the first is in flight
    (e2,) = batch2.entries
    assert (e2.start, e2.num_tokens, e2.samples, e2.from_prev) == (3, 3, False, False)
    with pytest.raises(RuntimeError, match="in flight"):
        sched.schedule()                  # a third batch: no
    with pytest.raises(RuntimeError, match="not the oldest one in flight"):
        sched.on_step_done(batch2, {})
    with pytest.raises(ValueError, match="intermediate prefill chunk"):
        sched.on_step_done(batch, {"p": 1})
    with pytest.raises(ValueError, match="not in step"):
        sched.on_step_done(batch, {"zz": 1})
    assert model.run(batch) == {}
    assert model.run(batch2) == {}
    sched.on_step_done(batch, {})
    with pytest.raises(RuntimeError, match="not the oldest one in flight"):
        sched.on_step_done(batch, {})
    sched.on_step_done(batch2, {})
    spans = [(0, 3), (3, 3)]
    while sched.has_unfinished():
        batch = sched.schedule()
        (e,) = batch.entries
        spans.append((e.start, e.num_tokens))
        if e.samples:
            with pytest.raises(ValueError, match="no sampled token"):
                sched.on_step_done(batch, {})
        sched.on_step_done(batch, model.run(batch))
    assert spans == [(0, 3), (3, 3), (6, 2), (8, 1), (9, 1)]
    assert sched.get("p") is None


def test_stop_rules():
    def finish_with(tokens, **kw):
        sched = Scheduler(SchedulerConfig(num_pages=30, page_size=2))
        seq = sched.add(Sequence("s", [1, 2], **kw))
        outs = []
        for t in tokens:
            batch = sched.schedule()
            outs += sched.on_step_done(batch, {"s": t})
            if seq.is_finished:
                break
        return seq, outs

    seq, outs = finish_with([5, 0, 7], max_tokens=9, eos_token_ids={0})
    assert seq.output_token_ids == [5, 0] and seq.finish_reason is FinishReason.STOP and seq.stop_token_id == 0
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.STOP and not outs[0].finished
    seq, _ = finish_with([5, 0, 7], max_tokens=3, eos_token_ids={0}, ignore_eos=True)
    assert seq.output_token_ids == [5, 0, 7] and seq.finish_reason is FinishReason.LENGTH
    seq, _ = finish_with([4, 0, 4, 3], max_tokens=9, eos_token_ids={0}, stop_token_ids={4}, min_tokens=3)
    assert seq.output_token_ids == [4, 0, 4] and seq.finish_reason is FinishReason.STOP
    seq, _ = finish_with([5, 6], max_tokens=2)
    assert seq.finish_reason is FinishReason.LENGTH


def test_prefix_hits_reuse_pages_and_count():
    g = 4
    sched = Scheduler(SchedulerConfig(num_pages=40, page_size=g, max_num_batched_tokens=64))
    model = FakeModel(sched)
    system = list(range(1, 9))  # two full pages
    a = sched.add(Sequence("a", system + [9, 10], max_tokens=2, ignore_eos=True))
    while sched.has_unfinished():
        _step(sched, model)
    b = sched.add(Sequence("b", system + [11], max_tokens=2, ignore_eos=True))
    batch = sched.schedule()
    (e,) = batch.entries
    assert e.start == 2 * g and b.num_cached_tokens == 8
    cached = sched.ranks[0].cache.match(system).pages
    assert b.block_table[:2] == cached
    sched.on_step_done(batch, model.run(batch))
    while sched.has_unfinished():
        _step(sched, model)
    # a prompt that is entirely cached still recomputes its last token
    c = sched.add(Sequence("c", system, max_tokens=1))
    batch = sched.schedule()
    assert batch.entries[0].start == g and batch.entries[0].num_tokens == g
    sched.on_step_done(batch, model.run(batch))
    st_ = sched.stats()
    assert st_["prefix_queries"] == 3 and st_["prefix_hit_tokens"] == 8 + 4
    assert st_["prefix_query_tokens"] == len(a.prompt_token_ids) + len(b.prompt_token_ids) + len(c.prompt_token_ids)
    assert c.output_token_ids == reference(system, 1)[0]


def test_concurrent_identical_prompts_dedup_pages():
    sched = Scheduler(SchedulerConfig(num_pages=40, page_size=2, max_num_batched_tokens=64))
    model = FakeModel(sched)
    for i in range(3):
        sched.add(Sequence(f"x{i}", [5, 6, 7, 8, 9], max_tokens=4, ignore_eos=True))
    _step(sched, model)  # all three prefill at once, nothing cached yet
    seqs = sched.running
    assert seqs[0].block_table[:2] == seqs[1].block_table[:2] == seqs[2].block_table[:2]
    assert len({s.block_table[2] for s in seqs}) == 3  # partial tails are private
    assert sched.ranks[0].allocator.num_used == 2 + 3
    sched.check()


def test_dp_ranks_balance_requests():
    sched = Scheduler(SchedulerConfig(num_pages=10, page_size=2, dp=2, max_num_batched_tokens=64,
                                      enable_prefix_caching=False))
    model = FakeModel(sched)
    for i in range(4):
        sched.add(Sequence(f"q{i}", [1, 2, 3], max_tokens=2, ignore_eos=True))
    batch, _ = _step(sched, model)
    assert sorted(e.dp_rank for e in batch.entries) == [0, 0, 1, 1]
    assert [len(x) for x in batch.by_rank(2)] == [2, 2]
    st_ = sched.stats()
    assert st_["capacity_tokens"] == 2 * 9 * 2 and [r["num_running"] for r in st_["ranks"]] == [2, 2]


def test_open_reservations_count_against_max_num_seqs():
    """A decode worker serving its own requests too: an open KV reservation holds a sequence slot, so admissions
    stop at max_num_seqs - reservations, and the prefilled request that takes the reservation over never pushes the
    running set past max_num_seqs."""
    sched = Scheduler(SchedulerConfig(num_pages=64, page_size=4, max_num_seqs=2, max_num_batched_tokens=32))
    sched.reserve("pd-1", 2)                                     # an 8-token prompt's KV is on its way
    for i in range(3):
        sched.add(Sequence(f"local-{i}", [5, 6, 7], max_tokens=4))
    sched.schedule()
    assert sched.num_running == 1 and sched.num_waiting == 2     # one slot was left, not two
    sched.check()
    seq = Sequence("pd-1", [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=4)
    assert sched.add_prefilled(seq, "pd-1", first_token=9) is None
    assert sched.num_running == 2 <= sched.config.max_num_seqs
    sched.check()
    with pytest.raises(KVReservationError, match="sequence slots"):
        sched.reserve("pd-2", 1)                                 # both slots are running
