"""TPU path of the decode matmuls: a documented fallback to XLA, not a Mosaic TPU kernel.

Why a fallback and not a kernel: on TPU, XLA already fuses the fp8 -> bf16 dequantization
(convert, scale multiply) into the dot's operand read, so the weights stream from HBM once in
their stored dtype, and it reads a dynamically indexed layer of stacked weights in place.
No TPU was available to measure whether a Mosaic TPU kernel would beat that, so none is
claimed. The math matches the GPU kernel's: weights dequantized to the activation dtype (block
scales folded in, per-channel scales applied to the float32 product), float32 accumulation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.matmul.reference import BLOCK, is_fp8


def _take_layer(a, layer):
    if a is None or layer is None:
        return a
    return jax.lax.dynamic_index_in_dim(a, layer, axis=0, keepdims=False)


def _weights_for_dot(w_DF, w_scale, dtype):
    """Weights in `dtype` for the dot, and the per-channel scale still to apply (or None)."""
    if not is_fp8(w_DF.dtype):
        return w_DF.astype(dtype), None
    if w_scale is None:
        return w_DF.astype(dtype), None
    if w_scale.ndim == 1:
        return w_DF.astype(dtype), w_scale
    d, f = w_DF.shape
    s = jnp.repeat(jnp.repeat(w_scale, BLOCK, axis=0), BLOCK, axis=1)[:d, :f]
    return (w_DF.astype(jnp.float32) * s).astype(dtype), None


def _product(x_TD, w_DF, w_scale):
    dt = x_TD.dtype if jnp.dtype(w_DF.dtype).itemsize <= jnp.dtype(x_TD.dtype).itemsize else w_DF.dtype
    w, s_F = _weights_for_dot(w_DF, w_scale, dt)
    y = jnp.dot(x_TD.astype(dt), w, preferred_element_type=jnp.float32)
    return y if s_F is None else y * s_F[None, :]


def decode_matmul_xla(x_TD, w_DF, *, w_scale=None, layer=None):
    """y = x @ dequant(w) through one XLA dot (float32 accumulation)."""
    w, s = _take_layer(w_DF, layer), _take_layer(w_scale, layer)
    return _product(x_TD, w, s).astype(x_TD.dtype)


def gate_up_silu_xla(x_TD, w_gate_DF, w_up_DF, *, gate_scale=None, up_scale=None, layer=None):
    g = _product(x_TD, _take_layer(w_gate_DF, layer), _take_layer(gate_scale, layer))
    u = _product(x_TD, _take_layer(w_up_DF, layer), _take_layer(up_scale, layer))
    return (jax.nn.silu(g) * u).astype(x_TD.dtype)
