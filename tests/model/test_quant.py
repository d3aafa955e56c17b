"""Weights resident in their stored precision (tbjax/model/quant.py, linear.matmul, cpu_qgemv): GGUF conversions
against the `gguf` package's own dequantization (exact), every format's matmul against a float64 numpy reference,
quantized forwards against the forward over the dequantized weights (tiny model, the default model, transformers'
logits for the fp8 DeepSeek-V3), the default model's resident bytes and greedy tokens, the decode mesh, orbax, and
the --weight-dtype setting.
"""
import os
import types

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharding.mesh import DecodeLayout, make_mesh
from tbjax.default_model import default_model_path
from tbjax.model import cpu_qgemv, forward_dense
from tbjax.model import mesh_forward as mf
from tbjax.model import quant as qz
from tbjax.model.linear import dequant_dot, matmul
from tbjax.model.transformer import tied_logits
from tbjax.weights import checkpoint, load_model
from tbjax.weights.gguf_file import GGUFFile, host_quant
from tbjax.weights.hf_names_moe import load_hf

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "hf_moe")
SEED = int.from_bytes(os.urandom(4), "little")


def rng(k=0):
    return np.random.default_rng(SEED + k)


# ---- GGUF conversions: exactly gguf's own dequantization ----------------------------------------------------------
def _fake_tensor(qtype, rows, cols, raw):
    """What host_quant reads of a GGUFReader tensor: type, shape (ggml order: [cols, rows]) and the raw bytes."""
    return types.SimpleNamespace(tensor_type=qtype, shape=np.array([cols, rows]), data=raw)


def _random_blocks(qtype, rows, cols, r):
    """Valid raw blocks of a k-quant type: random bytes with finite float16 super-block scales."""
    bsize, tsize = gguf.GGML_QUANT_SIZES[qtype]
    raw = r.integers(0, 256, (rows, cols // bsize, tsize), dtype=np.uint8)
    f16 = lambda a: np.asarray(a, np.float16).view(np.uint8).reshape(*a.shape, 2)   # noqa: E731
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        raw[..., 0:2] = f16(r.uniform(1e-3, 2e-2, raw.shape[:2]))
        raw[..., 2:4] = f16(r.uniform(1e-3, 2e-2, raw.shape[:2]))
    else:                                                              # Q6_K: d is the last two bytes
        raw[..., 208:210] = f16(r.uniform(1e-3, 2e-2, raw.shape[:2]))
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qname", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_gguf_conversion_equals_gguf_dequantize(qname):
    qtype = gguf.GGMLQuantizationType[qname]
    r = rng(1)
    rows, cols = 24, 512
    if qname in ("Q4_K", "Q6_K"):
        raw = _random_blocks(qtype, rows, cols, r)
    else:
        raw = gguf.quants.quantize(r.normal(0, 1, (rows, cols)).astype(np.float32), qtype)
    h = host_quant(_fake_tensor(qtype, rows, cols, raw))
    ref = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    assert h.fmt == ("int8" if qname in ("Q8_0", "Q6_K") else "int4")
    np.testing.assert_array_equal(h.dequantize(), ref)
    # on the device, in the tree's [in, out] orientation, stacked, packed: still exactly gguf's values
    w = qz.stack([h.T, h.T], 0).to_device(jnp.float32)
    np.testing.assert_array_equal(np.asarray(qz.dequantize(w))[1], ref.T)


def test_default_model_tensors_convert_exactly_and_fit_in_100_mb(smollm_auto_bf16):
    g = GGUFFile(default_model_path())
    for name in ("token_embd.weight", "blk.0.ffn_down.weight", "blk.7.attn_k.weight"):
        np.testing.assert_array_equal(g.quantized(name).dequantize(), g.tensor(name), err_msg=name)
    spec, params, pb, _ = smollm_auto_bf16             # weight_dtype auto: Q4_1 -> int4, Q8_0 -> int8
    rb = qz.resident_bytes(params)
    print("default model resident MB (auto):", {k: round(v / 1e6, 1) for k, v in rb.items()},
          "bf16:", round(qz.resident_bytes(pb)["total"] / 1e6, 1))
    assert qz.resident_bytes(pb)["total"] > 260e6
    assert rb["total"] < 100e6 and rb["int4"] > 60e6 and rb["int8"] > 25e6
    assert isinstance(params["embed"], qz.QuantizedWeight) and params["embed"].fmt == "int8"
    assert params["groups"]["gqa_dense"]["w_gate_up"].fmt == "int4"


@pytest.fixture(scope="module")
def smollm_auto_bf16():
    spec, pq, tok = load_model(None, progress=False)                          # int4 / int8 resident, bf16 compute
    _, pb, _ = load_model(None, progress=False, weight_dtype="bf16")
    return spec, pq, pb, tok


# ---- matmuls against float64 --------------------------------------------------------------------------------------
def _f64_ref(x, h: qz.HostQuant):
    w = h.dequantize().astype(np.float64)
    return np.asarray(x, np.float64) @ w.reshape(w.shape[0], -1)


@pytest.mark.parametrize("fmt,group,shape", [("int8", None, (192, 96)), ("int8", 32, (128, 2, 48)),
                                             ("int4", 32, (192, 96)), ("int4", 32, (128, 2, 48)),
                                             ("fp8", None, (256, 160)),          # per channel: channel_dot
                                             ("fp8", 128, (256, 2, 256)),        # 128 x 128 blocks: block_dot
                                             ("fp8", 128, (256, 160))])          # blocks not tiling: dequant_dot
@pytest.mark.parametrize("T", [2, 5, 24, 80])
def test_matmul_against_float64(fmt, group, shape, T):
    r = rng(2)
    h = qz.quantize(r.normal(0, 1, shape).astype(np.float32), fmt, in_axis=0, group=group)
    x = jnp.asarray(r.normal(0, 1, (T, shape[0])), jnp.bfloat16)
    ref = _f64_ref(x, h)
    scale = np.abs(ref).max()
    for dt, tol in ((jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)):
        w = h.to_device(dt)
        got = np.asarray(jax.jit(lambda x, w: matmul(x.astype(dt), w, jnp.float32))(x, w)).reshape(T, -1)
        # float32 compute: float32 rounding only; bf16 compute: the weights rounded to bf16 (XLA path) or not (kernel)
        assert np.abs(got - ref).max() <= tol * scale, (fmt, dt, T)
    if fmt != "fp8" and T <= cpu_qgemv.MAX_T:        # the CPU kernel is the path taken, next to the XLA one
        assert cpu_qgemv.takes_cols(x, h.to_device(jnp.bfloat16))
        xla = np.asarray(dequant_dot(x.astype(jnp.float32), h.to_device(jnp.float32), jnp.float32)).reshape(T, -1)
        assert np.abs(xla - ref).max() <= 2e-6 * scale


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_row_scaled_tied_head_against_float64(fmt):
    """A tied table quantized per row (one scale per vocabulary entry): the head scales the result, reading the codes
    once (linear.row_scaled), against float64 math over the dequantized table."""
    from tbjax.model.linear import row_scaled
    r = rng(4)
    V, D = 300, 64
    h = qz.quantize(r.normal(0, 1, (V, D)).astype(np.float32), fmt, in_axis=1)
    assert h.block == (1, D)
    x = jnp.asarray(r.normal(0, 1, (3, D)), jnp.float32)
    ref = np.asarray(x, np.float64) @ h.dequantize().astype(np.float64).T
    w = h.to_device(jnp.float32)
    if fmt == "fp8":                                 # (int8 rows go to the CPU kernel first when it is built)
        assert row_scaled(x, w)
    got = np.asarray(jax.jit(tied_logits)(x, w))
    assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_tied_head_and_embedding_gather_against_float64(fmt):
    r = rng(3)
    V, D = 1000, 128
    h = qz.quantize(r.normal(0, 1, (V, D)).astype(np.float32), fmt, in_axis=1, group=32)
    w = h.to_device(jnp.float32)
    x = jnp.asarray(r.normal(0, 1, (2, D)), jnp.float32)
    ref = np.asarray(x, np.float64) @ h.dequantize().astype(np.float64).T
    assert cpu_qgemv.takes_rows(x, w)
    got = np.asarray(jax.jit(tied_logits)(x, w))
    assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()
    ids = jnp.asarray([0, 17, 999, 17], jnp.int32)
    # (XLA may fuse q * s + z into one FMA: 1 ulp from numpy's two roundings)
    np.testing.assert_allclose(np.asarray(jax.jit(qz.take_rows)(w, ids)), h.dequantize()[np.asarray(ids)],
                               rtol=1e-6, atol=1e-6)


def test_stacked_view_reads_the_layer_without_a_copy():
    r = rng(4)
    h = qz.quantize(r.normal(0, 1, (3, 64, 96)).astype(np.float32), "int4", in_axis=1)
    w = h.to_device(jnp.float32)
    x = jnp.asarray(r.normal(0, 1, (2, 64)), jnp.float32)
    f = jax.jit(lambda x, w: matmul(x, w[2]))
    np.testing.assert_allclose(np.asarray(f(x, w)), np.asarray(x) @ h.dequantize()[2], rtol=2e-5, atol=2e-5)
    hlo = f.lower(x, w).compile().as_text()
    assert "custom-call" in hlo and "slice" not in hlo.split("custom-call")[0].split("ENTRY")[-1]


# ---- forwards -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ds_fp8():
    return load_hf(os.path.join(DATA, "deepseek_v3_fp8"), dtype=jnp.float32, weight_dtype="auto")


def test_fp8_checkpoint_resident_in_fp8_matches_transformers(ds_fp8):
    spec, params, _ = ds_fp8
    g = params["groups"]["mla_moe"]
    assert g["we_gate"].fmt == "fp8" and g["we_gate"].block == (1, 1, 16, 16) and g["wq_b"].q.dtype == qz.FP8
    assert not isinstance(g["wkv_a"], qz.QuantizedWeight)             # stored bf16 in the checkpoint
    ref = np.load(os.path.join(DATA, "deepseek_v3_fp8", "reference.npz"))
    f = jax.jit(lambda p, t: forward_dense(p, spec, t)[0])
    for b in range(ref["tokens"].shape[0]):
        got = np.asarray(f(params, jnp.asarray(ref["tokens"][b])))
        np.testing.assert_allclose(got, ref["logits"][b], atol=2e-5, rtol=0)
    fp8_bytes = qz.resident_bytes(params)["fp8"]
    _, pf, _ = load_hf(os.path.join(DATA, "deepseek_v3_fp8"), dtype=jnp.float32)
    assert fp8_bytes < 0.4 * qz.resident_bytes(pf)["float"]


@pytest.mark.parametrize("fmt,T", [("int8", 6), ("int4", 20), ("fp8", 6)])
def test_quantized_forward_equals_dequantized_forward(fmt, T):
    """A float checkpoint quantized at load: the forward over the quantized tree equals the forward over the same
    weights dequantized (float32 compute; the CPU kernel takes T <= 8, XLA dots the rest)."""
    spec, pq, _ = load_hf(os.path.join(DATA, "deepseek_v3"), dtype=jnp.float32, weight_dtype=fmt)
    assert qz.weight_formats(pq).get(fmt, 0) > 5
    pd = jax.tree.map(lambda w: qz.dequantize(w) if isinstance(w, qz.QuantizedWeight) else w, pq,
                      is_leaf=lambda x: isinstance(x, qz.QuantizedWeight))
    f = jax.jit(lambda p, t: forward_dense(p, spec, t)[0])
    t = jnp.asarray(rng(5).integers(0, spec.vocab_size, T), jnp.int32)
    a, b = np.asarray(f(pq, t)), np.asarray(f(pd, t))
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max(), (fmt, T)


def test_quantized_mesh_forward_equals_one_device(ds_fp8):
    spec, params, scales = ds_fp8                # fp8 resident: routed experts split over ep as fp8 codes + scales
    ref = np.load(os.path.join(DATA, "deepseek_v3_fp8", "reference.npz"))
    B, S = ref["tokens"].shape
    tok, pos, seg = ref["tokens"].reshape(-1), np.tile(np.arange(S), B), np.repeat(np.arange(B), S)
    tok, pos, seg = (np.tile(a, 4) for a in (tok, pos, seg))
    seg = seg + np.repeat(np.arange(4), B * S) * B
    want = np.tile(ref["logits"].reshape(B * S, -1), (4, 1))
    for dp, ep, lay in ((4, 2, DecodeLayout()), (8, 1, DecodeLayout(attn_wire="fp8"))):
        mesh = make_mesh(dp=dp, ep=ep)
        # fp8 wire: the checkpoint's fp8 attention matrices travel with their own scales (lossless)
        plan = mf.make_plan(spec, mesh, lay, dtype=jnp.float32, fp8_scales=scales)
        mp = mf.mesh_params(params, plan, mesh)
        we = mp["groups"]["mla_moe"]["we_gate"]
        assert isinstance(we, qz.QuantizedWeight)
        assert {s.data.shape[1] for s in we.q.addressable_shards} == {spec.moe.n_experts // (dp * ep)}
        logits, _ = mf.make_forward(plan, mesh, mp)(mp, tok, pos, seg)
        np.testing.assert_allclose(np.asarray(logits), want, atol=5e-5, rtol=0, err_msg=f"dp={dp} ep={ep}")


def test_default_model_forward_and_greedy_tokens_agree_with_bf16(smollm_auto_bf16):
    spec, pq, pb, tok = smollm_auto_bf16
    # the float32 forward over the int4/int8 weights equals the float32 forward over their dequantized values
    pq32 = jax.tree.map(lambda w: w.astype(jnp.float32) if isinstance(w, qz.QuantizedWeight) else
                        w.astype(jnp.float32), pq, is_leaf=lambda x: isinstance(x, qz.QuantizedWeight))
    pd32 = jax.tree.map(lambda w: qz.dequantize(w, jnp.float32) if isinstance(w, qz.QuantizedWeight) else
                        w.astype(jnp.float32), pq, is_leaf=lambda x: isinstance(x, qz.QuantizedWeight))
    f = jax.jit(lambda p, t: forward_dense(p, spec, t)[0])
    ids = jnp.asarray(tok.encode("The capital of France is"), jnp.int32)
    a, b = np.asarray(f(pq32, ids)), np.asarray(f(pd32, ids))
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    # greedy tokens of the int4/int8 model (bf16 compute, 8-row forwards: the CPU kernels' path) vs the bf16 model,
    # teacher-forced: a token the bf16 model would not pick must be a near tie for it (within 1% of its logit range)
    L = 8
    fwd = jax.jit(lambda p, t: forward_dense(p, spec, t)[0])
    mismatches = 0
    for prompt in ["The capital of France is", "def fibonacci(n):", "Water boils at"]:
        seq = tok.encode(prompt)[:5]
        n0 = len(seq)
        while len(seq) < L:
            lg = np.asarray(fwd(pq, jnp.asarray(seq + [0] * (L - len(seq)), jnp.int32)))
            seq.append(int(lg[len(seq) - 1].argmax()))
        lb = np.asarray(fwd(pb, jnp.asarray(seq, jnp.int32)))
        for i in range(n0, L):
            row, t = lb[i - 1], seq[i]
            if row.argmax() != t:
                mismatches += 1
                assert row.max() - row[t] <= 0.01 * (row.max() - row.min()), (prompt, i)
    assert mismatches <= 1


# ---- checkpoints, settings ------------------------------------------------------------------------------------------
def test_orbax_checkpoint_saves_the_quantized_form(tmp_path, ds_fp8):
    spec, params, _ = ds_fp8
    pq = qz.quantize_tree(params, "int4")          # fp8 matrices -> int4, float ones quantized
    checkpoint.save(str(tmp_path / "ck"), spec, pq)
    spec2, back = checkpoint.restore(str(tmp_path / "ck"))
    la, lb = jax.tree_util.tree_flatten(pq, is_leaf=lambda x: isinstance(x, qz.QuantizedWeight))
    ra, rb = jax.tree_util.tree_flatten(back, is_leaf=lambda x: isinstance(x, qz.QuantizedWeight))
    assert lb == rb
    for x, y in zip(la, ra):
        for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
            assert u.dtype == v.dtype
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert qz.resident_bytes(back)["int4"] == qz.resident_bytes(pq)["int4"] > 0


def test_bad_weight_dtype_is_refused_clearly():
    with pytest.raises(qz.QuantError, match="--weight-dtype must be one of auto, bf16, fp8, int8, int4"):
        load_model(None, progress=False, weight_dtype="int3")
    from tbjax.generate import main
    with pytest.raises(SystemExit):
        main(["hi", "--weight-dtype", "q4"])
    from serving.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--weight-dtype", "nf4"])
    assert build_parser().parse_args(["--weight-dtype", "int8"]).weight_dtype == "int8"
