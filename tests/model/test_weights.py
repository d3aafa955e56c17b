"""Loaders: corrupt/truncated files, configs that contradict the weights, safetensors and orbax round trips.

Every loader is checked against transformers' logits (tests/data), not against another tbjax output.
"""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from test_spec import CONFIGS
from tbjax.default_model import default_model_path
from tbjax.model import forward_dense
from tbjax.weights import WeightLoadError, checkpoint, convert, load_model, load_model_info
from tbjax.weights.safetensors_dir import HF_NAMES


@functools.lru_cache(maxsize=None)
def _forward(spec):
    """One jitted forward per spec (equal specs share it and its compiled programs)."""
    return jax.jit(lambda p, t: forward_dense(p, spec, t)[0])


def _last_logits(spec, params, ids):
    return np.asarray(_forward(spec)(params, jnp.asarray(ids))[-1])


def _assert_matches_hf(spec, params, hf_ref):
    meta, arr = hf_ref
    lg = _last_logits(spec, params, meta["prompt_ids"][0])
    ref = arr["last_logits_0"]
    assert np.abs(lg - ref).max() <= 1e-3 * np.abs(ref).max()


def test_truncated_and_corrupt_gguf(tmp_path):
    src = default_model_path()
    data = open(src, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightLoadError, match="truncated or corrupt"):
        load_model(str(cut), progress=False)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(WeightLoadError, match="cut.gguf|junk.gguf"):
        load_model(str(junk), progress=False)
    notgguf = tmp_path / "weights.bin"
    notgguf.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(WeightLoadError, match="not a GGUF file"):
        load_model(str(notgguf), progress=False)
    with pytest.raises(WeightLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"), progress=False)


def _export_hf_dir(path, spec, params, tok, config_overrides=None):
    """Write the (transformers-verified) default model as a HF safetensors directory."""
    from safetensors.numpy import save_file
    g = {k: np.asarray(v) for k, v in params["groups"]["gqa_dense"].items()}
    N, K, H = spec.n_heads, spec.n_kv_heads, spec.head_dim
    t = {HF_NAMES["embed"]: np.asarray(params["embed"]), HF_NAMES["final_norm"]: np.asarray(params["final_norm"])}
    for i in range(spec.n_layers):
        w = g["w_qkv"][i].T
        for name, arr in (("q", w[:N * H]), ("k", w[N * H:(N + K) * H]), ("v", w[(N + K) * H:]),
                          ("o", g["w_o"][i].T), ("gate", g["w_gate_up"][i][:, 0].T), ("up", g["w_gate_up"][i][:, 1].T),
                          ("down", g["w_down"][i].T), ("attn_norm", g["attn_norm"][i]), ("mlp_norm", g["mlp_norm"][i])):
            t[HF_NAMES[name].format(i=i)] = np.ascontiguousarray(arr)
    half = len(t) // 2
    keys = sorted(t)
    save_file({k: t[k] for k in keys[:half]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: t[k] for k in keys[half:]}, str(path / "model-00002-of-00002.safetensors"))
    with open(os.path.join(CONFIGS, "smollm2-135m-instruct.json")) as f:
        cfg = json.load(f)
    cfg.update(config_overrides or {})
    (path / "config.json").write_text(json.dumps(cfg))
    tok.tk.save(str(path / "tokenizer.json"))


def test_safetensors_dir_matches_transformers(tmp_path, smollm_f32, hf_ref):
    spec, params, tok = smollm_f32
    _export_hf_dir(tmp_path, spec, params, tok)
    spec2, params2, tok2 = load_model(str(tmp_path), dtype="float32", progress=False)
    assert spec2.n_layers == 30 and spec2.tie_embeddings
    _assert_matches_hf(spec2, params2, hf_ref)
    _assert_info_matches(str(tmp_path), spec2, tok2)


def _assert_info_matches(path, spec, tok):
    """load_model_info (no weights read) gives the loaded model's spec and an equivalent tokenizer."""
    spec_i, tok_i = load_model_info(path)
    assert spec_i.replace(dtype=spec.dtype) == spec
    text = "Hello, world! 2 + 2 = 4"
    assert tok_i.encode(text) == tok.encode(text) and tok_i.eos_token_ids == tok.eos_token_ids


def test_config_contradicting_weights_is_refused(tmp_path, smollm_f32):
    spec, params, tok = smollm_f32
    _export_hf_dir(tmp_path, spec, params, tok, {"intermediate_size": 2048})
    with pytest.raises(WeightLoadError, match=r"'gate' of layer 0 has shape \(1536, 576\) but the config implies \(2048, 576\)"):
        load_model(str(tmp_path), dtype="float32", progress=False)
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((tmp_path / "config.json").read_text()),
                                                      "intermediate_size": 1536, "num_key_value_heads": 9}))
    with pytest.raises(WeightLoadError, match="'k' of layer 0"):
        load_model(str(tmp_path), dtype="float32", progress=False)


def test_corrupt_safetensors_is_refused(tmp_path, smollm_f32):
    spec, params, tok = smollm_f32
    _export_hf_dir(tmp_path, spec, params, tok)
    f = tmp_path / "model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(WeightLoadError, match="model-00002-of-00002.safetensors"):
        load_model(str(tmp_path), dtype="float32", progress=False)


def test_tokenizer_vocab_mismatch_is_refused(tmp_path, smollm_f32):
    spec, params, tok = smollm_f32
    _export_hf_dir(tmp_path, spec, params, tok, {"vocab_size": 32000})
    with pytest.raises((WeightLoadError, ValueError), match="32000"):
        load_model(str(tmp_path), dtype="float32", progress=False)


def test_orbax_roundtrip_onto_a_different_mesh(tmp_path, smollm_f32, hf_ref):
    """Convert once (replicated source), restore straight into an 8-device sharding; logits still match HF."""
    assert len(jax.devices()) == 8
    dst = str(tmp_path / "ckpt")
    convert(None, dst, dtype="float32", progress=False)
    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    spec, params, _ = smollm_f32

    def sharding_for(a):
        if a.ndim == 4 and a.shape[-1] % 4 == 0:         # [L, D, 2, F] gate/up: F split, gate and up together
            return NamedSharding(mesh, P(None, None, None, "tp"))
        if a.ndim == 3 and a.shape[-1] % 4 == 0:
            return NamedSharding(mesh, P(None, None, "tp"))
        if a.ndim == 2 and a.shape[0] % 2 == 0:
            return NamedSharding(mesh, P("dp", None))
        return NamedSharding(mesh, P())
    shardings = jax.tree.map(sharding_for, params)
    spec2, params2, tok2 = load_model(dst, shardings=shardings)
    assert spec2 == spec
    _assert_info_matches(dst, spec2, tok2)
    _assert_info_matches(default_model_path(), spec, smollm_f32[2])
    w = params2["groups"]["gqa_dense"]["w_gate_up"]
    assert w.sharding == shardings["groups"]["gqa_dense"]["w_gate_up"]
    assert {s.data.shape for s in w.addressable_shards} == {(30, 576, 2, 1536 // 4)}
    # the restored values, gathered to the host, give transformers' logits
    _assert_matches_hf(spec2, jax.tree.map(np.asarray, params2), hf_ref)
    with pytest.raises(WeightLoadError, match="not a tbjax checkpoint"):
        checkpoint.restore(str(tmp_path))


def test_convert_first_layers_keeps_the_models_own_weights(tmp_path, smollm_f32):
    """convert(..., layers=4): a checkpoint of the default model's first 4 layers; every tensor equals the full
    model's (its first 4 entries for the stacked layer weights), the tokenizer is the model's."""
    from tbjax.model.params import first_layers
    spec, params, tok = smollm_f32
    dst = convert(None, str(tmp_path / "small"), dtype="float32", progress=False, layers=4)
    spec4, params4, tok4 = load_model(dst, progress=False)
    assert spec4 == spec.replace(n_layers=4)
    for name, full in params["groups"]["gqa_dense"].items():
        np.testing.assert_array_equal(np.asarray(params4["groups"]["gqa_dense"][name]), np.asarray(full)[:4])
    for name in ("embed", "final_norm"):
        np.testing.assert_array_equal(np.asarray(params4[name]), np.asarray(params[name]))
    assert tok4.encode("Hello, world!") == tok.encode("Hello, world!") and tok4.eos_token_ids == tok.eos_token_ids
    with pytest.raises(ValueError, match="n=31"):
        first_layers(spec, params, 31)
