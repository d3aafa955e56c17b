"""Engine.warmup with speculative decoding compiles every program a speculative workload can run, so that no request
compiles afterwards (a compile during serving stalls the whole batch; on the H200 the speculative benchmark's timed
part was compile-bound when only the programs of one trial run had been compiled).

What speculation can run: the draft's step at every token bucket (catch-ups of 1-2 tokens per sequence, ring
rebuilds of up to the window, one-token proposal steps), the target's verify step at every bucket (1 + num_draft
rows per decode, num_draft anywhere in 0..k, together with prefill chunks), the sampler and the acceptance rule
inside those programs (greedy and temperature / top-k / top-p / min-p), and the top-logprobs program per number of
sampling slots. Compiles are counted as JAX reports them (tbjax/compile_monitor.py), whatever code triggers them.
"""
import numpy as np

from engine_helpers import byte_tokenizer, tiny_model
from tbjax import compile_monitor
from tbjax.engine import Engine, EngineConfig, program_cache, speculative
from tbjax.sampling import SamplingParams

K = 4
# Three token buckets (2, 4, 8) on the CPU; up to 3 sequences, so the verify step's rows (1 + drafts per decode)
# are cut by the budget at batch 2 and 3 and every bucket is reached by both runners.
CFG = dict(num_pages=160, page_size=4, max_num_seqs=3, max_num_batched_tokens=8, max_prefill_chunk=8,
           speculative={"draft": "self", "num_tokens": K, "window": 128})


def _kinds():
    return [SamplingParams.greedy(24, ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=19, ignore_eos=True),
            SamplingParams(temperature=1.0, top_k=5, seed=2, max_tokens=14, logprobs=2, ignore_eos=True),
            SamplingParams(temperature=0.7, min_p=0.1, seed=3, max_tokens=9, ignore_eos=True),
            SamplingParams.greedy(3, ignore_eos=True)]       # ends after few tokens: fewer than k drafts


def test_warmup_covers_every_speculative_program(monkeypatch):
    """After warmup(), waves of 1..max_num_seqs requests (short prompts the window-128 draft sees whole: every draft
    accepted; long ones it sees only the end of: most rejected), greedy and sampled, with logprobs, some arriving
    while others decode, run without a single backend compile. Fails when the warm-up leaves out the draft's
    programs (checked by hand: Engine.warmup without the draft runner gives 3 compiles here)."""
    spec, params = tiny_model()
    program_cache.shared_clear()     # programs of other engines in this process must not stand in for the warm-up
    compile_monitor.install()
    eng = Engine(spec, params, byte_tokenizer(), EngineConfig(**CFG))
    info = eng.warmup()
    assert eng.ready and info["programs"] == 2 * len(eng.runner.buckets) == 6
    c0, s0 = compile_monitor.count(), compile_monitor.seconds()

    accepted = []                    # drafts kept per verify entry: the acceptance patterns the workload hit
    real = speculative.accepted_prefix

    def spy(rows):
        a = real(rows)
        accepted.append((a, len(rows)))
        return a
    monkeypatch.setattr(speculative, "accepted_prefix", spy)

    rng = np.random.default_rng(5)
    kinds = _kinds()
    n_req = 0

    def add(tag, n, short):
        nonlocal n_req
        for j in range(n):
            L = int(rng.integers(1, 7)) if short else int(rng.integers(20, 140))
            eng.add_request((tag, j), [int(t) for t in rng.integers(0, 256, L)], kinds[n_req % len(kinds)])
            n_req += 1

    for wave, (n, short) in enumerate([(1, True), (1, False), (2, True), (3, False), (3, True), (2, False)]):
        add(wave, n, short)
        steps = 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
            if steps == 3 and n < eng.config.max_num_seqs:     # a late arrival: its prefill beside the decodes
                add((wave, "late"), 1, not short)
        eng.scheduler.check()
        eng.spec_decoder.check()
    n_compiles = compile_monitor.count() - c0
    assert n_compiles == 0, (f"{n_compiles} backend compiles ({compile_monitor.seconds() - s0:.1f} s) after "
                             f"warm-up")
    # the workload reached every acceptance pattern: none, some and all of a verify entry's drafts, and entries with
    # fewer than k drafts
    kept = {a for a, _ in accepted}
    assert 0 in kept and K in kept and kept & set(range(1, K)), sorted(kept)
    assert {nd for _, nd in accepted} >= {1, K}
    st = eng.stats()
    assert st["compiled_programs"] == info["programs"]
    assert st["spec_draft_rebuilds"] > 0 and st["spec_verify_steps"] > 0
