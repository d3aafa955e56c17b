"""The served engine on a decode mesh of 8 (fake CPU) devices: tiny Mixtral, Qwen3-MoE and DeepSeek-V3 (MLA)
checkpoints with transformers' own logits (tests/data/hf_moe), run through `Engine` on meshes dp=8, dp=4 x ep=2 and
dp=2 x ep=4 (requests, KV pools, attention-weight shards and routed experts over all devices).

Checked: the first token's logprobs equal transformers' log-softmax at the prompt's last position; greedy tokens
under continuous batching (staggered arrivals, chunked prefill, a shared prefix) equal the single-device engine and
whole-sequence recompute; preemption on the mesh keeps the tokens; per-device attention-weight bytes are 1/N of the
model's (plus alignment padding) and routed-expert bytes 1/EP; meshes that do not fit are refused naming the axis."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import byte_tokenizer, reference_greedy
from sharding import packed as pk
from sharding.mesh import MeshMismatch
from tbjax.engine import Engine, EngineConfig
from tbjax.sampling import SamplingParams
from tbjax.weights.hf_names_moe import load_hf

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "hf_moe")
# every architecture and every mesh at least once (MLA on the widest expert split and the widest dp): the full
# cross product cost 9 runs of 8-device programs for what these 5 check
PAIRS = [("mixtral", "dp=8"), ("mixtral", "dp=2,ep=4"), ("qwen3_moe", "dp=4,ep=2"), ("deepseek_v3", "dp=2,ep=4"),
         ("deepseek_v3", "dp=8")]
N_OUT = 5


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "deepseek_v3"])
def case(request):
    name = request.param
    spec, params, _ = load_hf(os.path.join(DATA, name), dtype=jnp.float32)
    spec = spec.replace(eos_token_ids=())
    ref = np.load(os.path.join(DATA, name, "reference.npz"))
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(0, spec.vocab_size, 9)]
    prompts = [[int(t) for t in ref["tokens"][b]] for b in range(ref["tokens"].shape[0])]
    prompts += [shared + [5, 6]]
    prompts += [[int(t) for t in rng.integers(0, spec.vocab_size, n)] for n in (1, 3, 17, 6, 25, 2, 11, 4)]
    prompts += [shared + [7] * 8]
    want = [reference_greedy(spec, params, p, N_OUT) for p in prompts]
    return name, spec, params, ref, prompts, want


def _engine(spec, params, mesh, **kw):
    cfg = dict(num_pages=24, page_size=4, max_num_seqs=16, max_num_batched_tokens=32, max_prefill_chunk=8,
               mesh=mesh)
    cfg.update(kw)
    return Engine(spec, params, byte_tokenizer(), EngineConfig(**cfg))


def _run(eng, prompts, lp=0, stagger=3):
    """Add prompts a few per step (continuous batching); returns (tokens per prompt, first-token logprobs)."""
    got = {i: [] for i in range(len(prompts))}
    first_lp = {}
    pending = list(range(len(prompts)))
    steps = 0
    while pending or eng.has_unfinished():
        for i in pending[:stagger]:
            eng.add_request(i, prompts[i], SamplingParams.greedy(N_OUT, ignore_eos=True, logprobs=lp))
        pending = pending[stagger:]
        for o in eng.step():
            if o.logprobs and o.request_id not in first_lp:
                first_lp[o.request_id] = o.logprobs[0]
            got[o.request_id].extend(o.new_token_ids)
        steps += 1
        assert steps < 500
    eng.scheduler.check()
    return got, first_lp


@pytest.mark.parametrize("case,mesh", PAIRS, indirect=["case"])
def test_mesh_engine_matches_transformers_and_single_device(case, mesh):
    name, spec, params, ref, prompts, want = case
    eng = _engine(spec, params, mesh)
    assert eng.num_ranks == 8 and len(eng.scheduler.ranks) == 8
    got, first_lp = _run(eng, prompts, lp=20)
    assert [got[i] for i in range(len(prompts))] == want, name
    # the first generated token's top-20 logprobs against transformers' logits at the prompt's last position
    for b in range(ref["tokens"].shape[0]):
        hf = jax.nn.log_softmax(jnp.asarray(ref["logits"][b, -1], jnp.float32))
        chosen_lp, top = first_lp[b]
        ids = [i for i, _ in top]
        np.testing.assert_allclose([lp for _, lp in top], np.asarray(hf)[ids], atol=2e-5, rtol=0)
        assert ids[0] == int(np.argmax(ref["logits"][b, -1]))
    # requests were spread over the ranks, and the shared prefix was reused where it lived
    st = eng.scheduler.stats()
    assert st["prefix_hit_tokens"] > 0
    for r in eng.scheduler.ranks:
        assert r.allocator.num_used == (r.cache.num_nodes if r.cache else 0)


def test_mesh_engine_preempts_and_keeps_tokens(case):
    name, spec, params, _, prompts, want = case
    eng = _engine(spec, params, "dp=2", num_pages=9, max_num_seqs=16)     # 8 usable pages per rank: preempts
    got, _ = _run(eng, prompts, stagger=len(prompts))
    assert [got[i] for i in range(len(prompts))] == want
    assert eng.scheduler.num_preemptions > 0, "the workload was meant to preempt"


def test_mesh_memory_is_split(case):
    """Per device: 1/N of every layer's attention weights (plus alignment padding) and 1/EP of the routed experts."""
    name, spec, params, *_ = case
    eng = _engine(spec, params, "dp=2,ep=4")
    p, plan = eng.runner.params, eng.runner.plan
    assert plan.attn_shards == 8 and plan.packed
    per_dev = {s.data.nbytes for s in p["attn_packed"].addressable_shards}
    tensors = spec.n_layers * plan.attn_pack.tensor_bytes()
    assert len(per_dev) == 1
    got = per_dev.pop()
    assert tensors / 8 <= got <= tensors / 8 + spec.n_layers * pk.ALIGN * (len(plan.attn_pack.entries) + 1)
    names = set(plan.attn_pack.names)
    for g, gp in p["groups"].items():
        assert not names & set(gp), f"attention weights {names & set(gp)} still replicated in group {g}"
        for k in ("we_gate", "we_up", "we_down"):
            if k in gp:
                a = gp[k]
                assert {s.data.nbytes for s in a.addressable_shards} == {a.nbytes // 8}, (g, k)


def test_meshes_that_do_not_fit_are_refused(case):
    name, spec, params, *_ = case
    with pytest.raises(MeshMismatch, match=r"routed experts: \d+ cannot be split over mesh axes dp=3 x ep=2"):
        _engine(spec, params, "dp=3,ep=2")
    with pytest.raises(MeshMismatch, match="needs 16 devices but only 8"):
        _engine(spec, params, "dp=16")
    with pytest.raises(MeshMismatch, match="unknown mesh axis 'xp'"):
        _engine(spec, params, "xp=2")
    with pytest.raises(MeshMismatch, match="tp=2: the decode forward does not implement tp"):
        _engine(spec, params, "dp=2,tp=2")
