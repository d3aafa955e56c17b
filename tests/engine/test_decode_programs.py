"""Decode programs (runner `decode_programs`): decode-only steps in buckets above 64 tokens run a program of their own
whose attention is one decode kernel per layer. References: the dense whole-sequence recompute for the greedy tokens,
and which program each step ran (a decode-only step must take the decode program, a step with a prompt chunk must
not)."""
import numpy as np
import pytest

from engine_helpers import byte_tokenizer, reference_greedy, tiny_model
from tbjax.engine.arrivals import run_arrivals
from tbjax.engine.engine import Engine, EngineConfig
from tbjax.sampling import SamplingParams

N_SEQS = 70          # > 64: the decode-only steps land in the 128-token bucket


def _engine(decode_programs, **kw):
    spec, params = tiny_model(seed=5)
    cfg = dict(num_pages=720, page_size=4, max_num_seqs=N_SEQS, max_num_batched_tokens=160,
               enable_prefix_caching=False, decode_programs=decode_programs)
    cfg.update(kw)
    return Engine(spec, params, byte_tokenizer(), EngineConfig(**cfg))


def _recording(eng):
    seen = []
    launch = eng.runner.launch

    def rec(inp, *a, **k):
        seen.append((inp.program, int(np.max(inp.cu_q_lens_S1[:, 1:] - inp.cu_q_lens_S1[:, :-1]))))
        return launch(inp, *a, **k)
    eng.runner.launch = rec
    return seen


@pytest.mark.parametrize("decode_programs", [True, False])
def test_decode_program_tokens_match_the_dense_recompute(decode_programs):
    eng = _engine(decode_programs)
    assert eng.runner.decode_buckets == ((128,) if decode_programs else ())
    seen = _recording(eng)
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(1, 255, int(n))] for n in rng.integers(2, 12, N_SEQS)]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    toks, _, _ = run_arrivals(eng, [(i, p, greedy, 0) for i, p in enumerate(prompts)])
    spec, params = tiny_model(seed=5)
    for i in range(0, N_SEQS, 7):
        assert toks[i] == reference_greedy(spec, params, prompts[i], 6), i
    assert all(len(t) == 6 for t in toks.values())
    decode_steps = [pid for pid, max_q in seen if pid[0] == 128 and max_q == 1]
    assert decode_steps, "no decode-only step ran in the 128-token bucket"
    assert all(pid[1] == decode_programs for pid in decode_steps)
    # a step with a prompt chunk never takes a decode program
    assert all(not pid[1] for pid, max_q in seen if max_q > 1)
    for r in eng.scheduler.ranks:
        assert r.allocator.num_free == r.allocator.num_usable


def test_decode_buckets_are_those_above_64_up_to_the_one_holding_max_num_seqs():
    cases = {(256, 16384): (128, 256), (100, 4096): (128,), (32, 16384): (), (64, 512): (), (300, 512): (128, 256, 512)}
    for (mns, mnbt), want in cases.items():
        eng = _engine(True, max_num_seqs=mns, max_num_batched_tokens=mnbt, num_pages=64)
        assert eng.runner.decode_buckets == want, (mns, mnbt)
        assert len(eng.runner.programs) == len(eng.runner.buckets) + len(want)
    # CPU attention is the blocked jnp loop: no decode programs unless asked for
    assert _engine(None, max_num_seqs=256, max_num_batched_tokens=1024, num_pages=64).runner.decode_buckets == ()
    with pytest.raises(ValueError, match="decode_programs"):
        _engine("yes")


def test_warmup_compiles_the_decode_programs_too():
    eng = _engine(True, max_num_seqs=N_SEQS, max_num_batched_tokens=128, num_pages=64)
    info = eng.warmup()
    assert info["programs"] == len(eng.runner.buckets) + 1 == len(eng.runner.programs)
    assert set(eng.runner._compiled) == set(eng.runner.programs)
