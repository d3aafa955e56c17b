"""Quantizing on the device (`quant.quantize_on_device`, `quantize_tree(on_device=True)`) gives exactly the codes,
scales and zeros of the host quantizer (`quant.quantize`, numpy float32 math, then `HostQuant.to_device`), for every
format, on stacked matrices, gate/up pairs and shapes whose blocks do not divide them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import tiny_spec
from tbjax.model import init_params
from tbjax.model import quant as qz

SHAPES = [((64, 96), 0), ((3, 80, 200), 1), ((2, 48, 2, 130), 1), ((130, 33), 0), ((40, 7), 1)]


@pytest.mark.parametrize("fmt", qz.FORMATS)
@pytest.mark.parametrize("shape,in_axis", SHAPES)
def test_on_device_equals_the_host_quantizer(fmt, shape, in_axis):
    w = np.random.default_rng(hash(shape) % 2**32).normal(0, 0.05, shape).astype(np.float32)
    w.flat[::17] = 0.0                                             # zeros (and, below, an all-zero block)
    w[(slice(0, 2),) * (len(shape) - 1)] = 0.0
    want = qz.quantize(w, fmt, in_axis=in_axis).to_device(jnp.bfloat16)
    got = qz.quantize_on_device(jnp.asarray(w), fmt, in_axis, jnp.bfloat16)
    assert (got.fmt, got.block, got.shape, got.dtype) == (want.fmt, want.block, want.shape, want.dtype)
    for a, b in zip(got.leaves(), want.leaves(), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype == qz.FP8 else np.asarray(a),
                                      np.asarray(b).view(np.uint8) if b.dtype == qz.FP8 else np.asarray(b))


def test_quantize_tree_on_device_equals_the_host_tree():
    spec = tiny_spec(d_model=96, ffn_dim=80, vocab_size=200, dtype="bfloat16")
    params = init_params(spec, jax.random.key(3))
    for fmt in ("fp8", "int4"):
        host = qz.quantize_tree(params, fmt)
        dev = qz.quantize_tree(params, fmt, on_device=True)
        assert jax.tree.structure(host) == jax.tree.structure(dev)
        for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(dev), strict=True):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    with pytest.raises(qz.QuantError, match="int3"):
        qz.quantize_on_device(jnp.zeros((4, 4)), "int3", 0)
