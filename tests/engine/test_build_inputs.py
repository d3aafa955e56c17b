"""ModelRunner.build_inputs (vectorized over the step's tokens, block-table cells and sampling rows) against the
per-entry loop it replaced, kept here as the reference: every array and row list equal, on one device and on a dp=2
mesh, for decodes, chunks, speculative verify / draft entries and tokens taken from the previous step; bad entries
raise a ValueError naming the problem."""
import numpy as np
import pytest

from engine_helpers import byte_tokenizer, tiny_model
from tbjax.engine import Engine, EngineConfig

FIELDS = ("tokens_T", "positions_T", "slots_T", "block_tables_SP", "kv_lens_S", "cu_q_lens_S1", "sample_rows_S",
          "temperature_S", "top_k_S", "top_p_S", "min_p_S", "seed_S", "sample_pos_S", "src_T", "draft_tok_S",
          "q_row_S")


def reference_build(runner, entries, sampling, prev_rows=None, *, sample_pos=None, verify=None, q_dst=None):
    G = runner.page_size
    norm = [e if len(e) == 4 else (0, *e) for e in entries]
    R = runner.num_ranks
    per_rank_tokens = [0] * R
    for r, ids, _, _ in norm:
        if not 0 <= r < R:
            raise ValueError(f"entry on dp rank {r}, the mesh has {R}")
        per_rank_tokens[r] += len(ids)
    T = runner._bucket_for(max(max(per_rank_tokens), 1))
    inp = runner._empty_inputs(T)
    S = inp.kv_lens_S.shape[1]
    U = inp.sample_rows_S.shape[1]
    t_of, s_of, u_of = [0] * R, [0] * R, [0] * R
    for n, ((r, ids, start, bt), smp) in enumerate(zip(norm, sampling)):
        s, t, u = s_of[r], t_of[r], u_of[r]
        if s >= S:
            raise ValueError(f"dp rank {r}: more than {S} sequences in a step of {T} tokens")
        k = len(ids)
        if len(bt) > runner.max_pages:
            raise ValueError(f"block table of {len(bt)} pages is wider than max_pages_per_seq={runner.max_pages}")
        bt_arr = np.asarray(bt, np.int32)
        pos = np.arange(start, start + k, dtype=np.int32)
        inp.tokens_T[r, t:t + k] = ids
        inp.positions_T[r, t:t + k] = pos
        inp.slots_T[r, t:t + k] = bt_arr[pos // G] * G + pos % G
        inp.block_tables_SP[r, s, :len(bt)] = bt_arr
        inp.kv_lens_S[r, s] = start + k
        inp.cu_q_lens_S1[r, s + 1] = t + k
        vq = None if verify is None else verify[n]
        nr = 1 if vq is None else k
        if vq is not None and len(vq) != k - 1:
            raise ValueError(f"entry {n}: {len(vq)} draft rows for {k - 1} drafted tokens")
        if u + nr > U:
            raise ValueError(f"dp rank {r}: more than {U} sampling rows in a step of {T} tokens")
        pos0 = start + k if sample_pos is None or sample_pos[n] is None else int(sample_pos[n])
        rows = slice(u, u + nr)
        inp.sample_rows_S[r, rows] = np.arange(t + k - nr, t + k)
        inp.sample_pos_S[r, rows] = np.arange(pos0 - nr + 1, pos0 + 1)
        for arr, v in zip((inp.temperature_S, inp.top_k_S, inp.top_p_S, inp.min_p_S, inp.seed_S), smp):
            arr[r, rows] = v
        if vq is not None:
            inp.draft_tok_S[r, u:u + nr - 1] = ids[1:]
            inp.q_row_S[r, u:u + nr - 1] = vq
        if q_dst is not None:
            inp.q_row_S[r, u] = q_dst[n]
        if prev_rows is not None and prev_rows[n] >= 0:
            if k != 1:
                raise ValueError(f"entry {n} takes its token from the previous step but has {k} tokens")
            inp.src_T[r, t] = prev_rows[n]
        inp.rows.append(r * U + u)
        inp.local_rows.append(u)
        inp.n_rows.append(nr)
        s_of[r], t_of[r], u_of[r] = s + 1, t + k, u + nr
    for r in range(R):              # padding sequences: empty (cu stays at the rank's token count)
        inp.cu_q_lens_S1[r, s_of[r] + 1:] = t_of[r]
    return inp


def _runner(mesh=None):
    spec, params = tiny_model()
    kw = {} if mesh is None else {"mesh": mesh}
    eng = Engine(spec, params, byte_tokenizer(), EngineConfig(num_pages=64, page_size=4, max_num_seqs=8,
                                                             max_num_batched_tokens=32, max_model_len=64, **kw))
    return eng.runner


def _random_step(rng, R, n, max_pages, G, spec=False, prev=False):
    entries, sampling, prev_rows, verify, sample_pos, q_dst = [], [], [], [], [], []
    for i in range(n):
        r = int(rng.integers(R))
        k = int(rng.choice([1, 1, 1, 2, 5]))
        start = int(rng.integers(0, 20))
        pages = -(-(start + k) // G) + int(rng.integers(0, 2))
        bt = [int(x) for x in rng.integers(1, 60, min(pages, max_pages))]
        ids = [int(x) for x in rng.integers(0, 256, k)]
        entries.append((r, ids, start, bt) if R > 1 or rng.random() < 0.5 else (ids, start, bt))
        sampling.append((float(rng.choice([0.0, 0.7])), int(rng.integers(0, 5)), float(rng.random()),
                         float(rng.random() / 4), int(rng.integers(0, 2**32 - 1))))
        prev_rows.append(int(rng.integers(0, 4)) if prev and k == 1 and rng.random() < 0.5 else -1)
        verify.append([int(x) for x in rng.integers(0, 9, k - 1)] if spec and k > 1 and rng.random() < 0.7 else None)
        sample_pos.append(int(rng.integers(0, 40)) if spec and rng.random() < 0.3 else None)
        q_dst.append(int(rng.integers(-1, 9)))
    kw = {}
    if spec:
        kw = {"verify": verify, "sample_pos": sample_pos}
    return entries, sampling, (prev_rows if prev else None), kw, q_dst


@pytest.mark.parametrize("mesh", [None, "dp=2"])
def test_build_inputs_equals_the_per_entry_loop(mesh):
    runner = _runner(mesh)
    R, G = runner.num_ranks, runner.page_size
    rng = np.random.default_rng(0)
    checked = 0
    for trial in range(60):
        entries, sampling, prev_rows, kw, q_dst = _random_step(rng, R, int(rng.integers(0, 7)), runner.max_pages, G,
                                                               spec=trial % 3 == 1, prev=trial % 3 == 2)
        if trial % 5 == 4:
            kw["q_dst"] = q_dst[:len(entries)]
        try:
            want = reference_build(runner, entries, sampling, prev_rows, **kw)
        except ValueError:
            continue                     # over a bucket's sequence / sampling-row slots: the error test covers it
        got = runner.build_inputs(entries, sampling, prev_rows, **kw)
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f"trial {trial}: {f}")
            assert getattr(got, f).dtype == getattr(want, f).dtype, f
        assert (got.rows, got.local_rows, list(got.n_rows)) == (want.rows, want.local_rows, list(want.n_rows))
        checked += 1
    assert checked >= 40


def test_build_inputs_refuses_bad_entries_with_their_reason():
    runner = _runner()
    ok = ([1, 2], 0, [3])
    smp = (0.0, 0, 1.0, 0.0, 0)
    cases = [
        ([(1, [1], 0, [3])], "dp rank 1"),                                    # rank outside a 1-rank mesh
        ([([1], 0, [3] * (runner.max_pages + 1))], "wider than max_pages_per_seq"),
        ([([1, 2, 3, 4, 5], 0, [3])], "past its block table"),                # 5 tokens, one page of 4
        ([([1], 0, [3])] * 9, "sequences in a step"),                         # max_num_seqs is 8
    ]
    for entries, msg in cases:
        with pytest.raises(ValueError, match=msg):
            runner.build_inputs(entries, [smp] * len(entries))
    with pytest.raises(ValueError, match="takes its token from the previous step"):
        runner.build_inputs([ok], [smp], [0])
    with pytest.raises(ValueError, match="draft rows"):
        runner.build_inputs([ok], [smp], verify=[[1, 2]])


@pytest.mark.parametrize("budget, max_seqs", [(512, 32), (512, 256), (16384, 256), (16384, 1024), (2048, 8)])
def test_token_buckets_pad_decodes_at_most_twice_and_stay_few(budget, max_seqs):
    """Every decode batch up to max_num_seqs lands in a bucket at most twice its rows (a 128-row decode once ran in
    the 256-token bucket); every step of up to `budget` tokens has a bucket; at most 12 programs up to 16k tokens."""
    from tbjax.engine.runner import token_buckets
    b = token_buckets(budget, 1, max_seqs)
    assert list(b) == sorted(set(b)) and b[-1] == budget
    for n in range(1, min(max_seqs, budget) + 1):
        assert next(x for x in b if x >= n) <= 2 * n, (n, b)
    assert len(b) <= (12 if max_seqs <= 256 else 14), b
