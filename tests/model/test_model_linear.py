"""The model's decode path through the weight-streaming matmul kernel (GPU kernel in interpret mode on CPU).

References: the same forward in float32 with XLA dots (the definition), and the bf16 XLA-dot forward. The kernel path
must be as close to float32 as the XLA path is, must really run the kernel (counted), and must read the stacked
weights with a layer index (never a sliced copy).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import byte_tokenizer, tiny_spec
from pallas_kernels.matmul import gpu as mm_gpu
from tbjax.engine import Engine, EngineConfig
from tbjax.model import forward_hidden, init_params, lm_logits
from tbjax.model.params import split_layer_buffers
from tbjax.model import layers as ly
from tbjax.model.linear import kernel_impl_for
from tbjax.sampling import SamplingParams


def _spec(**kw):
    return tiny_spec(dtype="bfloat16", **kw)


def _dense_attend(positions):
    def attend(layer, q, k, v, cache):
        seg = jnp.zeros(q.shape[:1], jnp.int32)
        return ly.dense_causal_attention(q, k, v, positions, seg, scale=q.shape[-1] ** -0.5), cache
    return attend


def _logits(spec, toks, params, impl):
    """float64 last-layer logits of a whole-prompt forward with dense attention; impl None = XLA dots. Jitted:
    eager op-by-op dispatch around the GPU interpreter's callbacks deadlocked once."""
    pos = jnp.arange(toks.shape[0], dtype=jnp.int32)
    att = _dense_attend(pos)
    f = jax.jit(lambda p: lm_logits(p, spec, forward_hidden(p, spec, toks, pos, att, [None] * spec.n_layers,
                                                           kernel_impl=impl)[0], kernel_impl=impl))
    return np.asarray(f(params), np.float64)


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    real = mm_gpu.raw_partials

    def spy(x_TD, ws, scales, **kw):
        calls.append((tuple(w.shape for w in ws), kw.get("layer")))
        return real(x_TD, ws, scales, **kw)
    monkeypatch.setattr(mm_gpu, "raw_partials", spy)
    return calls


def test_forward_through_the_kernel_matches_float32(kernel_calls):
    spec = _spec()
    p32 = init_params(spec, jax.random.key(3), "float32", std=0.1)
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p32)
    T = 5
    toks = jnp.asarray(np.random.default_rng(0).integers(0, spec.vocab_size, T), jnp.int32)
    run = functools.partial(_logits, spec, toks)

    ref = run(p32, None)                               # float32 weights and math
    ref16w = run(jax.tree.map(lambda a: a.astype(jnp.float32), p16), None)   # float32 math, bf16-rounded weights
    xla16 = run(p16, None)
    n0 = len(kernel_calls)
    ker16 = run(p16, "gpu")
    # 2 layers x (qkv, o, gate+up fused, down) + lm_head, each one kernel launch reading a stack with layer=i
    assert len(kernel_calls) - n0 == spec.n_layers * 4 + 1
    stacked = [c for c in kernel_calls[n0:] if c[1] is not None]
    assert len(stacked) == spec.n_layers * 4 and all(len(s[0][0]) == 3 for s in stacked)
    scale = np.abs(ref16w).max()
    err_xla = np.abs(xla16 - ref16w).max() / scale
    err_ker = np.abs(ker16 - ref16w).max() / scale
    assert err_ker < 3e-2, err_ker
    assert err_ker < 2 * err_xla + 1e-3, (err_ker, err_xla)
    assert np.abs(ref - ref16w).max() / scale < 5e-2      # sanity: the bf16 rounding of weights is small
    # per-layer weight buffers (split_layer_buffers): same launches, each reading its layer's own buffer
    n1 = len(kernel_calls)
    ker_split = run(split_layer_buffers(p16), "gpu")
    split_calls = [c for c in kernel_calls[n1:] if c[1] is not None]
    assert len(split_calls) == spec.n_layers * 4 and all(c[0][0][0] == 1 and c[1] == 0 for c in split_calls)
    assert np.abs(ker_split - ref16w).max() / scale < 3e-2
    assert np.abs(run(split_layer_buffers(p16), None) - ref16w).max() / scale < 2 * err_xla + 1e-3


def test_engine_decode_steps_use_the_kernel(kernel_calls):
    spec = _spec()
    params = init_params(spec, jax.random.key(1), "bfloat16", std=0.25)
    outs = {}
    for impl in ("xla", "kernel"):
        eng = Engine(spec, params, byte_tokenizer(), EngineConfig(num_pages=64, page_size=4, max_num_seqs=4,
                                                                   matmul_impl=impl))
        n0 = len(kernel_calls)
        got = {0: [], 1: []}
        eng.add_request(0, [5, 6, 7, 8, 9], SamplingParams.greedy(6, ignore_eos=True))
        eng.add_request(1, [10, 11, 12], SamplingParams.greedy(6, ignore_eos=True))
        for _ in range(50):
            if not eng.has_unfinished():
                break
            for o in eng.step():
                got[o.request_id] += o.new_token_ids
        outs[impl] = [got[0], got[1]]
        assert all(len(g) == 6 for g in outs[impl])
        assert (len(kernel_calls) > n0) == (impl == "kernel")
    # Prompts are prefilled with XLA dots in both; decode steps differ only in bf16 summation order.
    same = sum(a == b for x, y in zip(outs["xla"], outs["kernel"]) for a, b in zip(x, y))
    assert same >= 10, outs


def test_matmul_impl_names_are_checked():
    assert kernel_impl_for("xla", True) is None
    assert kernel_impl_for("kernel", False) is None       # prefill/mixed steps always use XLA dots
    assert kernel_impl_for("kernel", True) == "gpu"
    assert kernel_impl_for("auto", True) is None          # CPU backend
    with pytest.raises(ValueError, match="matmul_impl"):
        kernel_impl_for("cublas", True)
    with pytest.raises(ValueError, match="matmul_impl"):
        Engine(_spec(), init_params(_spec(), jax.random.key(0), "bfloat16"), byte_tokenizer(),
               EngineConfig(num_pages=16, matmul_impl="fast"))


def test_shapes_the_kernel_cannot_take_use_xla_dots(kernel_calls):
    """ffn_dim 80 (gate/up 160 wide) is not a multiple of the kernel's 64-wide tiles: gate/up/down fall back to XLA
    dots (not to the float32 reference, not to an error) while qkv, o and the lm_head still go to the kernel."""
    spec = _spec(ffn_dim=80)
    p32 = init_params(spec, jax.random.key(5), "float32", std=0.1)
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p32)
    toks = jnp.asarray([1, 2, 3], jnp.int32)
    run = functools.partial(_logits, spec, toks)

    ref = run(jax.tree.map(lambda a: a.astype(jnp.float32), p16), None)
    n0 = len(kernel_calls)
    got = run(p16, "gpu")
    shapes = [c[0][0][-2:] for c in kernel_calls[n0:]]
    assert sorted(set(shapes)) == [(64, 64), (64, 128), (64, 256)]     # o, qkv, lm_head; no FFN matrix
    assert len(shapes) == 2 * spec.n_layers + 1
    assert np.abs(got - ref).max() / np.abs(ref).max() < 3e-2
