"""The decoder forward pass assembled from the spec's layer groups.

The layer loop is a Python loop (unrolled in the jitted program) with static indices into the stacked weights.
Chosen by measurement on the H200 (../shared/JAX_NOTES.md): decode matmuls read weights at 2.5-2.7 TB/s when
unrolled against 1.0 TB/s through `lax.scan` over the stacked weights (the scan's dynamic slice copies them).
Decode steps can send the projections to the weight-streaming kernel instead, which reads each layer of the stacks in
place (`kernel_impl`, tbjax/model/linear.py).

How tokens mix (attention over a paged cache, dense causal attention, ...) is passed in as `attend`, so the same
forward serves the engine and whole-prompt forwards. `run_layers` is the one layer loop: the engine's step (on any
mesh), pipeline-prefill stages (a range of layers) and the reference forwards all run it.

On a decode mesh (`LoopContext`) the loop also
  * reads each layer's attention weights from the packed per-layer byte buffers `params["attn_packed"]` [L, bytes]
    (sharding/packed.py), each device holding 1/N of every layer and gathering (`ctx.fetch`) layer l+1's buffer
    before layer l computes: the gather is issued one layer ahead, so XLA's latency-hiding scheduler can run it
    during layer l; the layer's own buffer is dropped after its attention (two gathered layers live at a time);
  * runs MoE layers with their routed experts split over the expert axes (`ctx.ep`, sharding/expert_parallel.py).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.matmul import decode_matmul
from sharding import packed as pk

from tbjax.model import cpu_qgemv, layers as ly
from tbjax.model.kinds import ATTENTION_APPLY, FFN_APPLY
from tbjax.model.linear import kernel_matmul, kernel_takes, layer_params, matmul, row_scaled
from tbjax.model.quant import QuantizedWeight, take_rows
from tbjax.spec import ModelSpec, rope_attention_scale


def layer_plan(spec: ModelSpec) -> list[tuple[str, str, str, int]]:
    """For each layer index: (group name, attention kind, ffn kind, index inside the group's stack)."""
    plan = [None] * spec.n_layers
    for g in spec.layer_groups:
        for j, i in enumerate(g.layers):
            plan[i] = (g.name, g.attention, g.ffn, j)
    return plan


@dataclasses.dataclass(frozen=True)
class LoopContext:
    """How the layer loop runs on a mesh (inside `jax.shard_map`); the default is one device, nothing sharded.

    attn_pack: the packed layout of one layer's attention weights when they live in params["attn_packed"];
    fetch: shard [bytes/N] -> the layer's whole buffer (an all-gather or a ppermute ring, sharding/prefetch.py);
    ep: how routed experts are spread (tbjax/model/moe.py EPContext); None = all local;
    moe_stats: a list that receives each MoE layer's stats ({"load_E", "dropped"}) while tracing, or None."""
    attn_pack: pk.PackedLayout | None = None
    fetch: Callable | None = None
    ep: object = None
    moe_stats: list | None = dataclasses.field(default=None, compare=False, hash=False)


def run_layers(params, spec: ModelSpec, x_TD, cos, sin, attend, caches, *, layers=None,
               kernel_impl: str | None = None, ctx: LoopContext | None = None):
    """The layer loop: layers `layers` (default all, in order) on activations x_TD. Returns (x_TD, caches), where
    caches is a list over all layers (entries of layers not run are passed through)."""
    ctx = ctx or LoopContext()
    plan = layer_plan(spec)
    idx = list(range(spec.n_layers) if layers is None else layers)
    caches = list(caches)
    packed = params.get("attn_packed") if ctx.attn_pack is not None else None
    fetch = ctx.fetch or (lambda shard: shard)
    nxt = fetch(packed[idx[0]]) if packed is not None and idx else None
    for n, i in enumerate(idx):
        g, akind, fkind, j = plan[i]
        p = layer_params(params["groups"][g], j, kernel_impl)
        pa = p
        if packed is not None:
            buf = nxt
            if n + 1 < len(idx):           # issued before this layer computes: overlapped with it
                # the shard is tied to this layer's input, so the gather cannot be hoisted above it (XLA starts
                # independent collectives as early as it can: a ppermute ring of every layer at the top)
                shard, x_TD = jax.lax.optimization_barrier((packed[idx[n + 1]], x_TD))
                nxt = fetch(shard)
            pa = pk.unpack(buf, ctx.attn_pack, x_TD.dtype)
        d, caches[i] = ATTENTION_APPLY[akind](spec, pa, x_TD, cos, sin, attend, i, caches[i])
        if packed is not None and n + 1 < len(idx):
            # Tie the prefetched buffer to this layer's attention output: XLA:GPU's scheduler keeps one async
            # collective in flight and places a gather's start right after the previous collective (on MoE layers:
            # after this layer's token all-gathers, i.e. after attention). With the barrier the gather of layer
            # l+1 brackets layer l's attention (optimized sm_90 HLO, tests/test_sharding_hlo.py).
            nxt, d = jax.lax.optimization_barrier((nxt, d))
        x_TD = x_TD + d
        y = FFN_APPLY[fkind](spec, p, x_TD, ep=ctx.ep, stats=ctx.moe_stats)
        x_TD = x_TD + y
    return x_TD, caches


def forward_hidden(params, spec: ModelSpec, tokens_T, positions_T, attend, caches, kernel_impl: str | None = None,
                   ctx: LoopContext | None = None):
    """Embeds tokens, runs every layer, applies the final norm. Returns (hidden_TD, caches).

    kernel_impl: None => XLA dots; else the decode matmul kernel impl ("gpu", "reference", ...) that reads each
    layer's weights in place (tbjax/model/linear.py).
    """
    x = take_rows(params["embed"], tokens_T)          # a quantized table dequantizes the gathered rows only
    cos, sin = ly.rope_cos_sin(positions_T, spec.rope)
    x, caches = run_layers(params, spec, x, cos, sin, attend, caches, kernel_impl=kernel_impl, ctx=ctx)
    return ly.rms_norm(x, params["final_norm"], spec.norm_eps), caches


def lm_logits(params, spec: ModelSpec, h_TD, kernel_impl: str | None = None):
    """float32 logits [T, V]. An untied lm_head [D, V] goes through the decode kernel when kernel_impl is set; a
    tied quantized embedding [V, D] is the head seen transposed (tied_logits)."""
    if kernel_impl is not None and not spec.tie_embeddings and kernel_takes(h_TD, params["lm_head"]):
        if isinstance(params["lm_head"], QuantizedWeight):
            return kernel_matmul(h_TD, params["lm_head"], None, kernel_impl, jnp.float32)
        return decode_matmul(h_TD, params["lm_head"], impl=kernel_impl, out_dtype=jnp.float32)
    if spec.tie_embeddings:
        return tied_logits(h_TD, params["embed"])
    return matmul(h_TD, params["lm_head"], jnp.float32)


def tied_logits(h_TD, embed_VD):
    """float32 h @ embed.T: a quantized table goes through the CPU custom call at decode token counts, else it is
    dequantized to the compute dtype inside the program."""
    if isinstance(embed_VD, QuantizedWeight):
        if cpu_qgemv.takes_rows(h_TD, embed_VD):
            return cpu_qgemv.qgemv_rows(h_TD, embed_VD)
        if row_scaled(h_TD, embed_VD):          # one scale per vocabulary row: on the result, codes read once
            y = jnp.einsum("td,vd->tv", h_TD, embed_VD.q.astype(h_TD.dtype), preferred_element_type=jnp.float32)
            return y * embed_VD.scale.reshape(1, -1).astype(jnp.float32)
        embed_VD = embed_VD.dequantize(h_TD.dtype)
    return jnp.einsum("td,vd->tv", h_TD, embed_VD, preferred_element_type=jnp.float32)


def forward_dense(params, spec: ModelSpec, tokens_T, positions_T=None, segment_ids_T=None,
                  ctx: LoopContext | None = None):
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

    h, kv = forward_hidden(params, spec, tokens_T, positions_T, attend, [None] * spec.n_layers, ctx=ctx)
    return lm_logits(params, spec, h), kv
