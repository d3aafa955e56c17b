"""Sampling after the step (`EngineConfig.post_sample`, the GPU default): the step program takes the argmax and a
small program per sampling-slot count draws the sampled rows. Greedy rows must equal the whole-sequence-recompute
reference, sampled rows and logprobs the in-step sampler's (the same `sample` on the same logits and keys), on one
device and on a dp=2 mesh, with and without overlapped scheduling, and nothing compiles after warm-up."""
import jax
import jax.monitoring
import pytest

from engine_helpers import byte_tokenizer
from tbjax.engine import Engine, EngineConfig
from tbjax.sampling import SamplingParams

PROMPTS = [[5, 6, 7], [9] * 11, [1], [40, 41, 42, 43, 44]]
N_OUT = 6
KINDS = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=N_OUT, ignore_eos=True),
         SamplingParams(temperature=1.0, top_k=5, seed=2, max_tokens=N_OUT, logprobs=3, ignore_eos=True),
         SamplingParams(temperature=0.7, min_p=0.1, seed=3, max_tokens=N_OUT, ignore_eos=True),
         SamplingParams.greedy(N_OUT, logprobs=2, ignore_eos=True)]


def _run(model, post, prompts_kinds, **kw):
    spec, params = model
    eng = Engine(spec, params, byte_tokenizer(), EngineConfig(num_pages=96, page_size=4, max_num_seqs=4,
                                                         max_num_batched_tokens=16, post_sample=post, **kw))
    info = eng.warmup()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda ev, dur, **k: compiles.append(ev) if ev == "/jax/core/compile/backend_compile_duration" else None)
    for i, (p, k) in enumerate(prompts_kinds):
        eng.add_request(i, p, k)
    toks, lps = {}, {}
    while eng.has_unfinished():
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            lps.setdefault(o.request_id, []).extend(o.logprobs or [])
    n_compiles = len(compiles)
    compiles.append("stop")          # (the listener stays registered; later events are not this run's)
    return eng, info, toks, lps, n_compiles


@pytest.mark.parametrize("overlap", [False, True])
def test_post_sample_equals_in_step_sampling_and_greedy_reference(model, expected, overlap):
    work = [(p, KINDS[i % len(KINDS)]) for i, p in enumerate(PROMPTS)]
    eng, info, toks, lps, n_compiles = _run(model, True, work, overlap_scheduling=overlap)
    assert eng.runner.post_sample and n_compiles == 0
    n_u = len({eng.runner.samples_for(b) for b in eng.runner.buckets})
    assert info["programs_total"] == info["programs"] + 2 * n_u     # step + top-logprobs + sampling programs
    _, _, toks_ref, lps_ref, _ = _run(model, False, work, overlap_scheduling=overlap)
    assert toks == toks_ref
    for i in lps_ref:
        assert len(lps[i]) == len(lps_ref[i])
        for (a, ta), (b, tb) in zip(lps[i], lps_ref[i]):
            assert a == pytest.approx(b, abs=1e-5) and [t for t, _ in ta] == [t for t, _ in tb]
    # the greedy request against the whole-sequence recompute
    assert toks[3][:N_OUT] == expected[3][:N_OUT]
    greedy = [(p, SamplingParams.greedy(N_OUT, ignore_eos=True)) for p in PROMPTS]
    _, _, gt, _, _ = _run(model, True, greedy, overlap_scheduling=overlap)
    assert [gt[i] for i in range(len(PROMPTS))] == [e[:N_OUT] for e in expected]


def test_post_sample_setting_is_checked(model):
    spec, params = model
    with pytest.raises(ValueError, match="post_sample must be None"):
        Engine(spec, params, byte_tokenizer(), EngineConfig(num_pages=16, page_size=4, post_sample="yes"))


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
def test_post_sample_on_a_dp2_mesh(model):
    work = [(p, KINDS[i % len(KINDS)]) for i, p in enumerate(PROMPTS)]
    _, _, toks, lps, n = _run(model, True, work, mesh="dp=2")
    _, _, toks_ref, lps_ref, _ = _run(model, False, work, mesh="dp=2")
    assert n == 0 and toks == toks_ref
    assert sorted(lps) == sorted(lps_ref)
    for i in lps_ref:
        assert [t for t, _ in lps[i]] == pytest.approx([t for t, _ in lps_ref[i]], abs=1e-5)
