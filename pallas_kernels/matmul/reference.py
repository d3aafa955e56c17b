"""Pure-jnp definition of the decode matmuls: y = x @ dequant(w), and silu(x @ wg) * (x @ wu).

This module is the specification the kernels are tested against. Weights are stored
[D in, F out]. fp8 (float8_e4m3fn) weights carry float32 scales in one of two layouts
(DeepSeek's `weight_scale_inv` convention, real = stored * scale):

* per output channel: scale_F of shape [F];
* 128x128 blocks:      scale of shape [ceil(D/128), ceil(F/128)].

The reference dequantizes to float32 exactly, multiplies in float32 (HIGHEST precision) and
casts the result to the activation dtype. It is exact but not fast; the kernels are.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 128  # side of a DeepSeek-style fp8 scale block
FP8_DTYPES = (jnp.float8_e4m3fn,)
FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in tuple(jnp.dtype(d) for d in FP8_DTYPES)


def scale_kind(w_DF: jax.Array, w_scale) -> str | None:
    """'channel', 'block' or None, after checking w_scale's shape against w_DF. Raises on a bad shape."""
    if w_scale is None:
        return None
    d, f = w_DF.shape
    if jnp.dtype(w_scale.dtype) != jnp.float32:
        raise TypeError(f"w_scale must be float32, got {w_scale.dtype}")
    if w_scale.ndim == 1:
        if w_scale.shape != (f,):
            raise ValueError(f"per-channel w_scale must have shape [F]=({f},), got {w_scale.shape}")
        return "channel"
    if w_scale.ndim == 2:
        want = (-(-d // BLOCK), -(-f // BLOCK))
        if w_scale.shape != want:
            raise ValueError(f"block w_scale for w of shape {w_DF.shape} must have shape "
                             f"[ceil(D/128), ceil(F/128)]={want}, got {w_scale.shape}")
        return "block"
    raise ValueError(f"w_scale must be 1-D [F] or 2-D [ceil(D/128), ceil(F/128)], got shape {w_scale.shape}")


def check_operands(x_TD: jax.Array, w_DF: jax.Array, w_scale=None) -> str | None:
    """Validate one x/w/scale triple; returns scale_kind. Raises ValueError/TypeError naming the problem."""
    if x_TD.ndim != 2:
        raise ValueError(f"x must be 2-D [T, D], got shape {x_TD.shape}")
    if w_DF.ndim != 2:
        raise ValueError(f"w must be 2-D [D, F], got shape {w_DF.shape}")
    if x_TD.shape[1] != w_DF.shape[0]:
        raise ValueError(f"x [T, D]={x_TD.shape} and w [D, F]={w_DF.shape} disagree on D")
    if jnp.dtype(x_TD.dtype) not in tuple(jnp.dtype(d) for d in FLOAT_DTYPES):
        raise TypeError(f"x must be bf16/f16/f32, got {x_TD.dtype}")
    wd = jnp.dtype(w_DF.dtype)
    if not (is_fp8(wd) or wd in tuple(jnp.dtype(d) for d in FLOAT_DTYPES)):
        raise TypeError(f"w must be bf16/f16/f32 or float8_e4m3fn, got {w_DF.dtype}")
    if w_scale is not None and not is_fp8(wd):
        raise ValueError(f"w_scale is only meaningful for fp8 weights, got w of dtype {w_DF.dtype}")
    return scale_kind(w_DF, w_scale)


def dequantize(w_DF: jax.Array, w_scale=None) -> jax.Array:
    """float32 weights: stored * scale (per channel or per 128x128 block)."""
    kind = scale_kind(w_DF, w_scale)
    w = w_DF.astype(jnp.float32)
    if kind == "channel":
        return w * w_scale[None, :]
    if kind == "block":
        d, f = w_DF.shape
        s = jnp.repeat(jnp.repeat(w_scale, BLOCK, axis=0), BLOCK, axis=1)[:d, :f]
        return w * s
    return w


def decode_matmul_reference(x_TD: jax.Array, w_DF: jax.Array, *, w_scale=None) -> jax.Array:
    """y[T, F] = x @ dequant(w) in float32, cast to x's dtype."""
    check_operands(x_TD, w_DF, w_scale)
    y = jnp.dot(x_TD.astype(jnp.float32), dequantize(w_DF, w_scale),
                precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x_TD.dtype)


def gate_up_silu_reference(x_TD: jax.Array, w_gate_DF: jax.Array, w_up_DF: jax.Array, *,
                           gate_scale=None, up_scale=None) -> jax.Array:
    """h[T, F] = silu(x @ wg) * (x @ wu), both products and the activation in float32."""
    check_operands(x_TD, w_gate_DF, gate_scale)
    check_operands(x_TD, w_up_DF, up_scale)
    if w_gate_DF.shape != w_up_DF.shape:
        raise ValueError(f"gate and up weights differ in shape: {w_gate_DF.shape} vs {w_up_DF.shape}")
    x = x_TD.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    g = jnp.dot(x, dequantize(w_gate_DF, gate_scale), precision=hi, preferred_element_type=jnp.float32)
    u = jnp.dot(x, dequantize(w_up_DF, up_scale), precision=hi, preferred_element_type=jnp.float32)
    return (jax.nn.silu(g) * u).astype(x_TD.dtype)
