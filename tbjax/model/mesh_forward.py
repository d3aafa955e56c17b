"""The model on a decode mesh: attention data parallel, experts split over devices (EP), and every layer's attention
weights held 1/N per device and gathered just in time, one layer ahead (DP attention-weight sharding).

Why: at trillion-parameter scale the attention weights replicated on every attention-DP rank cost
61 layers x 187M parameters per device (DeepSeek-V3); sharding them 1/N and prefetching frees almost all of it
for KV cache, i.e. batch. Public engines (tpu-inference, SGLang) replicate them.

This module plans and places; the layer loop is tbjax/model/transformer.py's `run_layers` (the engine's step runs
it under `jax.shard_map` with a paged `attend`, `make_forward` here with dense attention for whole sequences).
Layout (static, `MeshPlan`), the parameter tree of the model with two changes:
  * when `layout.attn_axes` is not empty, every layer's attention weights (all of its attention kind's parameters,
    norms included) leave the groups and are packed into one uint8 buffer per layer (sharding/packed.py), stacked
    `params["attn_packed"]` [L, bytes] and split over the attention axes; replicated attention ("no gather") keeps
    the ordinary tree;
  * routed experts [L_g, E, ...] (or per-layer [E, ...] buffers) are split over `layout.expert_axes`;
everything else replicated (`mesh_rules`). Tokens (requests) are split over `layout.batch_axes`.

Quantized weights (tbjax/model/quant.py) stay quantized on the mesh (their codes, scales and zeros are placed like the
weight: routed experts split over E), except the attention weights of a packed plan: the packed layout is the
plan's (bf16) and does not know the checkpoint's format, so they are dequantized into the buffer (1/N per device);
fp8 ones keep their own block scales on an fp8 wire (lossless round trip, sharding/packed.py).

Restrictions (refused with MeshMismatch): tp = pp = 1; expert_axes and attn_axes must be subsets of batch_axes
(each device's tokens are its own, so results never need to be re-replicated); one attention kind for all layers
when attention is packed (one packed layout).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharding import packed as pk
from sharding import rules as sr
from sharding.mesh import DecodeLayout, MeshMismatch, axes_size, check_decode_fit
from sharding.prefetch import gather_buffer
from tbjax.model.kinds import ATTENTION_KINDS
from tbjax.model.moe import EPContext
from tbjax.model.quant import QuantizedWeight, dequantize
from tbjax.model.transformer import LoopContext, forward_dense, layer_plan
from tbjax.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    spec: ModelSpec
    layout: DecodeLayout
    mesh_shape: tuple[tuple[str, int], ...]
    attn_kind: str
    attn_pack: pk.PackedLayout
    attn_shards: int                                   # N: attention buffers are split 1/N (1 = replicated)

    @property
    def mesh_dict(self) -> dict[str, int]:
        return dict(self.mesh_shape)

    @property
    def attn_layer_bytes(self) -> int:
        """Bytes of one gathered layer buffer (what a device holds per layer when replicated)."""
        return self.attn_pack.padded_bytes(self.attn_shards)

    @property
    def attn_shard_bytes(self) -> int:
        return self.attn_pack.shard_bytes(self.attn_shards)

    @property
    def packed(self) -> bool:
        """Attention weights live packed in params["attn_packed"], split over the attention axes (when those hold
        more than one device; on one device the plain tree is used: nothing to gather)."""
        return self.attn_shards > 1


def make_plan(spec: ModelSpec, mesh, layout: DecodeLayout, dtype=None, fp8_scales=None,
              fp8_block=(128, 128)) -> MeshPlan:
    """Static plan; checks the mesh fits (experts over expert_axes; axes subsets of batch_axes; tp = pp = 1).

    attn_wire="fp8": with `fp8_scales` (from an fp8 checkpoint, tbjax.weights.hf_names_moe.load_hf) exactly the
    attention matrices that were fp8 in the checkpoint travel as fp8 with their own scales (lossless); the rest
    travel in `dtype`. Without scales every attention matrix is quantized with amax scales in `fp8_block` blocks."""
    shape = {k: int(v) for k, v in dict(mesh.shape).items()}
    for what, axes in (("expert_axes", layout.expert_axes), ("attn_axes", layout.attn_axes)):
        extra = [a for a in axes if a not in layout.batch_axes]
        if extra:
            raise MeshMismatch(f"DecodeLayout.{what}={axes} uses {extra}, which are not batch axes "
                               f"{layout.batch_axes}: every sharded axis must also split the requests")
    kinds = {spec.layer_kind(i)[0] for i in range(spec.n_layers)}
    if len(kinds) != 1:
        raise MeshMismatch(f"{spec.arch}: mixed attention kinds {sorted(kinds)} cannot share one packed layout")
    check_decode_fit(shape, layout, n_tokens=axes_size(shape, layout.batch_axes),
                     n_experts=spec.moe.n_experts if spec.moe else None,
                     n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads)
    akind = kinds.pop()
    dt = jnp.dtype(dtype or spec.dtype)
    shapes = ATTENTION_KINDS[akind].shapes(spec)
    fp8_names = None
    if fp8_scales is not None:
        fp8_block = tuple(fp8_scales["block"])
        lp = layer_plan(spec)
        fp8_names = tuple(k for k in shapes
                          if all(k in fp8_scales["groups"].get(g, {}) for (g, _a, _f, _j) in lp))
    apack = pk.make_layout({k: (v, dt) for k, v in shapes.items()}, wire=layout.attn_wire, block=fp8_block,
                           fp8_names=fp8_names)
    n = axes_size(shape, layout.attn_axes) if layout.attn_axes else 1
    return MeshPlan(spec, layout, tuple(shape.items()), akind, apack, n)


def stack_attention(params, plan: MeshPlan, fp8_scales=None):
    """{name: [L, ...]} in layer order from the group tree (and matching fp8 scales, where every layer has them)."""
    spec = plan.spec
    lp = layer_plan(spec)
    names = plan.attn_pack.names

    def layer_w(g, n, j):
        w = params["groups"][g][n][j]
        return dequantize(w, plan.attn_pack.entry(n).dtype) if isinstance(w, QuantizedWeight) else w
    out = {n: jnp.stack([layer_w(g, n, j) for (g, _a, _f, j) in lp]) for n in names}
    scales = {}
    if plan.layout.attn_wire == "fp8":          # fp8 weights travel with their own scales (exact round trip)
        for n in names:
            e = plan.attn_pack.entry(n)
            ws = [params["groups"][g][n][j] for (g, _a, _f, j) in lp]
            if e.encoding == "fp8_block" and all(isinstance(w, QuantizedWeight) and w.fmt == "fp8" and
                                                 w.block == tuple(e.block) for w in ws):
                scales[n] = jnp.stack([w.materialize().scale for w in ws])
    if fp8_scales is not None and plan.layout.attn_wire == "fp8":
        blk = tuple(fp8_scales["block"])
        for n in names:
            e = plan.attn_pack.entry(n)
            if e.encoding != "fp8_block":
                continue
            per = [fp8_scales["groups"].get(g, {}).get(n) for (g, _a, _f, _j) in lp]
            if n not in scales and all(s is not None for s in per) and blk == e.block:
                scales[n] = jnp.stack([jnp.asarray(per[i][j]) for i, (_g, _a, _f, j) in enumerate(lp)])
    return out, scales


def mesh_tree(params, plan: MeshPlan, fp8_scales=None):
    """The mesh parameter tree (not placed): the model tree, with the attention weights moved into
    params["attn_packed"] [L, N * shard bytes] when the plan packs them. Works on stacked groups and on
    per-layer buffers (lists)."""
    if not plan.packed:
        return params
    attn, scales = stack_attention(params, plan, fp8_scales)
    packed = pk.pack_stacked(attn, plan.attn_pack, plan.attn_shards, scales)
    names = set(plan.attn_pack.names)
    tree = {k: v for k, v in params.items() if k != "groups"}
    tree["groups"] = {g: {k: v for k, v in gp.items() if k not in names} for g, gp in params["groups"].items()}
    tree["attn_packed"] = packed
    return tree


def mesh_params(params, plan: MeshPlan, mesh, fp8_scales=None):
    """`mesh_tree` placed on `mesh` by `mesh_rules`."""
    return sr.shard_tree(mesh_tree(params, plan, fp8_scales), mesh_rules(plan), mesh)


def mesh_rules(plan: MeshPlan):
    return sr.decode_rules(plan.layout.expert_axes, plan.layout.attn_axes)


def loop_context(plan: MeshPlan, moe_stats: list | None = None) -> LoopContext:
    """How `run_layers` runs on this plan's mesh (inside the shard_map)."""
    lay = plan.layout
    fetch = (lambda s: gather_buffer(s, lay.attn_axes, lay.attn_gather)) if plan.packed else None
    ep = EPContext(expert_axes=lay.expert_axes, batch_axes=lay.batch_axes, mode=lay.ep_mode,
                   capacity_factor=lay.capacity_factor)
    return LoopContext(attn_pack=plan.attn_pack if plan.packed else None, fetch=fetch, ep=ep, moe_stats=moe_stats)


def _bax(axes):
    return tuple(axes) if axes else None


def make_forward(plan: MeshPlan, mesh, param_tree):
    """jitted f(mparams, tokens_T, positions_T, segment_ids_T) -> (logits_TV float32, stats): whole sequences (dense
    causal attention per segment) on the mesh, through the engine's layer loop.

    Tokens are split over the batch axes in contiguous blocks; a segment (sequence) must not straddle two devices.
    stats: {"expert_load_LE": int32 [MoE layers, E] (assignments per expert, all tokens),
            "dropped_L": int32 [MoE layers] (pairs dropped by all_to_all capacity)}.
    `param_tree` (arrays or ShapeDtypeStructs of the mesh tree) gives the in_specs.
    """
    spec, lay = plan.spec, plan.layout
    bax = _bax(lay.batch_axes)
    specs = sr.match_rules(param_tree, mesh_rules(plan))
    n_moe = sum(1 for i in range(spec.n_layers) if spec.layer_kind(i)[1] == "moe")
    E = spec.moe.n_experts if spec.moe else 0

    def body(mp, tok, pos, seg):
        stats: list = []
        logits, _ = forward_dense(mp, spec, tok, pos, seg, ctx=loop_context(plan, stats))
        if n_moe:
            load = jnp.stack([s["load_E"] for s in stats])
            drop = jnp.stack([s["dropped"] for s in stats])
            drop = jax.lax.psum(drop, lay.batch_axes) if lay.batch_axes else drop
        else:
            load = jnp.zeros((0, E), jnp.int32)
            drop = jnp.zeros((0,), jnp.int32)
        return logits, {"expert_load_LE": load, "dropped_L": drop}

    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(bax), P(bax), P(bax)),
                       out_specs=(P(bax), {"expert_load_LE": P(), "dropped_L": P()}))
    jfn = jax.jit(fn, compiler_options=xla_options(lay) or None)
    nb = axes_size(plan.mesh_dict, lay.batch_axes)

    def run(mparams, tokens_T, positions_T, segment_ids_T):
        T = tokens_T.shape[0]
        check_decode_fit(plan.mesh_dict, lay, n_tokens=T, n_experts=spec.moe.n_experts if spec.moe else None,
                         n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads)
        seg = np.asarray(segment_ids_T)
        per = T // nb
        for d in range(1, nb):
            if seg[d * per - 1] == seg[d * per]:
                raise MeshMismatch(f"segment {int(seg[d * per])} straddles devices {d - 1} and {d} of the batch "
                                   f"axes ({per} tokens per device): pack whole sequences per device")
        sh = jax.sharding.NamedSharding(mesh, P(bax))
        args = [jax.device_put(jnp.asarray(a, jnp.int32), sh) for a in (tokens_T, positions_T, segment_ids_T)]
        return jfn(mparams, *args)

    run.jitted = jfn
    return run


def xla_options(layout: DecodeLayout) -> dict:
    """Per-program XLA options. With all-gather prefetch, XLA's GPU all-gather combiner merges independent
    gathers: the next layer's weights with the MoE token gather (moving the prefetch onto the critical path), or,
    with all-to-all expert dispatch, every layer's weight gather into one synchronous gather at the start.
    Disabling the combiner for this program keeps them apart (tests/sharding/test_sharding_hlo.py). The option is a
    GPU one; other backends ignore it."""
    if layout.attn_axes and layout.attn_gather == "all_gather":
        return {"xla_gpu_all_gather_combine_threshold_bytes": 0}
    if layout.attn_axes and layout.attn_gather == "ppermute":     # keep each layer's ring steps apart
        return {"xla_gpu_collective_permute_combine_threshold_bytes": 0}
    return {}


def abstract_mesh_params(plan: MeshPlan, dtype=None):
    """ShapeDtypeStructs of the mesh tree (global shapes), without allocating weights."""
    from tbjax.model.params import param_shapes
    ps = param_shapes(plan.spec, dtype)
    if not plan.packed:
        return ps
    names = set(plan.attn_pack.names)
    tree = {k: v for k, v in ps.items() if k != "groups"}
    tree["groups"] = {g: {k: v for k, v in gp.items() if k not in names} for g, gp in ps["groups"].items()}
    tree["attn_packed"] = jax.ShapeDtypeStruct((plan.spec.n_layers, plan.attn_layer_bytes), jnp.uint8)
    return tree
