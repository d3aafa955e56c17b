"""Layer kinds: each attention and FFN kind declares its per-layer parameter shapes and its compute.

A new architecture is a new entry here plus a mapping in tbjax/spec.py. Parameter layout is [in, out] for
every matrix (x @ w); projections go through `linear`/`swiglu` (tbjax/model/linear.py), which pick XLA dots or the
decode kernel. Per-layer shapes here get a leading L axis when layers of one kind are stacked.

`fold_norms` rewrites a parameter tree so that the GQA/dense RMSNorm weights live inside the projection that reads
the norm's output (w_qkv, w_gate_up); the layer then multiplies that projection's float32 output by the norm's row
factor instead of materializing the normalized activations. Why: in the decode step compiled for the H200 (sm_90)
the norm was a kernel of its own after the residual add (a Triton block-level fusion); folded, XLA computes the
residual add and the row factor in one reduction kernel, the projection reads the residual stream directly and the
factor joins the consumers of the projection (KV write / RoPE, SiLU): 12 -> 10 kernels per layer
(scripts/gpu_hlo_decode.py, benchmarks/RESULTS.md). Same math; the bf16 rounding moves from the normalized
activations to the folded weights.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from tbjax.model import layers as ly
from tbjax.model.linear import linear, swiglu
from tbjax.model.quant import QuantizedWeight
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


def gqa_qkv(spec: ModelSpec, p, x_TD, cos_Tr, sin_Tr):
    """Norm + fused QKV projection + q/k norm + RoPE. Returns q_TNH, k_TKH, v_TKH."""
    T = x_TD.shape[0]
    h, s_T1 = _norm_in(spec, p, "attn_norm", x_TD)
    if s_T1 is None and "b_qkv" not in p:
        qkv = linear(p, "w_qkv", h)
    else:
        qkv = linear(p, "w_qkv", h, jnp.float32)
        if s_T1 is not None:
            qkv = qkv * s_T1
        if "b_qkv" in p:
            qkv = qkv + p["b_qkv"].astype(jnp.float32)
        qkv = qkv.astype(x_TD.dtype)
    N, K, H = spec.n_heads, spec.n_kv_heads, spec.head_dim
    q = qkv[:, : N * H].reshape(T, N, H)
    k = qkv[:, N * H: (N + K) * H].reshape(T, K, H)
    v = qkv[:, (N + K) * H:].reshape(T, K, H)
    if "q_norm" in p:
        q = ly.rms_norm(q, p["q_norm"], spec.norm_eps)
        k = ly.rms_norm(k, p["k_norm"], spec.norm_eps)
    return ly.apply_rope(q, cos_Tr, sin_Tr), ly.apply_rope(k, cos_Tr, sin_Tr), v


def gqa_out(spec: ModelSpec, p, o_TNH):
    T = o_TNH.shape[0]
    return linear(p, "w_o", o_TNH.reshape(T, -1))


# ---- dense SwiGLU FFN --------------------------------------------------------------------------------------
def dense_shapes(s: ModelSpec):
    """gate and up are one [D, 2, F] matrix (gate = [:, 0], up = [:, 1]): one GEMM / one kernel launch reads both,
    and splitting F over devices keeps each shard's gate and up columns together."""
    return {"mlp_norm": (s.d_model,), "w_gate_up": (s.d_model, 2, s.ffn_dim), "w_down": (s.ffn_dim, s.d_model)}


def dense_ffn(spec: ModelSpec, p, x_TD, ep=None, stats=None):
    h, s_T1 = _norm_in(spec, p, "mlp_norm", x_TD)
    return swiglu(p, h, row_scale_T1=s_T1)


# ---- norms folded into the next projection -----------------------------------------------------------------
FOLDED_SUFFIX = "_folded"          # a folded norm's weights stay in the tree under <norm>_folded (unused by math)


def _norm_in(spec: ModelSpec, p, norm: str, x_TD):
    """(input of the projection after `norm`, float32 row factor [T, 1] to apply to its output or None)."""
    if norm in p:
        return ly.rms_norm(x_TD, p[norm], spec.norm_eps), None
    if norm + FOLDED_SUFFIX in p:          # folded by fold_norms: the projection's weights carry the norm weight
        return x_TD, ly.rms_scale(x_TD, spec.norm_eps)
    raise KeyError(f"layer parameters have neither {norm!r} nor {norm + FOLDED_SUFFIX!r} (fold_norms)")


def folded_pairs(attention: str, ffn: str) -> tuple[tuple[str, str], ...]:
    """(norm, projection reading its output) pairs that fold_norms folds for a layer group of these kinds."""
    return ((("attn_norm", "w_qkv"),) if attention == "gqa" else ()) + \
           ((("mlp_norm", "w_gate_up"),) if ffn == "dense" else ())


@jax.jit
def _fold_one(norm_xD, w_xDr):
    """w * norm along w's input axis (the one after norm's leading axes), in float32, rounded once to w's dtype."""
    n = norm_xD.astype(jnp.float32).reshape(norm_xD.shape + (1,) * (w_xDr.ndim - norm_xD.ndim))
    return (w_xDr.astype(jnp.float32) * n).astype(w_xDr.dtype)


def fold_norms(spec: ModelSpec, params):
    """The same parameter tree with each GQA attn_norm folded into w_qkv and each dense mlp_norm into w_gate_up:
    w[.., d, :] *= norm[.., d]; the norm weights move to <norm>_folded. Groups of other kinds (MLA, MoE) are left
    as they are; an already folded group is returned unchanged. Works on stacked [L, ...] arrays and on per-layer
    buffers (lists, tbjax/model/params.py split_layer_buffers). The folded matrices are new arrays (the caller drops
    the originals). Forwards over the folded tree equal those over the original up to the weights' rounding.
    For the single-device forwards (forward_hidden: engine steps, forward_dense); the decode-mesh forward
    (mesh_forward.py) packs attention weights itself and takes unfolded trees."""
    groups = {}
    for g in spec.layer_groups:
        if g.name not in params["groups"]:
            raise KeyError(f"parameter tree has no layer group {g.name!r}")
        gp = dict(params["groups"][g.name])
        for norm, w in folded_pairs(g.attention, g.ffn):
            if norm not in gp:
                if norm + FOLDED_SUFFIX in gp:
                    continue
                raise KeyError(f"group {g.name!r} has no {norm!r} to fold")
            n, m = gp[norm], gp[w]
            pairs = list(zip(n, m)) if isinstance(m, (list, tuple)) else [(n, m)]
            for a, b in pairs:
                if isinstance(b, QuantizedWeight) or not jnp.issubdtype(b.dtype, jnp.floating):
                    raise TypeError(f"{g.name}.{w}: cannot fold a norm into {b.dtype} weights")
                if tuple(b.shape[:a.ndim]) != tuple(a.shape):
                    raise ValueError(f"{g.name}: {norm} {tuple(a.shape)} does not match the input axis of {w} "
                                     f"{tuple(b.shape)}")
            folded = [_fold_one(a, b) for a, b in pairs]
            gp[w] = folded if isinstance(m, (list, tuple)) else folded[0]
            gp[norm + FOLDED_SUFFIX] = gp.pop(norm)
        groups[g.name] = gp
    return {**params, "groups": {**params["groups"], **groups}}


ATTENTION_KINDS: dict[str, Kind] = {"gqa": Kind(gqa_shapes, norms=("attn_norm", "q_norm", "k_norm"))}
FFN_KINDS: dict[str, Kind] = {"dense": Kind(dense_shapes, norms=("mlp_norm",))}
FFN_APPLY: dict[str, Callable] = {"dense": dense_ffn}


def require_kind(spec: ModelSpec, attention: str, ffn: str):
    if attention not in ATTENTION_KINDS:
        raise NotImplementedError(f"{spec.arch}: attention kind {attention!r} is not implemented yet")
    if ffn not in FFN_KINDS:
        raise NotImplementedError(f"{spec.arch}: FFN kind {ffn!r} is not implemented yet")


def gqa_apply(spec: ModelSpec, p, x_TD, cos_Tr, sin_Tr, attend, layer: int, cache):
    """One attention sub-block; `attend(layer, q_TNH, k_TKH, v_TKH, cache) -> (o_TNH, cache)` does the mixing."""
    q, k, v = gqa_qkv(spec, p, x_TD, cos_Tr, sin_Tr)
    o, cache = attend(layer, q, k, v, cache)
    return gqa_out(spec, p, o), cache


ATTENTION_APPLY: dict[str, Callable] = {"gqa": gqa_apply}

# ---- MoE FFN and MLA attention (tbjax/model/moe.py, mla.py; they do not import this module) ----------------
from tbjax.model import mla as _mla, moe as _moe  # noqa: E402

ATTENTION_KINDS["mla"] = Kind(_mla.mla_shapes, norms=_mla.NORMS)
ATTENTION_APPLY["mla"] = _mla.mla_apply
FFN_KINDS["moe"] = Kind(_moe.moe_shapes, norms=_moe.NORMS)
FFN_APPLY["moe"] = _moe.moe_apply
