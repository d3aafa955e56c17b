"""The engine serving an MLA + MoE model (tiny DeepSeek-V3 config): its paged latent cache (one kv head of
kv_lora_rank + rope dims, read as key and value by the absorbed attention) must give the tokens of whole-sequence
recompute with the expanded attention (forward_dense), with continuous batching and chunked prefill."""
import os

import jax
import numpy as np
import pytest

from engine_helpers import byte_tokenizer, reference_greedy
from tbjax.engine import Engine, EngineConfig
from tbjax.engine.kv_cache import bytes_per_token
from tbjax.model import init_params
from tbjax.sampling import SamplingParams
from tbjax.spec import ModelSpec

CFG = os.path.join(os.path.dirname(__file__), "..", "data", "hf_moe", "deepseek_v3", "config.json")


@pytest.fixture(scope="module")
def model():
    spec = ModelSpec.from_hf_config(CFG).replace(dtype="float32", vocab_size=256)
    return spec, init_params(spec, jax.random.key(4), "float32", std=0.3)


def test_latent_cache_size():
    spec = ModelSpec.from_hf_config(CFG)
    m = spec.mla
    # per token and layer: the latent (rank 32 + rope 8) once, bf16 (the expanded form: 4 heads x (24 + 16) x K and V)
    assert bytes_per_token(spec, "bfloat16") == spec.n_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 2


@pytest.mark.parametrize("kw", [dict(page_size=4, max_prefill_chunk=8), dict(page_size=16)])
def test_mla_moe_engine_equals_recompute(model, kw):
    spec, params = model
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (3, 12, 30)]
    want = [reference_greedy(spec, params, p, 6) for p in prompts]
    eng = Engine(spec, params, byte_tokenizer(), EngineConfig(num_pages=64, max_num_seqs=4,
                                                             max_num_batched_tokens=32, **kw))
    for i, p in enumerate(prompts):
        eng.add_request(i, p, SamplingParams.greedy(6, ignore_eos=True))
    got = {}
    for _ in range(200):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [got[i] for i in range(len(prompts))] == want
    eng.scheduler.check()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_mla_latent_kv_moves_between_engines(model, kv_dtype):
    """Prefill on one engine, export the split latent pages (+ fp8 scales), decode on another: the tokens equal one
    engine doing both (bf16: also equal to expanded-attention recompute)."""
    from test_engine_pd import _disaggregated
    spec, params = model
    rng = np.random.default_rng(9)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (5, 19)]
    sp = SamplingParams.greedy(5, ignore_eos=True)

    def eng():
        return Engine(spec, params, byte_tokenizer(),
                      EngineConfig(num_pages=48, page_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                                   kv_dtype=kv_dtype))
    colo = eng()
    for i, p in enumerate(prompts):
        colo.add_request(i, p, sp)
    want = {}
    while colo.has_unfinished():
        for o in colo.step():
            want.setdefault(o.request_id, []).extend(o.new_token_ids)
    got = _disaggregated(eng(), eng(), prompts, sp)
    assert got == want
    if kv_dtype == "bfloat16":
        assert [want[i] for i in range(len(prompts))] == [reference_greedy(spec, params, p, 5) for p in prompts]
