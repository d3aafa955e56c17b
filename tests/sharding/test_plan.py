"""Capacity planner (`python -m tbjax.plan`): its counts come from the model's parameter tree; here they are checked
against independent counts written out from the published architectures (config numbers only), on the real
flagship configs (copies of ../shared/configs in tests/data/configs)."""
import json
import math
import os

import pytest

from sharding.mesh import DecodeLayout, MeshMismatch
from tbjax import plan as pl
from tbjax.spec import ModelSpec

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "configs")   # copies of ../shared/configs
DS, KIMI = os.path.join(CONFIGS, "deepseek-v3.json"), os.path.join(CONFIGS, "kimi-k2-instruct.json")
GIB = 1024 ** 3


def mla_attention_params(c: dict) -> int:
    """Independent count from config.json fields: DeepSeek MLA projections + its three norms."""
    D, N = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    q = D * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * N * qk
    kv = D * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"] + \
        c["kv_lora_rank"] * N * (c["qk_nope_head_dim"] + c["v_head_dim"])
    return D + q + kv + N * c["v_head_dim"] * D


def load(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("path,per_layer", [(DS, 187_114_496), (KIMI, None)])
def test_attention_params_match_independent_count(path, per_layer):
    c = load(path)
    spec = ModelSpec.from_hf_config(path)
    assert spec.n_layers == c["num_hidden_layers"] == 61
    count = pl.param_counts(spec)["attention"]
    assert count == spec.n_layers * mla_attention_params(c)
    if per_layer is not None:                  # DeepSeek-V3: ~187M attention parameters per layer
        assert count // spec.n_layers == per_layer
    # fp8 checkpoint: 1 byte per matrix element + one float32 per 128x128 block; norms stay bf16
    D, N = c["hidden_size"], c["num_attention_heads"]
    norms = D + c["q_lora_rank"] + c["kv_lora_rank"]
    mats = [(D, c["q_lora_rank"]), (c["q_lora_rank"], N * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"])),
            (D, c["kv_lora_rank"] + c["qk_rope_head_dim"]),
            (c["kv_lora_rank"], N * (c["qk_nope_head_dim"] + c["v_head_dim"])), (N * c["v_head_dim"], D)]
    fp8 = sum(a * b + 4 * math.ceil(a / 128) * math.ceil(b / 128) for a, b in mats) + 2 * norms
    assert pl.weight_bytes(spec)["attention"] == spec.n_layers * fp8
    lay = pl.attention_layout(spec)
    assert fp8 <= lay.padded_bytes(1) <= fp8 + 256 * 9       # the packed layer: same bytes + alignment


@pytest.mark.parametrize("dp", [8, 16, 32])
def test_released_bytes_per_device(dp):
    for path in (DS, KIMI):
        c, spec = load(path), ModelSpec.from_hf_config(path)
        p = pl.plan(spec, {"dp": dp})
        layer = pl.attention_layout(spec).padded_bytes(1)
        repl, sh = p["columns"]["replicated"]["attention"], p["columns"]["dp_sharded"]["attention"]
        assert repl == pl.weight_bytes(spec)["attention"]            # resident as the checkpoint holds it
        # 1/dp of every layer plus two gathered layers, up to alignment padding (256 bytes per shard)
        ideal = spec.n_layers * layer / dp + 2 * layer
        assert ideal <= sh <= ideal + spec.n_layers * 256 + 2 * dp * 256
        # fp8 DeepSeek-V3 attention is ~10.6 GiB per device replicated
        approx = spec.n_layers * mla_attention_params(c)
        assert 0.99 < repl / approx < 1.01
        assert p["columns"]["dp_sharded"]["max_batch_per_device"] >= p["columns"]["replicated"]["max_batch_per_device"]
    table = pl.release_table({"DeepSeek-V3": ModelSpec.from_hf_config(DS)}, (dp,))
    assert f"| DeepSeek-V3 | fp8 | 187.1M x 61 | {dp} | 10.63 GiB |" in table


HF_MOE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "hf_moe")


@pytest.mark.parametrize("model", ["llama", "llama-tied", "deepseek_v3", "mixtral", "qwen3_moe"])
def test_quantized_weight_bytes_equal_the_quantized_tree(model):
    """Planned bytes per resident format = the bytes of the model's parameter tree actually quantized to it
    (quant.quantize_tree on real arrays: codes, scales, zeros); the float planner = the float tree."""
    import jax

    from engine_helpers import tiny_spec
    from tbjax.model import init_params
    from tbjax.model import quant as qz
    if model.startswith("llama"):
        spec = tiny_spec(d_model=96, ffn_dim=80, vocab_size=200, tie_embeddings=model == "llama-tied",
                         dtype="bfloat16")
    else:
        spec = ModelSpec.from_hf_config(os.path.join(HF_MOE, model, "config.json"))
    params = init_params(spec, jax.random.key(0))
    assert sum(pl.weight_bytes(spec, spec.dtype).values()) == qz.resident_bytes(params)["total"]
    for fmt in ("int8", "int4", "fp8"):
        got = pl.weight_bytes(spec, fmt)
        want = qz.resident_bytes(qz.quantize_tree(params, fmt))
        assert sum(got.values()) == want["total"], (fmt, got, want)
        assert want[fmt] > 0


def test_plan_composition_and_kv():
    spec = ModelSpec.from_hf_config(DS)
    p = pl.plan(spec, {"dp": 8}, context=4096, hbm_bytes=140 * GIB)
    c = load(DS)
    assert p["kv_bytes_per_token"] == 61 * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2
    # routed experts: 58 MoE layers x 256 experts x 3 matrices of 7168x2048 in fp8 (+ block scales), 1/8 each
    per_expert = 3 * (7168 * 2048 + 4 * (7168 // 128) * (2048 // 128))
    assert p["per_device_by_kind"]["routed experts"] == 58 * 256 * per_expert // 8
    assert abs(p["params_total"] - 671e9) / 671e9 < 0.01          # DeepSeek-V3: 671B without the MTP layer
    col = p["columns"]["dp_sharded"]
    free = 140 * GIB - col["weights"] - p["reserve_bytes"]
    assert col["free"] == free
    assert col["max_batch_per_device"] == free // (4096 * p["kv_bytes_per_token"] + p["activation_bytes_per_token"])
    gqa = ModelSpec.from_hf_config(os.path.join(CONFIGS, "mixtral-8x7b-v0.1.json"))
    assert pl.kv_bytes_per_token(gqa, "fp8") == 32 * 2 * 8 * 128


def test_cli(capsys):
    assert pl.main([DS, "--mesh", "dp=8", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert "attention weights" in out and "max batch" in out and "releases" in out
    assert pl.main([DS, KIMI, "--release-table", "8,16,32"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert sum(r.startswith("| deepseek_v3 | fp8 |") for r in rows) == 3
    assert sum(r.startswith("| kimi_k2 | fp8 |") for r in rows) == 3
    assert pl.main([DS, "--mesh", "dp=8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_attn"] == 8
    assert pl.main([os.path.join(CONFIGS, "mixtral-8x7b-v0.1.json"), "--mesh", "dp=3,ep=2"]) == 2
    assert "routed experts: 8 cannot be split over mesh axes dp=3 x ep=2" in capsys.readouterr().err
    assert pl.main([DS, "--mesh", "dp=8,xp=2"]) == 2
    assert "unknown mesh axis 'xp'" in capsys.readouterr().err
    assert pl.main([DS, "--weights", "int3"]) == 2
    with pytest.raises(MeshMismatch, match="tp=2"):
        pl.plan(ModelSpec.from_hf_config(DS), {"dp": 8, "tp": 2})
    p = pl.plan(ModelSpec.from_hf_config(DS), {"dp": 2, "ep": 4}, DecodeLayout(expert_axes=("ep",)))
    assert p["n_ep"] == 4 and p["n_attn"] == 8
