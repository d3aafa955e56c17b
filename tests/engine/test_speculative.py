"""Speculative decoding with a sliding-window draft (tbjax/engine/speculative.py), end to end in the engine.

References: greedy decoding by whole-sequence recompute with dense attention (tests/engine_helpers.py) on tiny
random models, transformers' own greedy continuations on the real default model (tests/data), and for sampling the
exact distribution of the next three tokens computed from dense float32 logits in float64 (a chi-square test that
must also reject a deliberately wrong acceptance rule).
"""
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import _dense_fn, byte_tokenizer, reference_greedy, tiny_model
from tbjax.engine import Engine, EngineConfig, speculative
from tbjax.engine.speculative import SpeculativeConfig, SpeculativeConfigError, ring_pages
from tbjax.sampling import SamplingParams

RNG = np.random.default_rng(17)
SHARED = [int(t) for t in RNG.integers(0, 256, 24)]
PROMPTS = [[int(t) for t in RNG.integers(0, 256, n)] for n in (1, 6, 13, 30)] + [SHARED + [1, 2], SHARED + [9] * 7]
N_OUT = 10
SPEC = dict(num_tokens=3, window=8)
# Two token buckets (2, 4): each step program compiles in ~7-9 s on 2 CPU cores, the test budget allows few of them.
# 80 usable pages of 4 tokens: one long sequence fits, two long ones preempt.
BASE = dict(num_pages=81, page_size=4, max_num_seqs=2, max_num_batched_tokens=4, max_prefill_chunk=4)


@pytest.fixture(scope="module")
def spec_engine(model):
    """The self draft (the tiny model's own weights with an 8-token window); warm-up compiles the target's and the
    draft's programs (one per token bucket each) and afterwards nothing compiles."""
    spec, params = model
    eng = Engine(spec, params, byte_tokenizer(), EngineConfig(**BASE, speculative=SPEC))
    info = eng.warmup()
    assert info["programs"] == 2 * len(eng.runner.buckets) == 4 and eng.ready
    yield eng
    # no step program compiled after warm-up, whatever the tests ran (k and the draft count are data)
    assert eng.runner.num_compiled + eng.spec_decoder.runner.num_compiled == 4


def run_all(engine, reqs, check=True):
    """reqs: list of (id, prompt, params) -> id -> tokens; checks the page bookkeeping after every step."""
    outs = {rid: [] for rid, _, _ in reqs}
    for rid, p, sp in reqs:
        engine.add_request(rid, p, sp)
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
        if check:
            engine.scheduler.check()
            if engine.spec_decoder is not None:
                engine.spec_decoder.check()
        steps += 1
        assert steps < 5000
    return outs


def assert_no_leaks(engine):
    for free, usable in engine.scheduler.clear_prefix_caches():
        assert free == usable
    if engine.spec_decoder is not None:
        sd = engine.spec_decoder
        assert not sd.states
        assert all(a.num_free == a.num_usable for a in sd.allocators)


def test_greedy_equals_reference_mixed_batch_prefix_sharing(model, spec_engine):
    """Mixed prompt lengths in one batch, two prompts sharing a 24-token prefix: greedy with speculation == the
    full-recompute reference (which greedy without speculation equals: tests/engine/test_engine.py)."""
    spec, params = model
    greedy = SamplingParams.greedy(N_OUT, ignore_eos=True)
    want = [reference_greedy(spec, params, p, N_OUT) for p in PROMPTS]
    got = run_all(spec_engine, [(i, p, greedy) for i, p in enumerate(PROMPTS)])
    for i, w in enumerate(want):
        assert got[i] == w, i
    st = spec_engine.stats()
    assert st["prefix_hit_tokens"] > 0
    assert st["spec_draft_tokens"] > 0 and 0 < st["spec_accepted_tokens"] <= st["spec_draft_tokens"]
    # fewer target steps than tokens: accepted drafts emit several tokens per step
    assert st["spec_tokens_per_step"] > 1.0
    assert_no_leaks(spec_engine)


def test_greedy_under_preemption(model, spec_engine):
    """Two sequences that together need more pages than the pool has: one is preempted (its draft ring freed) and
    recomputed (its ring rebuilt); both still give the reference's tokens."""
    spec, params = model
    pre = spec_engine.scheduler.num_preemptions
    reqs = [("a", PROMPTS[3], SamplingParams.greedy(180, ignore_eos=True)),
            ("b", PROMPTS[2], SamplingParams.greedy(180, ignore_eos=True))]
    got = run_all(spec_engine, reqs)
    assert spec_engine.scheduler.num_preemptions > pre
    assert got["a"] == reference_greedy(spec, params, PROMPTS[3], 180)
    assert got["b"] == reference_greedy(spec, params, PROMPTS[2], 180)
    assert_no_leaks(spec_engine)


def test_draft_ring_stays_constant_over_a_long_generation(model, spec_engine):
    """One request generating 280 tokens: the draft's window slides over ~70 logical pages, yet the sequence holds
    exactly one ring of pages at every step, the output equals the reference, and every draft and target page is
    free at the end."""
    spec, params = model
    sd = spec_engine.spec_decoder
    assert sd.ring == ring_pages(8, 4, 3) == 3
    prompt, n = PROMPTS[2], 280
    spec_engine.add_request("long", prompt, SamplingParams.greedy(n, ignore_eos=True))
    out, held = [], []
    while spec_engine.has_unfinished():
        for o in spec_engine.step():
            out += o.new_token_ids
        st = sd.states.get("long")
        if st is not None:
            held.append(len(st.pages))
            assert sd.allocators[0].num_used == sd.ring
    assert len(out) == n and set(held) == {sd.ring} and len(held) > 50
    assert out == reference_greedy(spec, params, prompt, n)
    assert_no_leaks(spec_engine)


def test_decode_side_of_disaggregation_builds_the_draft_from_the_prompt(model, spec_engine):
    """A request whose prompt KV arrives from a prefill engine (here the same engine: prefill_only, export_kv,
    reserve_kv, write_kv_pages, add_prefilled_request): the decode side has no draft KV, builds the draft's window
    from the prompt's last tokens, and the tokens are the reference's."""
    spec, params = model
    prompt = PROMPTS[3]
    spec_engine.add_request("pre", prompt, SamplingParams.greedy(1, ignore_eos=True), prefill_only=True)
    while spec_engine.has_unfinished():
        spec_engine.step()
    kv = spec_engine.export_kv("pre")
    spec_engine.reserve_kv("dec", kv.num_tokens)
    spec_engine.write_kv_pages("dec", kv.pages, kv.scales)
    spec_engine.add_prefilled_request("dec", prompt, kv.first_token, SamplingParams.greedy(12, ignore_eos=True))
    rebuilds = spec_engine.spec_decoder.num_rebuilds
    got = []
    while spec_engine.has_unfinished():
        for o in spec_engine.step():
            got += o.new_token_ids
    want = reference_greedy(spec, params, prompt, 12)
    assert [kv.first_token] + got == want
    assert spec_engine.spec_decoder.num_rebuilds == rebuilds + 1
    assert_no_leaks(spec_engine)


def _exact_next3(spec, params, prompt, temperature, top_k):
    """float64 probabilities of every 3-token continuation under temperature + top-k (dense float32 logits)."""
    f = _dense_fn(spec)

    def dist(ids):
        padded = np.zeros(128, np.int32)
        padded[:len(ids)] = ids
        z = np.asarray(f(params, jnp.asarray(padded))[len(ids) - 1], np.float64) / temperature
        top = np.argsort(-z, kind="stable")[:top_k]
        p = np.exp(z[top] - z[top].max())
        return dict(zip(top.tolist(), p / p.sum()))
    out = {}
    for a, pa in dist(prompt).items():
        for b, pb in dist(prompt + [a]).items():
            for c, pc in dist(prompt + [a, b]).items():
                out[(a, b, c)] = pa * pb * pc
    return out


def _chi2_pvalue(counts: dict, probs: dict, n: int) -> float:
    from scipy.stats import chi2
    if any(k not in probs for k in counts):
        return 0.0                                    # an outcome the target can never produce
    keys = list(probs)
    obs = np.array([counts.get(k, 0) for k in keys], np.float64)
    exp = np.array([probs[k] * n for k in keys])
    return float(chi2.sf(((obs - exp) ** 2 / exp).sum(), len(keys) - 1))


def _counts(outs):
    counts = {}
    for v in outs.values():
        counts[tuple(v)] = counts.get(tuple(v), 0) + 1
    return counts


def _sample_next3(engine, prompt, n, tag):
    sp = lambda i: SamplingParams(max_tokens=3, temperature=1.0, top_k=2, seed=1000 + i, ignore_eos=True)  # noqa
    outs = run_all(engine, [((tag, i), prompt, sp(i)) for i in range(n)], check=False)
    return _counts(outs), outs


def _sample_next3_plain(engine, prompt, n):
    """Without speculation: each token by a request of its own (max_tokens=1: only the prefill's plain sampler)."""
    seqs = {i: [] for i in range(n)}
    for j in range(3):
        sp = lambda i: SamplingParams(max_tokens=1, temperature=1.0, top_k=2, seed=5000 + 7 * i + j)  # noqa: E731
        outs = run_all(engine, [(("plain", j, i), prompt + seqs[i], sp(i)) for i in range(n)], check=False)
        for i in range(n):
            seqs[i] += outs[("plain", j, i)]
    return _counts(seqs)


def test_sampling_keeps_the_target_distribution_and_a_wrong_rule_fails(model, spec_engine, monkeypatch):
    """Next three tokens under temperature 1 / top-k 2 (8 outcomes), 160 seeded requests each: with speculation and
    without, the counts fit the exact distribution (chi-square); a deliberately wrong acceptance rule (accept every
    draft) injected into the same engine is rejected by the same test. Seeded requests repeat exactly."""
    spec, params = model
    prompt = PROMPTS[3]                       # 30 tokens: the draft's 8-token window sees a different context
    probs = _exact_next3(spec, params, prompt, 1.0, 2)
    n = 160
    on, outs_on = _sample_next3(spec_engine, prompt, n, "on")
    off = _sample_next3_plain(spec_engine, prompt, n)
    p_on, p_off = _chi2_pvalue(on, probs, n), _chi2_pvalue(off, probs, n)
    rate = spec_engine.stats()["spec_acceptance_rate"]
    print(f"chi-square p: speculative {p_on:.3g}, plain {p_off:.3g}; acceptance {rate:.2f}")
    assert p_on > 1e-3 and p_off > 1e-3
    again, outs_again = _sample_next3(spec_engine, prompt, 8, "on")
    assert all(outs_again[("on", i)] == outs_on[("on", i)] for i in range(8))     # per-request seeds repeat
    monkeypatch.setattr(speculative, "accepted_prefix", lambda rows: len(rows))   # always accept
    bad, _ = _sample_next3(spec_engine, prompt, n, "bad")
    p_bad = _chi2_pvalue(bad, probs, n)
    print(f"chi-square p with always-accept: {p_bad:.3g}")
    assert p_bad < 1e-6
    monkeypatch.undo()
    assert_no_leaks(spec_engine)


def test_stop_rules_inside_an_accepted_run(model, spec_engine):
    """eos / stop tokens / max_tokens / stop strings end a run of accepted tokens where they would end it without
    speculation: the output is the reference's prefix up to and including the stopping token."""
    spec, params = model
    ref = reference_greedy(spec, params, PROMPTS[1], 12)
    tok = byte_tokenizer()
    stop_tok = ref[6]
    cut = ref.index(stop_tok) + 1
    reqs = [("tok", PROMPTS[1], SamplingParams.greedy(12, stop_token_ids=[stop_tok], ignore_eos=True)),
            ("len", PROMPTS[1], SamplingParams.greedy(7, ignore_eos=True))]
    outs = run_all(spec_engine, reqs)
    assert outs["tok"] == ref[:cut] and outs["len"] == ref[:7]
    text = tok.decode(ref)
    stop = text[len(tok.decode(ref[:5])):][:1]
    if stop:
        spec_engine.add_request("str", PROMPTS[1], SamplingParams.greedy(12, stop=[stop], ignore_eos=True))
        got, txt = [], ""
        while spec_engine.has_unfinished():
            for o in spec_engine.step():
                got += o.new_token_ids
                txt += o.text_delta
        # the run ends at the token whose text completes the stop string (bytes of a random model need not be
        # whole UTF-8 characters, so the streamed text is compared through the tokens, not the decoded string)
        assert stop not in txt and got == ref[:len(got)] and len(got) <= 6
    assert_no_leaks(spec_engine)


def test_separate_draft_model_and_bad_settings(model):
    """A separate draft (another tiny model with the same vocabulary) gives the reference's greedy tokens; bad
    settings are refused with errors that name them."""
    spec, params = model
    d_spec, d_params = tiny_model(seed=3, n_layers=1)
    # one token bucket (2): one sequence, one drafted token per step, a 2-token prompt
    eng = Engine(spec, params, byte_tokenizer(), EngineConfig(**{**BASE, "max_num_seqs": 1,
                                                                 "max_num_batched_tokens": 2}, speculative={
        "draft": (d_spec, d_params), "num_tokens": 1, "window": 16}))
    assert not eng.spec_decoder.self_draft and eng.runner.buckets == (2,)
    greedy = SamplingParams.greedy(5, ignore_eos=True)
    prompts = [PROMPTS[1][:2]]
    outs = run_all(eng, [(i, p, greedy) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert outs[i] == reference_greedy(spec, params, p, 5)
    assert eng.stats()["spec_draft_tokens"] > 0
    assert_no_leaks(eng)

    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("off") is None
    assert SpeculativeConfig.parse("draft=self,num_tokens=5,window=64") == SpeculativeConfig("self", 5, 64)
    assert SpeculativeConfig.parse('{"num_tokens": 2}') == SpeculativeConfig("self", 2, 128)
    for bad, what in [({"num_tokens": 0}, "num_tokens"), ({"window": -3}, "window"), ({"k": 4}, "unknown"),
                      ("num_tokens=four", "num_tokens"), ("draft", "key=value"), ({"draft": 7}, "draft"),
                      ('{"num_tokens": ', "JSON"), ({"num_tokens": True}, "num_tokens")]:
        with pytest.raises(SpeculativeConfigError, match=what):
            SpeculativeConfig.parse(bad)
    other_vocab = tiny_model(seed=1, vocab_size=300)
    with pytest.raises(SpeculativeConfigError, match="vocabulary"):
        Engine(spec, params, byte_tokenizer(), EngineConfig(**BASE, speculative={"draft": other_vocab}))
    with pytest.raises(ValueError, match="overlapped scheduling"):
        Engine(spec, params, byte_tokenizer(), EngineConfig(**BASE, speculative={}, overlap_scheduling=True))
    with pytest.raises(SpeculativeConfigError, match="cannot be loaded"):
        Engine(spec, params, byte_tokenizer(), EngineConfig(**BASE, speculative={"draft": "/nonexistent/model"}))


def test_default_model_self_draft_greedy_matches_transformers(hf_ref, smollm_f32):
    """The real default model (float32), self draft with an 8-token window: greedy tokens with speculation are
    transformers' greedy continuations (12 tokens of two prompts). One token bucket (2 tokens: one drafted token
    per step), since each of the default model's step programs takes ~25 s to compile on 2 CPU cores."""
    meta, _ = hf_ref
    spec, params, tok = smollm_f32
    eng = Engine(spec, params, tok, EngineConfig(num_pages=64, max_num_seqs=1, max_num_batched_tokens=2,
                                                 speculative={"num_tokens": 1, "window": 8}))
    eng.warmup()
    greedy = SamplingParams.greedy(12, ignore_eos=True)
    outs = run_all(eng, [(i, meta["prompt_ids"][i], greedy) for i in range(2)])
    for i in range(2):
        assert outs[i] == meta["greedy"][i][:12], i
    st = eng.stats()
    print(f"default model, self draft (window 8, k=1): acceptance {st['spec_acceptance_rate']:.2f}, "
          f"{st['spec_tokens_per_step']:.2f} tokens per verify step")
    assert st["spec_accepted_tokens"] > 0
    assert_no_leaks(eng)
