"""DeepSeek's multi-head latent attention (MLA) as an attention layer kind.

Why: DeepSeek-V3 / Kimi-K2 cache one compressed latent per token instead of per-head keys and values:
kv_lora_rank + qk_rope_head_dim = 576 numbers per token per layer, against 128 heads x (192 + 128) expanded.

Math (checked against transformers' modeling_deepseek_v3.py):
  h = rmsnorm(x); q = W_qb rmsnorm(W_qa h) (or W_q h when q_lora_rank is None) -> per head [q_nope | q_rope]
  [c | k_r] = W_kva h;  c = rmsnorm(c) (the latent);  q_rope, k_r rotated by RoPE (one k_r shared by all heads)
  [k_nope | v] per head = W_kvb c;  k = [k_nope | k_r];  softmax scale = 1/sqrt(qk_nope + qk_rope) x yarn mscale^2
DeepSeek lays the rope dims out as interleaved pairs (x0, x1), (x2, x3), ... (transformers' `rope_interleave`,
default True for these models); we rotate them that way and, like transformers, emit the rotated dims
de-interleaved (all first members, then all second members). q and k use the same order, so scores are unchanged.
The q_a / kv_a norms use eps 1e-6 (transformers builds them with the default eps, not rms_norm_eps).

Two ways to run (both call the engine's `attend(layer, q_TNH, k_TKH, v_TKH, cache) -> (o_TNH, cache)`):
  expanded (default; whole-prompt forwards): k and v expanded per head (K = N heads, v zero-padded to the qk
      head dim so any GQA-shaped `attend` works; the padding is sliced off the output).
  latent (when `attend.mla_latent` is True; decode against the cache): queries are absorbed into the latent
      space, q_lat = q_nope W_uk, and attention runs as MQA with ONE kv head whose key AND value is the cached
      latent [c | k_r] (C = kv_lora_rank + qk_rope_head_dim): scores = q_lat.c + q_rope.k_r, the output's first
      kv_lora_rank dims are the latent output (the last qk_rope dims are discarded), then o = o_lat W_uv.
Cache layout (latent mode): `attend` receives k = v = kv_latent_T1C; a cache stores the latent once per token:
  contiguous `[T, C]` per layer, or in a paged engine one pool per layer `kv_pages_PGC` (pages x page tokens x C,
  no head axis) read as key (all C dims) and value (first kv_lora_rank dims) by an MLA-aware kernel; a plain GQA
  paged kernel also works with K=1, H=C at twice the bytes (it would store k and v separately).

Parameters per layer ([in, out]): attn_norm [D]; wq_a [D, Rq], q_a_norm [Rq], wq_b [Rq, N*(dn+dr)]
(or wq [D, N*(dn+dr)]); wkv_a [D, Rkv+dr], kv_a_norm [Rkv], wkv_b [Rkv, N*(dn+dv)]; w_o [N*dv, D].
"""
from __future__ import annotations

import jax.numpy as jnp

from tbjax.model import layers as ly
from tbjax.model.linear import matmul
from tbjax.model.quant import dequantize
from tbjax.spec import ModelSpec

NORMS = ("attn_norm", "q_a_norm", "kv_a_norm")
LATENT_NORM_EPS = 1e-6


def mla_shapes(s: ModelSpec):
    m = s.mla
    if m is None:
        raise ValueError(f"{s.arch}: the 'mla' attention kind needs spec.mla")
    if s.qkv_bias:
        raise NotImplementedError(f"{s.arch}: MLA with attention_bias=True is not implemented")
    D, N = s.d_model, s.n_heads
    dq = m.qk_nope_head_dim + m.qk_rope_head_dim
    out = {"attn_norm": (D,)}
    if m.q_lora_rank:
        out.update(wq_a=(D, m.q_lora_rank), q_a_norm=(m.q_lora_rank,), wq_b=(m.q_lora_rank, N * dq))
    else:
        out["wq"] = (D, N * dq)
    out.update(wkv_a=(D, m.kv_lora_rank + m.qk_rope_head_dim), kv_a_norm=(m.kv_lora_rank,),
               wkv_b=(m.kv_lora_rank, N * (m.qk_nope_head_dim + m.v_head_dim)), w_o=(N * m.v_head_dim, D))
    return out


def latent_dim(spec: ModelSpec) -> int:
    """Numbers cached per token per layer: kv_lora_rank + qk_rope_head_dim."""
    return spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim


def apply_rope_interleaved(x_TNr, cos_Tr, sin_Tr):
    """RoPE on interleaved pairs (x0,x1),(x2,x3)...; output de-interleaved [rotated evens | rotated odds]."""
    x = x_TNr.astype(jnp.float32)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos_Tr[:, None, :], sin_Tr[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x_TNr.dtype)


def _mm(a, w):
    return matmul(a, w)


def mla_project(spec: ModelSpec, p, x_TD, cos_Tr, sin_Tr):
    """Returns q_nope_TNd, q_rope_TNr (rotated) and kv_latent_TC = [rmsnorm(c) | rotated k_rope]."""
    m = spec.mla
    T = x_TD.shape[0]
    N, dn, dr, R = spec.n_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    h = ly.rms_norm(x_TD, p["attn_norm"], spec.norm_eps)
    if "wq_a" in p:
        q = _mm(ly.rms_norm(_mm(h, p["wq_a"]), p["q_a_norm"], LATENT_NORM_EPS), p["wq_b"])
    else:
        q = _mm(h, p["wq"])
    q = q.reshape(T, N, dn + dr)
    q_nope, q_rope = q[..., :dn], apply_rope_interleaved(q[..., dn:], cos_Tr, sin_Tr)
    ckv = _mm(h, p["wkv_a"])
    c = ly.rms_norm(ckv[:, :R], p["kv_a_norm"], LATENT_NORM_EPS)
    k_rope = apply_rope_interleaved(ckv[:, None, R:], cos_Tr, sin_Tr)[:, 0]
    return q_nope, q_rope, jnp.concatenate([c, k_rope], axis=-1)


def _split_kvb(spec: ModelSpec, p):
    m = spec.mla
    # the absorbed projections slice wkv_b by head: a quantized one is dequantized here (one [R, N * (dn + dv)] matrix
    # per layer; the latent einsums below are not plain [T, D] @ [D, F] products)
    w = dequantize(p["wkv_b"]).reshape(m.kv_lora_rank, spec.n_heads, m.qk_nope_head_dim + m.v_head_dim)
    return w[..., :m.qk_nope_head_dim], w[..., m.qk_nope_head_dim:]     # W_uk [R, N, dn], W_uv [R, N, dv]


def mla_apply(spec: ModelSpec, p, x_TD, cos_Tr, sin_Tr, attend, layer, cache):
    """ATTENTION_APPLY entry: expanded k/v, or the latent (absorbed) form when `attend.mla_latent` is True."""
    m = spec.mla
    T = x_TD.shape[0]
    N, dn, dr, dv, R = spec.n_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    q_nope, q_rope, lat = mla_project(spec, p, x_TD, cos_Tr, sin_Tr)
    w_uk, w_uv = _split_kvb(spec, p)
    dt = x_TD.dtype
    if getattr(attend, "mla_latent", False):
        q_lat = jnp.einsum("tnd,rnd->tnr", q_nope, w_uk, preferred_element_type=jnp.float32).astype(dt)
        qa = jnp.concatenate([q_lat, q_rope], axis=-1)                       # [T, N, R + dr]
        kv = lat[:, None, :]                                                  # [T, 1, C]: key and value
        o_lat, cache = attend(layer, qa, kv, kv, cache)
        o = jnp.einsum("tnr,rnv->tnv", o_lat[..., :R], w_uv, preferred_element_type=jnp.float32).astype(dt)
    else:
        c, k_rope = lat[:, :R], lat[:, R:]
        k_nope = jnp.einsum("tr,rnd->tnd", c, w_uk, preferred_element_type=jnp.float32).astype(dt)
        v = jnp.einsum("tr,rnv->tnv", c, w_uv, preferred_element_type=jnp.float32).astype(dt)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, None, :], (T, N, dr))], axis=-1)
        H = max(dn + dr, dv)
        pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, H - a.shape[-1])))  # noqa: E731
        o, cache = attend(layer, pad(q), pad(k), pad(v), cache)
        o = o[..., :dv]
    out = matmul(o.reshape(T, N * dv), p["w_o"])
    return out, cache
