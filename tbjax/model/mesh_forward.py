"""The forward pass on a decode mesh: attention data parallel, experts split over devices (EP), and every layer's
attention weights held 1/N per device and gathered just in time, one layer ahead (DP attention-weight sharding).

Why: at trillion-parameter scale the attention weights replicated on every attention-DP rank cost
61 layers x 187M parameters per device (DeepSeek-V3); sharding them 1/N and prefetching frees almost all of it
for KV cache, i.e. batch. Public engines (tpu-inference, SGLang) replicate them.

Layout (static, `MeshPlan`):
  attention weights of layer l (all of its attention kind's parameters, norms included) are packed into one
  uint8 buffer (sharding/packed.py), stacked [L, bytes] and split over `layout.attn_axes` (or replicated when
  that is empty); routed experts [L_g, E, ...] split over `layout.expert_axes`; everything else replicated
  (sharding/rules.py: decode_rules). Tokens are split over `layout.batch_axes`.
Program: one `jax.shard_map` over the mesh. Layers of one group (same FFN kind) run in a `lax.scan` whose step
is "FFN of layer l, then attention of layer l+1": the carry holds the gathered buffer of layer l+1, and each step
starts gathering layer l+2 (sharding/prefetch.py). Ending the step with attention is deliberate: XLA's GPU
latency-hiding scheduler puts the gather's done at the end of the step and its start just early enough to hide
it, so the attention compute is what gets overlapped (checked on optimized GPU HLO by tests/test_sharding_hlo.py).
Layer 0's attention runs before the scans (gathering layer 1 meanwhile); the last two steps are peeled so
nothing is gathered past the end. The carried buffer flows across group boundaries (one attention kind, hence one
packed layout for all layers).

Restrictions (refused with MeshMismatch): tp = pp = 1; expert_axes and attn_axes must be subsets of batch_axes
(each device's tokens are its own, so results never need to be re-replicated); windows must be uniform.
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
from sharding.prefetch import gather_buffer, prefetch_scan
from tbjax.model import layers as ly
from tbjax.model.kinds import ATTENTION_APPLY, ATTENTION_KINDS, FFN_APPLY
from tbjax.model.moe import EPContext, moe_ffn
from tbjax.model.transformer import layer_plan, lm_logits
from tbjax.spec import ModelSpec, rope_attention_scale


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    spec: ModelSpec
    layout: DecodeLayout
    mesh_shape: tuple[tuple[str, int], ...]
    attn_kind: str
    attn_pack: pk.PackedLayout
    attn_shards: int                                   # N: attention buffers are split 1/N (1 = replicated)
    runs: tuple[tuple[str, str, int, tuple[int, ...]], ...]   # (group, ffn kind, first index in group, layers)

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


def attention_names(spec: ModelSpec, kind: str) -> tuple[str, ...]:
    return tuple(ATTENTION_KINDS[kind].shapes(spec))


def _runs(spec: ModelSpec):
    plan = layer_plan(spec)
    runs = []
    for i, (g, _a, f, j) in enumerate(plan):
        if runs and runs[-1][0] == g and plan[i - 1][3] == j - 1:
            runs[-1][3].append(i)
        else:
            runs.append((g, f, j, [i]))
    return tuple((g, f, j, tuple(ls)) for g, f, j, ls in runs)


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
    windows = {spec.layer_window(i) for i in range(spec.n_layers)}
    if len(windows) != 1:
        raise MeshMismatch(f"{spec.arch}: per-layer sliding windows {sorted(map(str, windows))} are not supported "
                           "by the mesh forward (the layer scan needs one window)")
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
    return MeshPlan(spec, layout, tuple(shape.items()), akind, apack, n, _runs(spec))


def stack_attention(params, plan: MeshPlan, fp8_scales=None):
    """{name: [L, ...]} in layer order from the group tree (and matching fp8 scales, where every layer has them)."""
    spec = plan.spec
    lp = layer_plan(spec)
    names = plan.attn_pack.names
    out = {n: jnp.stack([params["groups"][g][n][j] for (g, _a, _f, j) in lp]) for n in names}
    scales = {}
    if fp8_scales is not None and plan.layout.attn_wire == "fp8":
        blk = tuple(fp8_scales["block"])
        for n in names:
            e = plan.attn_pack.entry(n)
            if e.encoding != "fp8_block":
                continue
            per = [fp8_scales["groups"].get(g, {}).get(n) for (g, _a, _f, _j) in lp]
            if all(s is not None for s in per) and blk == e.block:
                scales[n] = jnp.stack([jnp.asarray(per[i][j]) for i, (_g, _a, _f, j) in enumerate(lp)])
    return out, scales


def mesh_params(params, plan: MeshPlan, mesh, fp8_scales=None):
    """The decode-mesh parameter tree, placed on `mesh` by sharding/rules.decode_rules:
    {"embed", "final_norm", ["lm_head"], "attn": {"packed": uint8 [L, N*shard]}, "ffn": {group: {param: [L_g..]}}}"""
    attn, scales = stack_attention(params, plan, fp8_scales)
    packed = pk.pack_stacked(attn, plan.attn_pack, plan.attn_shards, scales)
    attn_names = set(plan.attn_pack.names)
    tree = {k: params[k] for k in ("embed", "final_norm", "lm_head") if k in params}
    tree["attn"] = {"packed": packed}
    tree["ffn"] = {g: {k: v for k, v in gp.items() if k not in attn_names} for g, gp in params["groups"].items()}
    return sr.shard_tree(tree, mesh_rules(plan), mesh)


def mesh_rules(plan: MeshPlan):
    return sr.decode_rules(plan.layout.expert_axes, plan.layout.attn_axes)


def _bax(axes):
    return tuple(axes) if axes else None


def make_forward(plan: MeshPlan, mesh, param_tree):
    """jitted f(mparams, tokens_T, positions_T, segment_ids_T) -> (logits_TV float32, stats).

    Tokens are split over the batch axes in contiguous blocks; a segment (sequence) must not straddle two devices.
    stats: {"expert_load_LE": int32 [MoE layers, E] (assignments per expert, all tokens),
            "dropped_L": int32 [MoE layers] (pairs dropped by all_to_all capacity)}.
    `param_tree` (arrays or ShapeDtypeStructs of the mesh tree) gives the in_specs.
    """
    spec, lay = plan.spec, plan.layout
    bax = _bax(lay.batch_axes)
    specs = sr.match_rules(param_tree, mesh_rules(plan))
    window = spec.layer_window(0)
    scale = rope_attention_scale(spec)
    sharded = bool(lay.attn_axes)
    ep = EPContext(expert_axes=lay.expert_axes, batch_axes=lay.batch_axes, mode=lay.ep_mode,
                   capacity_factor=lay.capacity_factor)
    n_moe = sum(1 for i in range(spec.n_layers) if spec.layer_kind(i)[1] == "moe")
    E = spec.moe.n_experts if spec.moe else 0

    def body(mp, tok, pos, seg):
        x = jnp.take(mp["embed"], tok, axis=0)
        cos, sin = ly.rope_cos_sin(pos, spec.rope)
        dt = x.dtype

        def attend(layer, q, k, v, cache):
            return ly.dense_causal_attention(q, k, v, pos, seg, scale=scale, window=window), cache

        def attn(x, buf, layer):
            p_attn = pk.unpack(buf, plan.attn_pack, dt)
            d, _ = ATTENTION_APPLY[plan.attn_kind](spec, p_attn, x, cos, sin, attend, layer, None)
            return x + d

        def ffn(fkind, x, ffn_p):
            if fkind == "moe":
                y, st = moe_ffn(spec, ffn_p, x, ep)
                return x + y, (st["load_E"], st["dropped"])
            return x + FFN_APPLY[fkind](spec, ffn_p, x), None

        def make_step(fkind):
            # One scan step = the FFN of layer l, then the attention of layer l+1 (weights: buf). Ending the step
            # with attention makes the scheduler, which places the next gather's done at the end of the step and
            # its start early enough to hide it, bracket the attention compute with that gather.
            def step(x, buf, xs):
                ffn_p, layer = xs
                x, ys = ffn(fkind, x, ffn_p)
                return attn(x, buf, layer + 1), ys
            return step

        stack = mp["attn"]["packed"]
        L = spec.n_layers
        fetch = (lambda s: gather_buffer(s, lay.attn_axes, lay.attn_gather)) if sharded else (lambda s: s)
        buf0 = fetch(stack[0])
        buf = fetch(stack[1]) if (sharded and L > 1) else None      # prefetch of layer 1 overlaps attention 0
        x = attn(x, buf0, jnp.int32(0))
        loads, drops = [], []

        def collect(fkind, ys):
            if fkind == "moe":
                loads.append(ys[0])
                drops.append(ys[1])

        for g, fkind, j0, layers in plan.runs:
            gp = mp["ffn"][g]
            step = make_step(fkind)
            l0 = layers[0]
            n = sum(1 for l in layers if l <= L - 3)      # steps that prefetch layer l+2: scanned
            if n:
                xs = (jax.tree.map(lambda a: a[j0:j0 + n], gp), jnp.arange(l0, l0 + n, dtype=jnp.int32))
                if sharded:
                    x, buf, ys = prefetch_scan(step, x, buf, xs, stack[l0 + 2:l0 + n + 2], fetch, lay.unroll)
                else:
                    def rstep(x, inp, step=step):
                        xs_l, b = inp
                        return step(x, b, xs_l)
                    x, ys = jax.lax.scan(rstep, x, (xs, stack[l0 + 1:l0 + n + 1]), unroll=lay.unroll)
                collect(fkind, ys)
            for l in layers[n:]:                          # peeled: layer L-2 (no gather left) and L-1 (FFN only)
                p = jax.tree.map(lambda a: a[j0 + l - l0], gp)
                if l == L - 2:
                    x, ys = step(x, buf if sharded else stack[L - 1], (p, jnp.int32(l)))
                else:
                    x, ys = ffn(fkind, x, p)
                collect(fkind, None if ys is None else jax.tree.map(lambda a: a[None], ys))
        h = ly.rms_norm(x, mp["final_norm"], spec.norm_eps)
        logits = lm_logits(mp, spec, h)
        if n_moe:
            load = jnp.concatenate(loads)
            drop = jax.lax.psum(jnp.concatenate(drops), lay.batch_axes) if lay.batch_axes else jnp.concatenate(drops)
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
    """Per-program XLA options. With all-gather prefetch and all-gather expert dispatch, XLA's GPU all-gather
    combiner merges the next layer's weight gather with the MoE token gather (same replica groups, independent,
    both small enough), which moves the prefetch onto the critical path (its start lands right before the MoE
    dispatch). Disabling the combiner for this program keeps them apart (tests/test_sharding_hlo.py). The option
    is a GPU one; other backends ignore it."""
    if layout.attn_axes and layout.attn_gather == "all_gather" and layout.ep_mode == "gather":
        return {"xla_gpu_all_gather_combine_threshold_bytes": 0}
    return {}


def abstract_mesh_params(plan: MeshPlan, dtype=None):
    """ShapeDtypeStructs of the decode-mesh tree (global shapes), without allocating weights."""
    from tbjax.model.params import param_shapes
    spec = plan.spec
    ps = param_shapes(spec, dtype)
    names = set(plan.attn_pack.names)
    tree = {k: ps[k] for k in ("embed", "final_norm", "lm_head") if k in ps}
    tree["attn"] = {"packed": jax.ShapeDtypeStruct((spec.n_layers, plan.attn_layer_bytes), jnp.uint8)}
    tree["ffn"] = {g: {k: v for k, v in gp.items() if k not in names} for g, gp in ps["groups"].items()}
    return tree


def attention_param_count(spec: ModelSpec) -> int:
    """Attention parameters of one layer (norms included) from the layer kind's shapes."""
    akind = spec.layer_kind(0)[0]
    return sum(math.prod(s) for s in ATTENTION_KINDS[akind].shapes(spec).values())
