"""Pipeline-parallel prefill over fake CPU devices against the single-device whole-prompt forward (forward_dense),
and the FLOPs stage split against brute force over every contiguous split."""
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import tiny_model
from tbjax.model import forward_dense, init_params
from tbjax.prefill_pipeline import PipelinePrefill, balanced_partition, layer_flops_per_token, split_layers
from tbjax.spec import ModelSpec

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "hf_moe")


def _deepseek():
    spec = ModelSpec.from_hf_config(os.path.join(DATA, "deepseek_v3", "config.json")).replace(dtype="float32")
    return spec, init_params(spec, jax.random.key(2), "float32", std=0.1)


def test_flops_count_active_parameters():
    """By hand from tests/data/hf_moe/deepseek_v3/config.json (hidden 64, intermediate 96, 8 routed experts of 32,
    top-2, 1 shared expert of 32, noaux_tc bias): layer 0's dense FFN multiplies 64 + 3*64*96 = 18496 parameters;
    an MoE layer 64 (norm) + 64*8 (router) + 8 (bias) + 3*64*32 (shared) + 2*3*64*32 (two routed) = 19016.
    Attention (MLA, 4 heads, dims 16+8 / 16) adds 2 * 4 * (16 + 8 + 16) FLOPs per attended token."""
    spec, _ = _deepseek()
    f = layer_flops_per_token(spec, context=0)
    assert f[1] - f[0] == pytest.approx(2 * (19016 - 18496))
    assert f[1] == f[2]
    g = layer_flops_per_token(spec, context=1000)
    assert g[0] - f[0] == pytest.approx(2 * 4 * (16 + 8 + 16) * 1000)


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 6])
def test_partition_is_the_best_contiguous_split(parts):
    rng = np.random.default_rng()
    costs = rng.uniform(1, 10, 9) * rng.choice([1, 5], 9)
    ranges = balanced_partition(costs, parts)
    assert [i for r in ranges for i in r] == list(range(9)) and len(ranges) == parts and all(len(r) for r in ranges)
    got = max(costs[list(r)].sum() for r in ranges)
    best = min(max(costs[a:b].sum() for a, b in zip((0, *cuts), (*cuts, 9)))
               for cuts in itertools.combinations(range(1, 9), parts - 1))
    assert got == pytest.approx(best)


def test_split_layers_balances_a_moe_model():
    spec, _ = _deepseek()                 # layer 0 dense, layers 1-2 MoE
    cost = np.array(layer_flops_per_token(spec, 64))
    ranges = split_layers(spec, 2, 64)
    assert max(cost[list(r)].sum() for r in ranges) == pytest.approx(min(max(cost[:c].sum(), cost[c:].sum())
                                                                        for c in (1, 2)))
    with pytest.raises(ValueError, match="pp must be"):
        split_layers(spec, 4, 64)


def _check_against_dense(spec, params, pp, n, chunk, tol):
    devs = jax.devices()[:pp]
    pipe = PipelinePrefill(spec, params, devs, chunk_tokens=chunk, max_len=96)
    for st, p in zip(pipe.stages, pipe.params):                   # each stage's weights live on its own device
        assert {d for leaf in jax.tree.leaves(p) for d in leaf.devices()} == {st.device}
    ids = np.random.default_rng(n).integers(0, spec.vocab_size, n)
    logits, kv = pipe.prefill(ids)
    ref_logits, ref_kv = jax.jit(lambda p, t: forward_dense(p, spec, t))(params, jnp.asarray(ids, jnp.int32))
    ref = np.asarray(ref_logits[n - 1])
    np.testing.assert_allclose(np.asarray(logits), ref, atol=tol * np.abs(ref).max())
    assert len(kv) == spec.n_layers
    for (k, v), (rk, rv) in zip(kv, ref_kv):
        np.testing.assert_allclose(np.asarray(k), np.asarray(rk)[:, :, :k.shape[-1]], atol=tol)
        np.testing.assert_allclose(np.asarray(v)[..., :rv.shape[-1]], np.asarray(rv), atol=tol)


@pytest.mark.parametrize("pp,n,chunk", [(2, 37, 16), (3, 16, 16), (4, 50, 8), (1, 5, 16)])
def test_pipeline_prefill_equals_whole_prompt_forward(pp, n, chunk):
    spec, params = tiny_model(n_layers=5)
    _check_against_dense(spec, params, pp, n, chunk, 2e-4)


def test_pipeline_prefill_moe_mla_model():
    spec, params = _deepseek()
    _check_against_dense(spec, params, 3, 29, 8, 5e-4)


def test_bad_prompts_and_stage_lists_are_refused():
    spec, params = tiny_model(n_layers=5)
    pipe = PipelinePrefill(spec, params, jax.devices()[:2], chunk_tokens=8, max_len=32)
    with pytest.raises(ValueError, match="empty prompt"):
        pipe.prefill([])
    with pytest.raises(ValueError, match="max_len"):
        pipe.prefill(np.zeros(33, np.int32))
    with pytest.raises(ValueError, match="token ids"):
        pipe.prefill([1, spec.vocab_size])
    with pytest.raises(ValueError, match="must cover"):
        PipelinePrefill(spec, params, jax.devices()[:2], stages=[range(0, 2), range(3, 5)])


def _decode_after_pipeline(spec, params, kv_dtype, prompts, n_out):
    """Pipeline prefill on 2 fake devices -> transfer pages -> a decode Engine (late reservation) -> greedy tokens."""
    from engine_helpers import byte_tokenizer
    from tbjax.engine import Engine, EngineConfig
    from tbjax.prefill_pipeline import kv_to_transfer_pages
    from tbjax.sampling import SamplingParams
    pipe = PipelinePrefill(spec, params, jax.devices()[:2], chunk_tokens=8, max_len=64)
    dec = Engine(spec, params, byte_tokenizer(), EngineConfig(num_pages=48, page_size=4, max_num_seqs=8,
                                                             kv_dtype=kv_dtype))
    sp = SamplingParams.greedy(n_out, ignore_eos=True)
    firsts, all_pages = {}, {}
    for i, p in enumerate(prompts):
        logits, kv = pipe.prefill(p)
        firsts[i] = int(np.argmax(np.asarray(logits)))
        pages, scales, n_pages = kv_to_transfer_pages(spec, kv, 4, kv_dtype, jax.devices()[0])
        all_pages[i] = (kv, pages, scales)
        ids = dec.reserve_kv(i, len(p))
        assert len(ids) == n_pages and pages.shape[:2] == (n_pages, spec.n_layers)
        dec.write_kv_pages(i, pages, scales, num_pages=n_pages)
        dec.add_prefilled_request(i, list(p), firsts[i], sp)
    outs = {}
    while dec.has_unfinished():
        for o in dec.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    dec.scheduler.check()
    return {i: [firsts[i]] + outs.get(i, []) for i in range(len(prompts))}, all_pages


def test_pipeline_prefill_feeds_a_decode_engine():
    """The pipeline's KV, in the transfer layout, continues decoding on an engine exactly like whole-sequence
    recompute (tiny float32 model: greedy tokens equal)."""
    from engine_helpers import reference_greedy
    spec, params = tiny_model()
    prompts = [[int(t) for t in np.random.default_rng(n).integers(0, 256, n)] for n in (3, 9, 21)]
    got, _ = _decode_after_pipeline(spec, params, "float32", prompts, 6)
    for i, p in enumerate(prompts):
        assert got[i] == reference_greedy(spec, params, p, 6), i


def test_transfer_pages_fp8_dequantize_to_the_kv():
    """fp8 pools: the pages (e4m3 + per page/head scales) dequantize to the pipeline's float K/V within e4m3's
    relative step (2^-3 of the page/head absmax), and K/V are interleaved per head as the engine's pools are."""
    from tbjax.prefill_pipeline import kv_to_transfer_pages
    spec, params = tiny_model()
    pipe = PipelinePrefill(spec, params, jax.devices()[:2], chunk_tokens=8, max_len=64)
    _, kv = pipe.prefill(list(range(1, 19)))
    pages, scales, n_pages = kv_to_transfer_pages(spec, kv, 4, "float8_e4m3fn", jax.devices()[0])
    deq = np.asarray(pages, np.float32) * np.asarray(scales)[:, :, None, :, None]    # [P, L, G, 2K, H]
    for l, (k, v) in enumerate(kv):
        want = np.stack([np.asarray(k), np.asarray(v)], axis=2).reshape(18, -1, spec.head_dim)   # [n, 2K, H]
        got = deq[:, l].reshape(n_pages * 4, -1, spec.head_dim)[:18]
        amax = np.abs(want).max()
        assert np.abs(got - want).max() <= amax * 2 ** -3 + 1e-6


@pytest.mark.parametrize("on_device", [True, False])
def test_pipeline_prefill_engine_in_a_disaggregated_pair(on_device):
    """PipelinePrefillEngine (2 stages) as the prefill side of the PD engine API, a plain Engine as the decode side:
    greedy output = whole-sequence recompute; seeded sampling draws the colocated engine's first token."""
    from engine_helpers import byte_tokenizer, reference_greedy
    from tbjax.engine import Engine, EngineConfig
    from tbjax.prefill_pipeline import PipelinePrefillEngine
    from tbjax.sampling import SamplingParams
    spec, params = tiny_model()
    tok = byte_tokenizer()
    pre = PipelinePrefillEngine(spec, params, tok, jax.devices()[:2], page_size=4, chunk_tokens=8, max_model_len=64)
    dec = Engine(spec, params, tok, EngineConfig(num_pages=48, page_size=4, max_num_seqs=8))
    prompts = [[int(t) for t in np.random.default_rng(n + 7).integers(0, 256, n)] for n in (2, 11, 26)]
    sp = SamplingParams.greedy(5, ignore_eos=True)
    for i, p in enumerate(prompts):
        pre.add_request(i, p, sp, prefill_only=True)
    firsts = {}
    while pre.has_unfinished():
        for o in pre.step():
            assert o.finished and len(o.new_token_ids) == 1
            firsts[o.request_id] = o.new_token_ids[0]
    for i, p in enumerate(prompts):
        kv = pre.export_kv(i, on_device=on_device)
        assert kv.first_token == firsts[i] and kv.num_pages == -(-len(p) // 4)
        dec.reserve_kv(i, kv.num_tokens)
        if on_device:
            dec.write_kv_pages(i, kv.device_pages, kv.device_scales, num_pages=kv.num_pages)
        else:
            dec.write_kv_pages(i, kv.pages, kv.scales)
        dec.add_prefilled_request(i, p, kv.first_token, sp)
    outs = {}
    while dec.has_unfinished():
        for o in dec.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    for i, p in enumerate(prompts):
        assert [firsts[i]] + outs[i] == reference_greedy(spec, params, p, 5), i
    with pytest.raises(KeyError):
        pre.export_kv(0)
    with pytest.raises(ValueError, match="prefill_only"):
        pre.add_request("x", [1, 2], sp)
    # seeded sampling: same first token as a colocated engine (same key convention, same logits up to rounding)
    colo = Engine(spec, params, tok, EngineConfig(num_pages=48, page_size=4, max_num_seqs=8))
    same = 0
    for s in range(8):
        hot = SamplingParams(max_tokens=1, temperature=1.0, seed=s, ignore_eos=True)
        pre.add_request(("s", s), prompts[1], hot, prefill_only=True)
        colo.add_request(("s", s), prompts[1], hot)
    a = {o.request_id: o.new_token_ids[0] for _ in range(8) for o in pre.step()}
    b = {}
    while colo.has_unfinished():
        for o in colo.step():
            b.setdefault(o.request_id, o.new_token_ids[0])
    same = sum(a[k] == b[k] for k in a)
    assert same == 8 and len(set(a.values())) > 1


def test_mla_kv_export_is_refused_clearly():
    from engine_helpers import byte_tokenizer
    from tbjax.prefill_pipeline import PipelinePrefillEngine, kv_to_transfer_pages
    spec, params = _deepseek()
    with pytest.raises(NotImplementedError, match="latent form"):
        PipelinePrefillEngine(spec, params, byte_tokenizer(), jax.devices()[:2], max_model_len=32)
    pipe = PipelinePrefill(spec, params, jax.devices()[:1], chunk_tokens=8, max_len=16)
    _, kv = pipe.prefill([1, 2, 3])
    with pytest.raises(NotImplementedError, match="latent form"):
        kv_to_transfer_pages(spec, kv, 4, "float32")


def test_pipeline_engine_warmup_compiles_what_prefill_runs():
    """PipelinePrefillEngine.warmup (what `serve --role split --pp N --warmup` runs before ready): afterwards the
    first token of a prefill-only request of another length compiles nothing (backend compiles counted with
    jax.monitoring; the KV export that follows still compiles per prompt page count), equals forward_dense's greedy
    token, and the warm-up request left no KV behind."""
    from engine_helpers import byte_tokenizer
    from tbjax.prefill_pipeline import PipelinePrefillEngine
    from tbjax.sampling import SamplingParams
    spec, params = tiny_model()
    pre = PipelinePrefillEngine(spec, params, byte_tokenizer(), jax.devices()[:2], page_size=4, chunk_tokens=16,
                                max_model_len=128)
    info = pre.warmup()
    assert info["programs"] == 2
    n, counting = [0], [True]

    def count(ev, d, **kw):       # (listeners cannot be removed one by one: this one stops counting instead)
        if counting[0] and ev == "/jax/core/compile/backend_compile_duration":
            n[0] += 1
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        ids = [int(t) for t in np.random.default_rng(3).integers(0, spec.vocab_size, 11)]
        pre.add_request("r", ids, SamplingParams.greedy(1), prefill_only=True)
        first = pre.step()[0].new_token_ids[0]
    finally:
        counting[0] = False
    assert n[0] == 0, f"{n[0]} compiles after warm-up"
    logits = forward_dense(params, spec, jnp.asarray(ids, jnp.int32))[0]
    assert first == int(np.argmax(np.asarray(logits[len(ids) - 1])))
    with pytest.raises(KeyError, match="no KV to export"):
        pre.export_kv("__tbjax_pipeline_warmup__")
