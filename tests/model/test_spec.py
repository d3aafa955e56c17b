"""ModelSpec parsing: the real configs in ../shared/configs, and broken configs that must be refused by name."""
import json
import os

import pytest

from tbjax.spec import ModelSpec, SpecError, UnsupportedArchitecture

# ../shared/configs beside the checkout when present; else the copies in tests/data/configs (CI's clean clone)
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "configs")
if not os.path.isdir(CONFIGS):
    CONFIGS = os.path.join(os.path.dirname(__file__), "..", "data", "configs")


def cfg(name):
    with open(os.path.join(CONFIGS, name)) as f:
        return json.load(f)


def test_smollm2_config_and_gguf_metadata_agree(smollm_f32):
    from tbjax.weights.gguf_file import GGUFFile
    from tbjax.default_model import default_model_path
    a = ModelSpec.from_hf_config(cfg("smollm2-135m-instruct.json"))
    b = GGUFFile(default_model_path()).spec()
    for f in ("arch", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
              "max_position", "tie_embeddings", "qkv_bias", "qk_norm"):
        assert getattr(a, f) == getattr(b, f), f
    assert a.rope.theta == b.rope.theta == 100000.0
    assert a.n_heads == 9 and a.n_kv_heads == 3 and a.head_dim == 64 and a.q_per_kv == 3


def test_llama31_rope_scaling():
    s = ModelSpec.from_hf_config(cfg("llama-3.1-8b.json"))
    assert (s.rope.scaling, s.rope.factor, s.rope.low_freq_factor, s.rope.high_freq_factor,
            s.rope.original_max_position) == ("llama3", 8.0, 1.0, 4.0, 8192)
    assert s.n_kv_heads == 8 and s.head_dim == 128 and not s.tie_embeddings


def test_mistral_sliding_window_and_qwen_variants():
    base = cfg("llama-3.1-8b.json")
    mistral = {**base, "model_type": "mistral", "sliding_window": 4096, "rope_scaling": None}
    s = ModelSpec.from_hf_config(mistral)
    assert s.sliding_window == 4096 and s.layer_window(0) == 4096 and s.layer_window(31) == 4096
    qwen2 = {**base, "model_type": "qwen2", "rope_scaling": None, "use_sliding_window": False}
    s2 = ModelSpec.from_hf_config(qwen2)
    assert s2.qkv_bias and not s2.qk_norm and s2.sliding_window is None
    qwen3 = {**base, "model_type": "qwen3", "rope_scaling": None, "head_dim": 128}
    s3 = ModelSpec.from_hf_config(qwen3)
    assert s3.qk_norm and not s3.qkv_bias


def test_moe_and_mla_configs_parse():
    ds = ModelSpec.from_hf_config(cfg("deepseek-v3.json"))
    assert ds.mla.kv_lora_rank == 512 and ds.mla.qk_rope_head_dim == 64 and ds.head_dim == 192
    assert ds.moe.n_experts == 256 and ds.moe.top_k == 8 and ds.moe.n_group == 8 and ds.moe.topk_group == 4
    assert ds.moe.router == "sigmoid" and ds.moe.correction_bias and ds.first_dense_layers == 3
    assert [(g.name, len(g.layers)) for g in ds.layer_groups] == [("mla_dense", 3), ("mla_moe", 58)]
    mx = ModelSpec.from_hf_config(cfg("mixtral-8x7b-v0.1.json"))
    assert mx.moe.n_experts == 8 and mx.moe.top_k == 2 and mx.mla is None
    q = ModelSpec.from_hf_config(cfg("qwen3-30b-a3b.json"))
    assert q.qk_norm and q.moe.n_experts == 128 and q.moe.expert_ffn_dim == 768


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c.update(model_type="gpt_bigcode"), "unsupported architecture 'gpt_bigcode'"),
    (lambda c: c.pop("hidden_size"), "'hidden_size'"),
    (lambda c: c.pop("num_hidden_layers"), "'num_hidden_layers'"),
    (lambda c: c.update(num_key_value_heads=5), "not a multiple of num_key_value_heads=5"),
    (lambda c: c.update(rope_scaling={"rope_type": "dynamic-ntk-magic", "factor": 2}), "rope_scaling type"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.pop("model_type"), "no 'model_type'"),
    (lambda c: c.update(vocab_size=0), "vocab_size"),
])
def test_broken_configs_are_refused_by_name(mutate, message):
    c = cfg("llama-3.1-8b.json")
    mutate(c)
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec.from_hf_config(c)


def test_unknown_architecture_is_its_own_error(tmp_path):
    c = cfg("glm-4.7.json")
    with pytest.raises(UnsupportedArchitecture, match="glm4_moe"):
        ModelSpec.from_hf_config(c)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        ModelSpec.from_hf_config(tmp_path)
    with pytest.raises(SpecError, match="no config.json"):
        ModelSpec.from_hf_config(tmp_path / "nowhere")


def test_gguf_metadata_errors():
    with pytest.raises(UnsupportedArchitecture, match="'rwkv6'"):
        ModelSpec.from_gguf_metadata({"general.architecture": "rwkv6"})
    with pytest.raises(SpecError, match="llama.block_count"):
        ModelSpec.from_gguf_metadata({"general.architecture": "llama", "llama.embedding_length": 64,
                                      "llama.attention.head_count": 4, "llama.feed_forward_length": 128})
