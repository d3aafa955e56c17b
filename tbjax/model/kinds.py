"""Layer kinds: each attention and FFN kind declares its per-layer parameter shapes and its compute.

A new architecture is a new entry here plus a mapping in tbjax/spec.py. Parameter layout is [in, out] for
every matrix (x @ w); projections go through `linear`/`swiglu` (tbjax/model/linear.py), which pick XLA dots or the
decode kernel. Per-layer shapes here get a leading L axis when layers of one kind are stacked.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from tbjax.model import layers as ly
from tbjax.model.linear import linear, swiglu
from tbjax.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class Kind:
    shapes: Callable[[ModelSpec], dict[str, tuple[int, ...]]]   # per-layer parameter shapes
    norms: tuple[str, ...] = ()                                   # params initialised to ones (norm weights)


# ---- GQA attention ----------------------------------------------------------------------------------------
def gqa_shapes(s: ModelSpec):
    qkv = (s.n_heads + 2 * s.n_kv_heads) * s.head_dim
    out = {"attn_norm": (s.d_model,), "w_qkv": (s.d_model, qkv), "w_o": (s.n_heads * s.head_dim, s.d_model)}
    if s.qkv_bias:
        out["b_qkv"] = (qkv,)
    if s.qk_norm:
        out["q_norm"] = (s.head_dim,)
        out["k_norm"] = (s.head_dim,)
    return out


def gqa_qkv(spec: ModelSpec, p, x_TD, cos_TR, sin_TR):
    """Norm + fused QKV projection + q/k norm + RoPE. Returns q_TNH, k_TKH, v_TKH."""
    T = x_TD.shape[0]
    h = ly.rms_norm(x_TD, p["attn_norm"], spec.norm_eps)
    if "b_qkv" in p:
        qkv = (linear(p, "w_qkv", h, jnp.float32) + p["b_qkv"].astype(jnp.float32)).astype(x_TD.dtype)
    else:
        qkv = linear(p, "w_qkv", h)
    N, K, H = spec.n_heads, spec.n_kv_heads, spec.head_dim
    q = qkv[:, : N * H].reshape(T, N, H)
    k = qkv[:, N * H: (N + K) * H].reshape(T, K, H)
    v = qkv[:, (N + K) * H:].reshape(T, K, H)
    if "q_norm" in p:
        q = ly.rms_norm(q, p["q_norm"], spec.norm_eps)
        k = ly.rms_norm(k, p["k_norm"], spec.norm_eps)
    return ly.apply_rope(q, cos_TR, sin_TR), ly.apply_rope(k, cos_TR, sin_TR), v


def gqa_out(spec: ModelSpec, p, o_TNH):
    T = o_TNH.shape[0]
    return linear(p, "w_o", o_TNH.reshape(T, -1))


# ---- dense SwiGLU FFN --------------------------------------------------------------------------------------
def dense_shapes(s: ModelSpec):
    """gate and up are one [D, 2, F] matrix (gate = [:, 0], up = [:, 1]): one GEMM / one kernel launch reads both,
    and splitting F over devices keeps each shard's gate and up columns together."""
    return {"mlp_norm": (s.d_model,), "w_gate_up": (s.d_model, 2, s.ffn_dim), "w_down": (s.ffn_dim, s.d_model)}


def dense_ffn(spec: ModelSpec, p, x_TD):
    h = ly.rms_norm(x_TD, p["mlp_norm"], spec.norm_eps)
    return swiglu(p, h)


ATTENTION_KINDS: dict[str, Kind] = {"gqa": Kind(gqa_shapes, norms=("attn_norm", "q_norm", "k_norm"))}
FFN_KINDS: dict[str, Kind] = {"dense": Kind(dense_shapes, norms=("mlp_norm",))}
FFN_APPLY: dict[str, Callable] = {"dense": dense_ffn}


def require_kind(spec: ModelSpec, attention: str, ffn: str):
    if attention not in ATTENTION_KINDS:
        raise NotImplementedError(f"{spec.arch}: attention kind {attention!r} is not implemented yet")
    if ffn not in FFN_KINDS:
        raise NotImplementedError(f"{spec.arch}: FFN kind {ffn!r} is not implemented yet")


def gqa_apply(spec: ModelSpec, p, x_TD, cos_TR, sin_TR, attend, layer: int, cache):
    """One attention sub-block; `attend(layer, q_TNH, k_TKH, v_TKH, cache) -> (o_TNH, cache)` does the mixing."""
    q, k, v = gqa_qkv(spec, p, x_TD, cos_TR, sin_TR)
    o, cache = attend(layer, q, k, v, cache)
    return gqa_out(spec, p, o), cache


ATTENTION_APPLY: dict[str, Callable] = {"gqa": gqa_apply}

# ---- MoE FFN and MLA attention (tbjax/model/moe.py, mla.py; they do not import this module) ----------------
from tbjax.model import mla as _mla, moe as _moe  # noqa: E402

ATTENTION_KINDS["mla"] = Kind(_mla.mla_shapes, norms=_mla.NORMS)
ATTENTION_APPLY["mla"] = _mla.mla_apply
FFN_KINDS["moe"] = Kind(_moe.moe_shapes, norms=_moe.NORMS)
FFN_APPLY["moe"] = _moe.moe_apply
