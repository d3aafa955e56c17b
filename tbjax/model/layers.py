"""Building blocks of decoder layers: RMSNorm, rotary embeddings, SwiGLU, dense causal attention.

Pure functions on arrays; dtype handling is explicit: norms and softmax run in float32, matmuls in the weights'
dtype with float32 accumulation.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from tbjax.spec import RopeSpec


def rms_norm(x_TD, w_D, eps: float):
    y = x_TD.astype(jnp.float32) * rms_scale(x_TD, eps)
    return (y * w_D.astype(jnp.float32)).astype(x_TD.dtype)


def rms_scale(x_TD, eps: float):
    """The per-row factor of RMSNorm, float32 [T, 1]: rms_norm(x, w) == x * rms_scale(x) * w.

    For norms whose weight is folded into the next projection (tbjax/model/kinds.py fold_norms): that projection
    reads x itself and its float32 output is multiplied by this factor, (x * s * w) @ W == s * (x @ (w[:, None] * W)).
    """
    x32 = x_TD.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rope_inv_freq(rope: RopeSpec) -> np.ndarray:
    """Per-pair inverse frequencies (float64 math, returned as float32), with llama3 / linear / yarn scaling."""
    rd = rope.rotary_dim
    inv = 1.0 / (rope.theta ** (np.arange(0, rd, 2, dtype=np.float64) / rd))
    if rope.scaling is None:
        return inv.astype(np.float32)
    if rope.scaling == "linear":
        return (inv / rope.factor).astype(np.float32)
    if rope.scaling == "llama3":
        old = rope.original_max_position
        low_wl, high_wl = old / rope.low_freq_factor, old / rope.high_freq_factor
        wl = 2 * math.pi / inv
        scaled = np.where(wl > low_wl, inv / rope.factor, inv)
        smooth = (old / wl - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wl >= high_wl) & (wl <= low_wl)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if rope.scaling == "yarn":
        def corr(n_rot):
            return rd * math.log(rope.original_max_position / (n_rot * 2 * math.pi)) / (2 * math.log(rope.theta))
        lo = max(math.floor(corr(rope.beta_fast)), 0)
        hi = min(math.ceil(corr(rope.beta_slow)), rd - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(rd // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        extra_mask = 1 - ramp
        return (inv / rope.factor * (1 - extra_mask) + inv * extra_mask).astype(np.float32)
    raise ValueError(f"unknown rope scaling {rope.scaling!r}")


def yarn_cos_scale(rope: RopeSpec) -> float:
    if rope.scaling != "yarn" or rope.factor <= 1:
        return 1.0
    def m(s):
        return 0.1 * s * math.log(rope.factor) + 1.0 if s else 1.0
    return m(rope.mscale) / m(rope.mscale_all_dim)


def rope_cos_sin(positions_T, rope: RopeSpec):
    """cos/sin [T, rotary_dim/2] in float32 for integer positions."""
    inv = jnp.asarray(rope_inv_freq(rope))
    ang = positions_T.astype(jnp.float32)[:, None] * inv[None, :]
    s = yarn_cos_scale(rope)
    return jnp.cos(ang) * s, jnp.sin(ang) * s


def apply_rope(x_TNH, cos_Tr, sin_Tr):
    """Rotate-half RoPE (Hugging Face convention) on the first 2r dims of each head; the rest pass through."""
    r = cos_Tr.shape[-1]
    x = x_TNH.astype(jnp.float32)
    x1, x2, rest = x[..., :r], x[..., r:2 * r], x[..., 2 * r:]
    c, s = cos_Tr[:, None, :], sin_Tr[:, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)
    return out.astype(x_TNH.dtype)


def swiglu(x_TD, w_gate_DF, w_up_DF, w_down_FD):
    g = jnp.dot(x_TD, w_gate_DF, preferred_element_type=jnp.float32)
    u = jnp.dot(x_TD, w_up_DF, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g) * u).astype(x_TD.dtype)
    return jnp.dot(h, w_down_FD, preferred_element_type=jnp.float32).astype(x_TD.dtype)


def dense_causal_attention(q_TNH, k_TKH, v_TKH, positions_T, segment_ids_T, *, scale: float,
                           window: int | None = None, soft_cap: float | None = None):
    """Attention of every token over the earlier tokens of its own segment (no cache). [T, N, H] out.

    Used for whole-prompt forwards (parity checks, KV capture); serving goes through paged attention.
    """
    T, N, H = q_TNH.shape
    K = k_TKH.shape[1]
    g = N // K
    q = q_TNH.astype(jnp.float32).reshape(T, K, g, H)
    s = jnp.einsum("tkgh,skh->kgts", q, k_TKH.astype(jnp.float32)) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    pq, pk = positions_T[:, None], positions_T[None, :]
    mask = (segment_ids_T[:, None] == segment_ids_T[None, :]) & (pk <= pq)
    if window is not None:
        mask &= pk > pq - window
    s = jnp.where(mask[None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask[None, None], p, 0.0)
    o = jnp.einsum("kgts,skh->tkgh", p, v_TKH.astype(jnp.float32))
    return o.reshape(T, N, H).astype(q_TNH.dtype)
