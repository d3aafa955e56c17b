"""The MoE FFN layer kind: router (softmax or sigmoid, DeepSeek's group-limited routing with the correction bias),
routed experts through one grouped matmul (`jax.lax.ragged_dot`), optional shared experts, expert load counts.

Why: Mixtral, Qwen3-MoE, DeepSeek-V3 and Kimi-K2 differ only in the router and in shared experts; one kind
covers them from `ModelSpec.moe`. Expert parallelism (experts split over mesh axes) lives in
sharding/expert_parallel.py; this module passes it the routing.

Routing semantics (checked against transformers' modeling_{mixtral,qwen3_moe,deepseek_v3}.py):
  softmax (Mixtral, Qwen3-MoE): p = softmax(x W_r); top-k of p; renormalise when norm_topk_prob.
  sigmoid (DeepSeek-V3, Kimi-K2): s = sigmoid(x W_r); choice = s + correction bias; groups ranked by the sum of
      their top-2 choice scores, only the best topk_group groups stay; top-k of choice among them; weights are s
      (not choice) at those experts, renormalised (+1e-20) when norm_topk_prob; times routed_scaling_factor.
  The router runs in float32 (DeepSeek keeps it in fp32; the others compute softmax in fp32).

Parameters per layer ([in, out] matrices):
  mlp_norm [D], router [D, E], router_bias [E] (correction bias, when the spec has it),
  we_gate [E, D, F], we_up [E, D, F], we_down [E, F, D] (routed experts),
  ws_gate [D, Fs], ws_up [D, Fs], ws_down [Fs, D] (shared experts, when n_shared_experts > 0).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sharding import expert_parallel as xp
from tbjax.model import layers as ly
from tbjax.model.linear import matmul
from tbjax.model.quant import dequantize
from tbjax.spec import ModelSpec, MoESpec

NORMS = ("mlp_norm",)


def moe_shapes(s: ModelSpec):
    m = s.moe
    if m is None:
        raise ValueError(f"{s.arch}: the 'moe' FFN kind needs spec.moe")
    D, E, F = s.d_model, m.n_experts, m.expert_ffn_dim
    out = {"mlp_norm": (D,), "router": (D, E)}
    if m.correction_bias:
        out["router_bias"] = (E,)
    out.update(we_gate=(E, D, F), we_up=(E, D, F), we_down=(E, F, D))
    if m.n_shared_experts:
        Fs = m.shared_ffn_dim
        out.update(ws_gate=(D, Fs), ws_up=(D, Fs), ws_down=(Fs, D))
    return out


def route(m: MoESpec, logits_TE, bias_E=None):
    """Top-k experts and their weights from router logits (float32). Returns (ids_TA int32, w_TA float32)."""
    logits = logits_TE.astype(jnp.float32)
    T, E = logits.shape
    if m.router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        choice = scores
    elif m.router == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias_E.astype(jnp.float32)[None, :] if bias_E is not None else scores
    else:
        raise ValueError(f"unknown router scoring function {m.router!r} (expected 'softmax' or 'sigmoid')")
    if m.n_group > 1:
        per = E // m.n_group
        if per < 2:
            raise ValueError(f"group-limited routing ranks groups by their top-2 experts: needs >= 2 experts per "
                             f"group, got {E} experts in {m.n_group} groups")
        grouped = choice.reshape(T, m.n_group, per)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)                  # [T, G]
        _, gidx = jax.lax.top_k(group_score, m.topk_group)
        gmask = jnp.any(gidx[:, :, None] == jnp.arange(m.n_group)[None, None, :], axis=1)   # [T, G]
        choice = jnp.where(jnp.repeat(gmask, per, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, m.top_k)
    w = jnp.take_along_axis(scores, ids, axis=1)
    if m.norm_topk_prob:
        w = w / (w.sum(axis=-1, keepdims=True) + (1e-20 if m.router == "sigmoid" else 0.0))
    w = w * m.routed_scaling_factor
    return ids.astype(jnp.int32), w


@dataclasses.dataclass(frozen=True)
class EPContext:
    """How routed experts are spread inside a shard_map (see sharding/expert_parallel.py).
    expert_axes=() means all experts are local (one device, or experts replicated)."""
    expert_axes: tuple[str, ...] = ()
    batch_axes: tuple[str, ...] = ()      # tokens are split over these: load counts are summed over them
    mode: str = "gather"
    capacity_factor: float | None = None


def moe_ffn(spec: ModelSpec, p, x_TD, ep: EPContext | None = None):
    """Returns (y_TD, stats) with stats = {"load_E": int32 [E] assignments per expert (summed over the batch
    axes), "dropped": int32 pairs dropped by all_to_all capacity on this device}."""
    m = spec.moe
    ep = ep or EPContext()
    h = ly.rms_norm(x_TD, p["mlp_norm"], spec.norm_eps)
    logits = jnp.dot(h.astype(jnp.float32), p["router"].astype(jnp.float32))
    ids, w = route(m, logits, p.get("router_bias"))
    cap = None
    if ep.mode == "all_to_all" and ep.expert_axes:
        cap = xp.capacity_for(x_TD.shape[0], m.top_k, jax.lax.axis_size(ep.expert_axes), ep.capacity_factor)
    # jax.lax.ragged_dot takes float operands only: quantized routed experts (each device's own, [E_local, ...]) are
    # dequantized here, inside the step, one layer at a time (resident in their format, transient in bf16)
    experts = tuple(dequantize(p[k], h.dtype) for k in ("we_gate", "we_up", "we_down"))
    y, dropped = xp.moe_dispatch_combine(h, ids, w, experts,
                                         n_experts=m.n_experts, axes=ep.expert_axes, mode=ep.mode, capacity=cap)
    if m.n_shared_experts:
        g = matmul(h, p["ws_gate"], jnp.float32)
        u = matmul(h, p["ws_up"], jnp.float32)
        y = y + matmul((jax.nn.silu(g) * u).astype(h.dtype), p["ws_down"], jnp.float32)
    stats = {"load_E": xp.expert_load(ids, m.n_experts, ep.batch_axes), "dropped": dropped}
    return y.astype(x_TD.dtype), stats


def moe_apply(spec: ModelSpec, p, x_TD, ep: EPContext | None = None, stats: list | None = None):
    """FFN_APPLY entry: experts as `ep` spreads them (None: all local); appends the layer's stats to `stats`."""
    y, st = moe_ffn(spec, p, x_TD, ep)
    if stats is not None:
        stats.append(st)
    return y
