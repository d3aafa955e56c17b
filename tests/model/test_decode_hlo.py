"""Fewer kernels per decode layer: RMSNorm weights folded into the next projection (tbjax/model/kinds.py fold_norms).

1. The folded forward computes the same function: against the unfolded float32 forward (the definition, itself
   checked against transformers in test_model_parity.py) with random, non-unit norm weights, for stacked and
   per-layer buffers, the XLA-dot and the decode-kernel paths, qkv bias + q/k norms, and engine decode steps.
2. The kernel count: the engine's step program (ModelRunner, one ragged program per token bucket) for a
   Llama-3.1-8B decode batch of 32 x 1k (token bucket 32, 32 sequence slots, 64-page block tables; 3 layers, the
   last whole layer is the steady state) compiled for an sm_90 GPU WITHOUT a GPU: 4 GEMMs and no separate norm
   kernel per layer with folded norms, and at most 10 kernels per layer (one attention launch: a decode-only step
   runs every row through the decode kernel). Needs the CUDA 12 PJRT plugin (not a tbjax dependency):
       pip install --no-deps --target /tmp/cuda12plugin jax-cuda12-plugin==0.11.2 jax-cuda12-pjrt==0.11.2
   ($TBJAX_CUDA12_PLUGIN_DIR, default /tmp/cuda12plugin); skipped, saying so, without it. The compile runs in
   scripts/gpu_hlo_decode.py (a subprocess, so the plugin never loads into the test process).
"""
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import byte_tokenizer, tiny_spec
from gpu_hlo_helpers import run_gpu_hlo_script
from tbjax.engine import Engine, EngineConfig
from tbjax.model import forward_hidden, init_params, lm_logits
from tbjax.model import layers as ly
from tbjax.model.kinds import fold_norms
from tbjax.model.params import split_layer_buffers
from tbjax.sampling import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_hlo_decode as ghd  # noqa: E402

MAX_KERNELS_PER_LAYER = 10          # reached with folded norms (12 unfolded), RESULTS.md, before the one-program step


def _params(spec, seed, dtype):
    """Random weights with norm weights far from 1 (a fold on the wrong axis, or none, shows)."""
    p = init_params(spec, jax.random.key(seed), "float32", std=0.1)
    rng = np.random.default_rng(seed)
    groups = {g: {k: (jnp.asarray(rng.uniform(0.3, 2.0, v.shape), jnp.float32) if k.endswith("norm") else v)
                  for k, v in gp.items()} for g, gp in p["groups"].items()}
    return jax.tree.map(lambda a: a.astype(dtype), {**p, "groups": groups})


def _logits(spec, toks, params, impl=None):
    pos = jnp.arange(toks.shape[0], dtype=jnp.int32)

    def attend(layer, q, k, v, cache):
        seg = jnp.zeros(q.shape[:1], jnp.int32)
        return ly.dense_causal_attention(q, k, v, pos, seg, scale=q.shape[-1] ** -0.5), cache
    f = jax.jit(lambda p: lm_logits(p, spec, forward_hidden(p, spec, toks, pos, attend, [None] * spec.n_layers,
                                                           kernel_impl=impl)[0], kernel_impl=impl))
    return np.asarray(f(params), np.float64)


def test_fold_norms_rewrites_the_tree():
    spec = tiny_spec()
    p = _params(spec, 0, jnp.float32)
    f = fold_norms(spec, p)
    (g,) = p["groups"]
    for norm, w in (("attn_norm", "w_qkv"), ("mlp_norm", "w_gate_up")):
        assert norm not in f["groups"][g] and norm + "_folded" in f["groups"][g]
        want = np.asarray(p["groups"][g][w], np.float64)
        n = np.asarray(p["groups"][g][norm], np.float64)
        want = want * n.reshape(n.shape + (1,) * (want.ndim - n.ndim))
        np.testing.assert_allclose(np.asarray(f["groups"][g][w]), want, rtol=1e-6)
    assert fold_norms(spec, f)["groups"][g]["w_qkv"] is f["groups"][g]["w_qkv"]      # folding twice: no-op
    np.testing.assert_array_equal(np.asarray(f["groups"][g]["w_o"]), np.asarray(p["groups"][g]["w_o"]))
    # per-layer buffers fold to the same matrices
    fs = fold_norms(spec, split_layer_buffers(p))
    for i in range(spec.n_layers):
        np.testing.assert_array_equal(np.asarray(fs["groups"][g]["w_gate_up"][i]),
                                      np.asarray(f["groups"][g]["w_gate_up"][i]))


def test_fold_norms_bad_input():
    spec = tiny_spec()
    p = _params(spec, 0, jnp.float32)
    (g,) = p["groups"]
    no_norm = {**p, "groups": {g: {k: v for k, v in p["groups"][g].items() if k != "attn_norm"}}}
    with pytest.raises(KeyError, match="attn_norm"):
        fold_norms(spec, no_norm)
    ints = {**p, "groups": {g: {**p["groups"][g], "w_qkv": p["groups"][g]["w_qkv"].astype(jnp.int8)}}}
    with pytest.raises(TypeError, match="int8"):
        fold_norms(spec, ints)
    bad = {**p, "groups": {g: {**p["groups"][g], "attn_norm": p["groups"][g]["attn_norm"][:, :-1]}}}
    with pytest.raises(ValueError, match="attn_norm"):
        fold_norms(spec, bad)
    # a tree with neither the norm nor its folded form is refused by the layer, naming both
    with pytest.raises(KeyError, match="attn_norm_folded"):
        _logits(spec, jnp.asarray([1, 2], jnp.int32), no_norm)


@pytest.mark.parametrize("kw", [{}, {"qkv_bias": True, "qk_norm": True}], ids=["llama", "bias+qknorm"])
def test_folded_forward_matches_float32(kw):
    spec = tiny_spec(**kw)
    p32 = _params(spec, 1, jnp.float32)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, spec.vocab_size, 7), jnp.int32)
    ref = _logits(spec, toks, p32)
    scale = np.abs(ref).max()
    got = _logits(spec, toks, fold_norms(spec, p32))
    assert np.abs(got - ref).max() / scale < 1e-5
    got_split = _logits(spec, toks, fold_norms(spec, split_layer_buffers(p32)))
    assert np.abs(got_split - ref).max() / scale < 1e-5
    # bf16: the folded model is as close to float32 as the unfolded one (rounding moves from activations to weights)
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p32)
    ref16w = _logits(spec, toks, jax.tree.map(lambda a: a.astype(jnp.float32), p16))
    err_unfolded = np.abs(_logits(spec, toks, p16) - ref16w).max() / scale
    err_folded = np.abs(_logits(spec, toks, fold_norms(spec, p16)) - ref16w).max() / scale
    assert err_folded < 2 * err_unfolded + 1e-3, (err_folded, err_unfolded)


def test_folded_forward_through_the_decode_kernel():
    """Decode projections through the weight-streaming kernel (interpret mode) read the folded stacks in place."""
    spec = tiny_spec(dtype="bfloat16")
    p32 = _params(spec, 2, jnp.float32)
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p32)
    toks = jnp.asarray([3, 1, 4, 1, 5], jnp.int32)
    ref16w = _logits(spec, toks, jax.tree.map(lambda a: a.astype(jnp.float32), p16))
    scale = np.abs(ref16w).max()
    err_xla = np.abs(_logits(spec, toks, p16) - ref16w).max() / scale
    err_ker = np.abs(_logits(spec, toks, fold_norms(spec, p16), impl="gpu") - ref16w).max() / scale
    assert err_ker < 2 * err_xla + 1e-3, (err_ker, err_xla)


def test_engine_decode_with_folded_norms():
    """Paged prefill + decode steps (ModelRunner's jitted step) over folded params: float32, same greedy tokens and
    log-probs as over the original params."""
    spec = tiny_spec()
    params = _params(spec, 3, jnp.float32)
    outs = {}
    for name, p in (("plain", params), ("folded", fold_norms(spec, params))):
        eng = Engine(spec, p, byte_tokenizer(), EngineConfig(num_pages=64, page_size=4, max_num_seqs=4))
        got = {0: [], 1: []}
        lps = []
        eng.add_request(0, [5, 6, 7, 8, 9], SamplingParams.greedy(6, ignore_eos=True, logprobs=1))
        eng.add_request(1, [10, 11, 12], SamplingParams.greedy(6, ignore_eos=True, logprobs=1))
        for _ in range(50):
            if not eng.has_unfinished():
                break
            for o in eng.step():
                got[o.request_id] += o.new_token_ids
                lps += [float(lp[0]) for lp in (o.logprobs or [])]
        outs[name] = (got, lps)
    assert outs["plain"][0] == outs["folded"][0] and all(len(v) == 6 for v in outs["plain"][0].values())
    assert len(outs["plain"][1]) == 12
    np.testing.assert_allclose(outs["folded"][1], outs["plain"][1], atol=1e-4)


SYNTH = """HloModule m

%attn (p0: bf16[2,4], p1: s32[8]) -> bf16[2,4] {
  %p0 = bf16[2,4]{1,0} parameter(0)
  ROOT %cc = bf16[2,4]{1,0} custom-call(%p0), custom_call_target="mosaic_gpu_v2"
}

%norm (p0: bf16[2,4]) -> bf16[2,4] {
  %r = f32[2]{0} reduce(%x, %c), dimensions={1}, to_apply=%add
}

%count (p0: s32[3]) -> s32[2] {
  %r = s32[2]{0} reduce(%x, %c), dimensions={1}, to_apply=%add_s32
}

ENTRY %main (a: bf16[2,4], w: bf16[4,4]) -> bf16[2,4] {
  %a = bf16[2,4]{1,0} parameter(0)
  %n0 = bf16[2,4]{1,0} fusion(%a), kind=kCustom, calls=%norm, backend_config={"fusion_backend_config":{"kind":"__triton","block_level_fusion_config":{}}}
  %g0 = f32[2,4]{1,0} fusion(%n0, %w), kind=kCustom, calls=%gemm_fusion_dot_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %at0 = bf16[2,4]{1,0} fusion(%g0, %i), kind=kCustom, calls=%attn, metadata={op_name="jit(body)/jit(paged_decode_attention_gpu)/mpmd_map"}
  %cnt0 = s32[2]{0} fusion(%i), kind=kCustom, calls=%count, metadata={op_name="jit(body)/jit(paged_attention_gpu)/jit(searchsorted)/reduce_sum"}, backend_config={"fusion_backend_config":{"kind":"__triton","block_level_fusion_config":{}}}
  %rg0 = bf16[2,4]{1,0} fusion(%g0, %cnt0), kind=kCustom, calls=%attn
  %b0 = bf16[2,4]{1,0} bitcast(%at0)
  %add0 = bf16[2,4]{1,0} fusion(%a, %b0, %rg0), kind=kLoop, calls=%fused_add.3, metadata={op_name="jit(body)/add"}
  %w0 = (s32[], f32[2]{0}, f32[2]{0}, s32[2]{0}, s32[2]{0}, /*index=5*/s32[2]{0}) while(%t), condition=%c, body=%bd
  %at1 = bf16[2,4]{1,0} fusion(%add0, %i), kind=kCustom, calls=%attn
  %rg1 = bf16[2,4]{1,0} fusion(%add0, %cnt0), kind=kCustom, calls=%attn
  ROOT %t = (bf16[2,4]) tuple(%at1)
}
"""


def test_analyse_counts_the_kernels_of_a_layer():
    r = ghd.analyse(SYNTH, 2)
    assert r["total_kernels"] == 9                       # bitcast, tuple, parameter launch nothing
    # a layer = its first attention launch .. the next layer's first: two attention kernels (decode + ragged), the
    # ragged kernel's integer count (not a norm), the add, a while loop (a tuple shape with /*index=5*/ comments)
    assert r["kernels_per_layer"] == 5, r["layers"]
    assert r["kinds_per_layer"] == {"attention (Mosaic GPU custom call)": 2, "loop fusion (add0)": 1, "while": 1,
                                    "triton block-level fusion (integer reduce)": 1}
    assert r["sources_per_layer"] == {"paged_decode_attention_gpu": 1, "paged_attention_gpu": 1, "(step)": 3}
    assert [k["kind"] for k in r["head"]] == ["triton block-level fusion (normalization)", "gemm fusion (triton)"]
    assert [k["name"] for k in r["tail"]] == ["at1", "rg1"]
    with pytest.raises(RuntimeError, match="expected a multiple of 3 anchor kernels"):
        ghd.analyse(SYNTH, 3)
    thunks = ("000: kCommandBuffer [source | next=002 (1)]\n    001: kCustomKernel [source | sink] gemm_fusion_dot\n"
              "002: kDynamicSliceFusion [prev=000 (1) | next=000 (1)] params=4\n    003: kCustomCall [source | sink]\n"
              "000: kCommandBuffer [prev=002 (1) | sink]\n    004: kCustomKernel [source | sink] loop_add_fusion\n")
    assert ghd.thunk_summary(thunks) == {"top_level": {"kCommandBuffer": 2, "kDynamicSliceFusion": 1},
                                         "in_command_buffers": 2}


@pytest.fixture(scope="module")
def folded_decode_step():
    (r,) = run_gpu_hlo_script("gpu_hlo_decode.py", "--layers", "3", "--variants", "stacked:folded", "--no-thunks",
                              "--quiet")["variants"]
    assert (r["bucket"], r["sequence_slots"], r["pages_per_seq"]) == (32, 32, 64), r
    return r


def _schedule(r):
    return [f"{k['name']} [{k['kind']}{', ' + k['src'] if k['src'] else ''}]" for k in r["layers"][-1]]


def test_decode_step_layer_kinds_on_gpu(folded_decode_step):
    """What folding bought holds in the one-program step: the four projections are the layer's only GEMMs and no
    norm runs as its own kernel (it rides in the residual-add fusion); attention is the step's two Mosaic GPU
    kernels (step_attention: decode kernel + ragged kernel) or one."""
    r = folded_decode_step
    kinds = r["kinds_per_layer"]
    assert kinds.get("gemm fusion (triton)") == 4, (kinds, _schedule(r))
    assert not any("normalization" in k for k in kinds), f"a separate norm kernel is back: {kinds}"
    assert 1 <= kinds.get("attention (Mosaic GPU custom call)", 0) <= 2, (kinds, _schedule(r))


def test_decode_step_kernels_per_layer_on_gpu(folded_decode_step):
    """A decode-only step is one attention launch per layer (step_attention sends every row of a small step through
    the decode kernel): the layer's kernel count stays at the bound it had before the one-program step (the step
    with both kernels, a q transpose, a select and a scatter had 14)."""
    r = folded_decode_step
    assert r["kernels_per_layer"] <= MAX_KERNELS_PER_LAYER, \
        f"{r['kernels_per_layer']} kernels per decode layer (at most {MAX_KERNELS_PER_LAYER}): {r['kinds_per_layer']}" \
        f"; by source {r['sources_per_layer']}; schedule {_schedule(r)}"


def _elements(shape: str) -> int:
    """Elements of an HLO array shape 'bf16[32,4096]{1,0}' (0 for tuples and scalars)."""
    m = re.match(r"\w+\[([\d,]+)\]", shape)
    return int(np.prod([int(d) for d in m.group(1).split(",")])) if m else 0


@pytest.mark.parametrize("weight_dtype", ["fp8", "fp8-block"])
def test_quantized_weights_are_read_in_their_bytes_on_gpu(weight_dtype):
    """fp8 weights in the GPU step (Llama-3.1-8B decode at 32 x 1k, sm_90, compiled without a GPU): no kernel writes
    a dequantized copy of a weight (5 bytes moved per weight instead of 1: the measured fp8 step took 2.1x the bf16
    one), and each projection stays one GEMM. Per-channel scales multiply the GEMM's result; 128 x 128 block scales
    multiply x once per column block (tbjax/model/linear.py channel_dot / block_dot)."""
    (r,) = run_gpu_hlo_script("gpu_hlo_decode.py", "--layers", "2", "--variants", "split", "--no-thunks", "--quiet",
                              "--weight-dtype", weight_dtype)["variants"]
    D, F, V, qkv = 4096, 14336, 128256, 4096 + 2 * 1024
    weight_sizes = {D * qkv, D * D, D * 2 * F, F * D, D * V}
    kernels = [k for L in r["layers"] for k in L] + r["head"] + r["tail"]
    copies = [k for k in kernels if _elements(k["shape"]) in weight_sizes]
    assert not copies, f"{weight_dtype}: weight-sized kernel outputs (a dequantized copy): {copies}"
    assert r["kinds_per_layer"].get("gemm fusion (triton)") == 4, (r["kinds_per_layer"], _schedule(r))


def test_decode_program_runs_one_attention_kernel_per_layer_on_gpu():
    """A decode-only step of 128 sequences (token bucket 128 > 64, the bucket that holds max_num_seqs) runs its
    bucket's decode program (runner decode_programs): one Mosaic attention call per layer, no select / transpose,
    against two attention calls plus the merge in the same bucket's mixed program (Llama-3.1-8B shapes, sm_90,
    compiled without a GPU)."""
    got = {}
    for program in ("decode", "mixed"):
        (got[program],) = run_gpu_hlo_script("gpu_hlo_decode.py", "--layers", "3", "--batch", "128", "--ctx", "640",
                                             "--variants", "split", "--no-thunks", "--quiet",
                                             "--program", program)["variants"]
    dec, mix = got["decode"], got["mixed"]
    assert dec["bucket"] == mix["bucket"] == 128 and dec["decode_program"] and not mix["decode_program"]
    attn = "attention (Mosaic GPU custom call)"
    assert dec["kinds_per_layer"][attn] == 1, dec["kinds_per_layer"]
    assert mix["kinds_per_layer"][attn] == 2, mix["kinds_per_layer"]
    assert "_paged_attention_gpu" not in dec["sources_per_layer"], dec["sources_per_layer"]
    assert dec["kernels_per_layer"] <= mix["kernels_per_layer"] - 3, (dec["kinds_per_layer"], mix["kinds_per_layer"])
