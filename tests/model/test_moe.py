"""MoE FFN kind: routers against float64 numpy references, the ragged_dot expert path against a per-token loop,
and whole-model parity with Hugging Face transformers on tiny random Mixtral / Qwen3-MoE / DeepSeek-V3 models
(tests/data/hf_moe, made by `/tmp/refenv/bin/python scripts/make_hf_moe_reference.py`; see that script for the
configs and how the reference logits were computed), including DeepSeek's fp8 block-scaled weights.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharding import expert_parallel as xp
from tbjax.model import forward_dense
from tbjax.model import moe
from tbjax.spec import ModelSpec, MoESpec
from tbjax.weights.assemble import WeightLoadError
from tbjax.weights.hf_names_moe import block_dequant, load_hf

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "hf_moe")
SEED = int.from_bytes(os.urandom(4), "little")


def rng(k=0):
    return np.random.default_rng(SEED + k)


# ---- routing: numpy float64 references written from the transformers sources -------------------------------
def np_route(m: MoESpec, logits, bias=None):
    logits = logits.astype(np.float64)
    T, E = logits.shape
    if m.router == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
        choice = scores.copy()
    else:
        scores = 1 / (1 + np.exp(-logits))
        choice = scores + (bias if bias is not None else 0)
    if m.n_group > 1:
        per = E // m.n_group
        gs = np.sort(choice.reshape(T, m.n_group, per), axis=-1)[..., -2:].sum(-1)
        keep = np.argsort(-gs, axis=-1, kind="stable")[:, :m.topk_group]
        mask = np.zeros((T, m.n_group), bool)
        np.put_along_axis(mask, keep, True, axis=1)
        choice = np.where(np.repeat(mask, per, axis=1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :m.top_k]
    w = np.take_along_axis(scores, ids, axis=1)
    if m.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + (1e-20 if m.router == "sigmoid" else 0))
    return ids, w * m.routed_scaling_factor


ROUTERS = {
    "mixtral": MoESpec(n_experts=8, top_k=2, expert_ffn_dim=8),
    "qwen3_nonorm": MoESpec(n_experts=16, top_k=4, expert_ffn_dim=8, norm_topk_prob=False),
    "deepseek_group": MoESpec(n_experts=32, top_k=4, expert_ffn_dim=8, router="sigmoid", n_group=8, topk_group=3,
                              routed_scaling_factor=2.5, correction_bias=True),
    "kimi_nogroup": MoESpec(n_experts=24, top_k=6, expert_ffn_dim=8, router="sigmoid", routed_scaling_factor=2.8,
                            correction_bias=True),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_route_matches_numpy_reference(name):
    m = ROUTERS[name]
    r = rng(1)
    logits = r.normal(0, 2, (64, m.n_experts)).astype(np.float32)
    bias = r.normal(0, 0.3, (m.n_experts,)).astype(np.float32) if m.correction_bias else None
    ids, w = jax.jit(lambda l, b: moe.route(m, l, b))(logits, bias)
    ids, w = np.asarray(ids), np.asarray(w)
    rid, rw = np_route(m, logits, bias)
    # compare as sets per token (order of equal-ranked experts is not part of the contract)
    order, rorder = np.argsort(ids, axis=1), np.argsort(rid, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(ids, order, 1), np.take_along_axis(rid, rorder, 1),
                                  err_msg=f"seed {SEED}")
    np.testing.assert_allclose(np.take_along_axis(w, order, 1), np.take_along_axis(rw, rorder, 1), rtol=2e-6,
                               atol=1e-7, err_msg=f"seed {SEED}")


def test_group_routing_never_picks_outside_the_best_groups():
    m = ROUTERS["deepseek_group"]
    r = rng(2)
    logits = r.normal(0, 2, (128, m.n_experts)).astype(np.float32)
    bias = r.normal(0, 0.3, (m.n_experts,)).astype(np.float32)
    ids = np.asarray(moe.route(m, jnp.asarray(logits), jnp.asarray(bias))[0])
    choice = 1 / (1 + np.exp(-logits.astype(np.float64))) + bias
    per = m.n_experts // m.n_group
    gs = np.sort(choice.reshape(-1, m.n_group, per), -1)[..., -2:].sum(-1)
    for t in range(128):
        best = set(np.argsort(-gs[t])[:m.topk_group])
        assert {int(e) // per for e in ids[t]} <= best


def test_bad_router_inputs_raise():
    with pytest.raises(ValueError, match="unknown router"):
        moe.route(MoESpec(n_experts=4, top_k=2, expert_ffn_dim=4, router="relu"), jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="top-2 experts"):
        moe.route(MoESpec(n_experts=4, top_k=2, expert_ffn_dim=4, router="sigmoid", n_group=4, topk_group=2),
                  jnp.zeros((2, 4)))
    spec = ModelSpec.from_hf_config(os.path.join(DATA, "mixtral"))
    with pytest.raises(ValueError, match="needs spec.moe"):
        moe.moe_shapes(spec.replace(moe=None))


# ---- the expert computation ---------------------------------------------------------------------------------
def np_moe(x, ids, w, wg, wu, wd):
    x = x.astype(np.float64)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            g, u = x[t] @ wg[e], x[t] @ wu[e]
            y[t] += w[t, j] * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    return y


def test_local_experts_ragged_dot_matches_loop_and_skips_foreign_rows():
    r = rng(3)
    E, D, F, M = 5, 16, 12, 40
    x = r.normal(0, 1, (M, D)).astype(np.float32)
    wg, wu = r.normal(0, 0.3, (2, E, D, F)).astype(np.float32)
    wd = r.normal(0, 0.3, (E, F, D)).astype(np.float32)
    lid = r.integers(0, E + 2, M).astype(np.int32)        # ids >= E mean "expert not on this device"
    y = np.asarray(jax.jit(xp.local_experts)(x, lid, (wg, wu, wd)))
    ref = np.stack([np_moe(x[i:i + 1], [[lid[i]]], np.ones((1, 1)), wg, wu, wd)[0] if lid[i] < E
                    else np.zeros(D) for i in range(M)])
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
    assert np.all(y[lid >= E] == 0)


def test_moe_ffn_matches_numpy_with_shared_experts_and_load_counts():
    spec = ModelSpec.from_hf_config(os.path.join(DATA, "deepseek_v3")).replace(dtype="float32")
    m = spec.moe
    r = rng(4)
    shapes = moe.moe_shapes(spec)
    p = {k: r.normal(0, 0.2, s).astype(np.float32) for k, s in shapes.items()}
    p["mlp_norm"] = (1 + 0.1 * r.normal(size=shapes["mlp_norm"])).astype(np.float32)
    x = r.normal(0, 1, (20, spec.d_model)).astype(np.float32)
    y, st = jax.jit(lambda p, x: moe.moe_ffn(spec, p, x))(p, x)
    h = x.astype(np.float64)
    h = h / np.sqrt((h * h).mean(-1, keepdims=True) + spec.norm_eps) * p["mlp_norm"]
    ids, w = np_route(m, (h @ p["router"]).astype(np.float32), p["router_bias"])
    ref = np_moe(h, ids, w, p["we_gate"], p["we_up"], p["we_down"])
    g, u = h @ p["ws_gate"], h @ p["ws_up"]
    ref += (g / (1 + np.exp(-g)) * u) @ p["ws_down"]
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-4, atol=2e-5, err_msg=f"seed {SEED}")
    np.testing.assert_array_equal(np.asarray(st["load_E"]), np.bincount(ids.reshape(-1), minlength=m.n_experts))


# ---- parity with transformers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v3_nolora", "deepseek_v3_fp8"])
def test_logits_match_transformers(name):
    d = os.path.join(DATA, name)
    spec, params, scales = load_hf(d, dtype=jnp.float32)
    ref = np.load(os.path.join(d, "reference.npz"))
    f = jax.jit(lambda p, t: forward_dense(p, spec, t)[0])
    for b in range(ref["tokens"].shape[0]):
        got = np.asarray(f(params, jnp.asarray(ref["tokens"][b])))
        np.testing.assert_allclose(got, ref["logits"][b], atol=2e-5, rtol=0, err_msg=f"{name} row {b}")
    assert (scales is not None) == name.endswith("fp8")
    if scales is not None:
        # exactly the matrices the checkpoint stores as fp8 carry scales, in the tree's [in, out] block layout
        assert scales["block"] == (16, 16)
        g = scales["groups"]["mla_moe"]
        assert g["we_gate"].shape == (2, 8, 4, 2) and g["wq_b"].shape == (2, 3, 6)
        assert "wkv_a" not in g          # 40 rows do not tile into 16-blocks: stored bf16 by transformers


def test_block_dequant_semantics_and_errors():
    r = rng(5)
    q = r.normal(0, 50, (5, 7)).astype(np.float32)
    s = r.uniform(0.5, 2, (3, 3)).astype(np.float32)          # blocks of 2 rows x 3 columns, partial edges
    w = block_dequant(q, s, (2, 3))
    for i in range(5):
        for j in range(7):
            assert w[i, j] == np.float32(q[i, j] * s[i // 2, j // 3])
    with pytest.raises(WeightLoadError, match="weight_scale_inv has shape"):
        block_dequant(q, s[:2], (2, 3))


def test_fp8_checkpoint_without_scales_is_refused(tmp_path):
    import shutil
    import struct
    import json
    src = os.path.join(DATA, "deepseek_v3_fp8")
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "config.json")
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        body = f.read()
    victim = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    header = {k: v for k, v in header.items() if k != victim}       # data stays, the scale is just not listed
    hb = json.dumps(header).encode()
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + body)
    with pytest.raises(WeightLoadError, match="o_proj.weight_scale_inv"):
        load_hf(tmp_path, dtype=jnp.float32)
