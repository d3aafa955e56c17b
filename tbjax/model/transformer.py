"""The decoder forward pass assembled from the spec's layer groups.

The layer loop is a Python loop (unrolled in the jitted program) with static indices into the stacked weights.
Chosen by measurement on the H200 (../shared/JAX_NOTES.md): decode matmuls read weights at 2.5-2.7 TB/s when
unrolled against 1.0 TB/s through `lax.scan` over the stacked weights (the scan's dynamic slice copies them).
Decode steps can send the projections to the weight-streaming kernel instead, which reads each layer of the stacks in
place (`kernel_impl`, tbjax/model/linear.py).

How tokens mix (attention over a paged cache, dense causal attention, ...) is passed in as `attend`, so the same
forward serves the engine and whole-prompt forwards.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.matmul import decode_matmul

from tbjax.model import layers as ly
from tbjax.model.kinds import ATTENTION_APPLY, FFN_APPLY
from tbjax.model.linear import kernel_takes, layer_params
from tbjax.spec import ModelSpec, rope_attention_scale


def layer_plan(spec: ModelSpec) -> list[tuple[str, str, str, int]]:
    """For each layer index: (group name, attention kind, ffn kind, index inside the group's stack)."""
    plan = [None] * spec.n_layers
    for g in spec.layer_groups:
        for j, i in enumerate(g.layers):
            plan[i] = (g.name, g.attention, g.ffn, j)
    return plan


def forward_hidden(params, spec: ModelSpec, tokens_T, positions_T, attend, caches, kernel_impl: str | None = None):
    """Embeds tokens, runs every layer, applies the final norm. Returns (hidden_TD, caches).

    kernel_impl: None => XLA dots; else the decode matmul kernel impl ("gpu", "reference", ...) that reads each
    layer's weights in place (tbjax/model/linear.py).
    """
    x = jnp.take(params["embed"], tokens_T, axis=0)
    cos, sin = ly.rope_cos_sin(positions_T, spec.rope)
    caches = list(caches)
    for i, (g, akind, fkind, j) in enumerate(layer_plan(spec)):
        p = layer_params(params["groups"][g], j, kernel_impl)
        d, caches[i] = ATTENTION_APPLY[akind](spec, p, x, cos, sin, attend, i, caches[i])
        x = x + d
        x = x + FFN_APPLY[fkind](spec, p, x)
    return ly.rms_norm(x, params["final_norm"], spec.norm_eps), caches


def lm_logits(params, spec: ModelSpec, h_TD, kernel_impl: str | None = None):
    """float32 logits [T, V]. An untied lm_head [D, V] goes through the decode kernel when kernel_impl is set."""
    if kernel_impl is not None and not spec.tie_embeddings and kernel_takes(h_TD, params["lm_head"]):
        return decode_matmul(h_TD, params["lm_head"], impl=kernel_impl, out_dtype=jnp.float32)
    if spec.tie_embeddings:
        return jnp.einsum("td,vd->tv", h_TD, params["embed"], preferred_element_type=jnp.float32)
    return jnp.dot(h_TD, params["lm_head"], preferred_element_type=jnp.float32)


def forward_dense(params, spec: ModelSpec, tokens_T, positions_T=None, segment_ids_T=None):
    """Whole-sequence forward without a cache. Returns (logits_TV float32, [(k_TKH, v_TKH) per layer]).

    Several prompts may be packed into one row with distinct segment ids.
    """
    T = tokens_T.shape[0]
    if positions_T is None:
        positions_T = jnp.arange(T, dtype=jnp.int32)
    if segment_ids_T is None:
        segment_ids_T = jnp.zeros((T,), jnp.int32)
    scale = rope_attention_scale(spec)

    def attend(layer, q, k, v, cache):
        o = ly.dense_causal_attention(q, k, v, positions_T, segment_ids_T, scale=scale,
                                      window=spec.layer_window(layer))
        return o, (k, v)

    h, kv = forward_hidden(params, spec, tokens_T, positions_T, attend, [None] * spec.n_layers)
    return lm_logits(params, spec, h), kv
