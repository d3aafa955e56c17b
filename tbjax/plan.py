"""Capacity planner: `python -m tbjax.plan CONFIG --mesh dp=8,ep=1` prints what one device holds on a decode mesh
(weights by kind, KV bytes per token, activations, free memory) and the largest batch at a context length, with
attention weights replicated and with DP attention-weight sharding.

Why: at trillion-parameter scale memory, not compute, caps the batch; this shows where the bytes go and what
DP attention sharding buys. Every weight number comes from the model's own parameter tree
(`jax.eval_shape(init_params)`) and the packed attention layout the decode program uses (sharding/packed.py),
never from a separate formula. Activations are an estimate (labelled so).

Placement (sharding/mesh.DecodeLayout, defaults = every role over all of ('dp', 'ep')): routed experts 1/N_ep;
attention weights replicated, or 1/N_attn plus two gathered layers (the current one and the prefetched one);
everything else replicated. KV and activations scale with this device's own requests (attention DP).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import jax
import jax.numpy as jnp

from sharding import packed as pk
from sharding.mesh import AXES, DecodeLayout, MeshMismatch, axes_size, parse_mesh_arg
from tbjax import cli
from tbjax.model import quant
from tbjax.model.kinds import ATTENTION_KINDS
from tbjax.model.params import init_params
from tbjax.spec import ModelSpec, SpecError

GIB = 1024 ** 3
KINDS = ("attention", "routed experts", "shared experts", "dense FFN", "router", "embedding + head", "norms")


class PlanError(ValueError):
    """Bad planner input (unknown weight format, a mesh that does not fit, too little memory)."""


def abstract_params(spec: ModelSpec):
    """ShapeDtypeStructs of the parameter tree, from the model's own init (nothing allocated)."""
    return jax.eval_shape(lambda: init_params(spec, jax.random.key(0)))


def _kind(spec: ModelSpec, path: tuple[str, ...]) -> str:
    if path[0] in ("embed", "lm_head"):
        return "embedding + head"
    if path[0] == "final_norm":
        return "norms"
    group, name = path[1], path[-1]
    g = next(x for x in spec.layer_groups if x.name == group)
    if name in ATTENTION_KINDS[g.attention].shapes(spec):
        return "attention"
    if name.startswith("we_"):
        return "routed experts"
    if name.startswith("ws_"):
        return "shared experts"
    if name in ("router", "router_bias"):
        return "router"
    if name == "mlp_norm":
        return "norms"
    return "dense FFN"


def leaf_bytes(name: str, shape, weights: str, dtype, *, checkpoint: bool = False) -> int:
    """Resident bytes of one parameter leaf when the model's matrices are held as `weights` (fp8, int8, int4: the
    byte count of tbjax/model/quant.py's own layout for that leaf, codes plus float32 scales and zeros; float: the
    dtype's). Norms, biases and routers stay float (quant.matrix_in_axis); a `checkpoint` fp8 model (DeepSeek /
    Kimi block-scaled files) also keeps its embedding and head float, as the file ships them."""
    ax = quant.matrix_in_axis(name, len(shape))
    if weights in quant.FORMATS and ax is not None and not (checkpoint and name in ("embed", "lm_head")):
        # an fp8 checkpoint keeps its 128 x 128 blocks; fp8 quantized at load is per output channel
        group = quant.FP8_BLOCK[0] if checkpoint and weights == "fp8" else None
        return quant.quantized_nbytes(shape, weights, ax, group)
    return math.prod(shape) * jnp.dtype(dtype).itemsize


WEIGHTS = ("checkpoint", "fp8", "int8", "int4", "bfloat16", "float16", "float32")


def resolve_weights(spec: ModelSpec, weights: str) -> str:
    if weights == "checkpoint":
        return "fp8" if spec.quant == "fp8_block128" else spec.dtype
    if weights not in WEIGHTS:
        raise PlanError(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    return weights


def weight_bytes(spec: ModelSpec, weights: str = "checkpoint") -> dict[str, int]:
    """Total bytes (whole model) per kind of weight, as held resident."""
    w = resolve_weights(spec, weights)
    dt = spec.dtype if w in quant.FORMATS else w
    out = dict.fromkeys(KINDS, 0)
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(spec))[0]:
        names = tuple(str(getattr(p, "key", p)) for p in path)
        out[_kind(spec, names)] += leaf_bytes(names[-1], leaf.shape, w, dt, checkpoint=weights == "checkpoint")
    return out


def param_counts(spec: ModelSpec) -> dict[str, int]:
    out = dict.fromkeys(KINDS, 0)
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(spec))[0]:
        names = tuple(str(getattr(p, "key", p)) for p in path)
        out[_kind(spec, names)] += math.prod(leaf.shape)
    return out


def attention_layout(spec: ModelSpec, weights: str = "checkpoint") -> pk.PackedLayout:
    """The packed per-layer attention buffer the decode program would ship: fp8 weights travel as fp8, int8 / int4
    ones dequantized to the compute dtype (tbjax/model/mesh_forward.stack_attention)."""
    w = resolve_weights(spec, weights)
    akind = spec.layer_kind(0)[0]
    shapes = ATTENTION_KINDS[akind].shapes(spec)
    dt = spec.dtype if w in quant.FORMATS else w
    return pk.make_layout({k: (v, dt) for k, v in shapes.items()}, wire="fp8" if w == "fp8" else "native",
                          block=quant.FP8_BLOCK)


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str = "bfloat16") -> int:
    """KV cache bytes per token, all layers: MLA caches the latent (kv_lora + rope dims), GQA caches K and V."""
    b = {"bfloat16": 2, "float16": 2, "fp8": 1, "float32": 4}.get(kv_dtype)
    if b is None:
        raise PlanError(f"--kv-dtype must be bfloat16, float16, fp8 or float32, got {kv_dtype!r}")
    per_layer = (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) if spec.mla else 2 * spec.n_kv_heads * spec.head_dim
    return spec.n_layers * per_layer * b


def activation_bytes_per_token(spec: ModelSpec) -> int:
    """Estimate of the decode working set per token (bytes): f32 logits, a few hidden-size buffers, the largest of
    attention (latent-absorbed q/o for MLA) and FFN intermediates (top_k experts, dispatch copies x2)."""
    D, N = spec.d_model, spec.n_heads
    if spec.mla:
        attn = 2 * N * (2 * spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) * 2
    else:
        attn = (2 * N + 2 * spec.n_kv_heads) * spec.head_dim * 2
    ffn = 3 * spec.ffn_dim * 2
    if spec.moe:
        ffn = max(ffn, 2 * spec.moe.top_k * (D + 3 * spec.moe.expert_ffn_dim) * 2
                  + 3 * spec.moe.shared_ffn_dim * 2)
    return 4 * spec.vocab_size + 6 * D * 2 + max(attn, ffn)


def draft_kv_bytes(spec: ModelSpec, context: int, *, window: int = 128, num_tokens: int = 4, page_size: int = 16,
                   kv_dtype: str = "bfloat16") -> dict:
    """KV bytes one sequence's speculative draft holds (tbjax/engine/speculative.py): the sliding-window ring
    (ring_pages pages of page_size tokens, whatever the context) vs a full-attention draft of the same model at
    ``context`` tokens (rounded up to pages). ``spec`` is the draft's model (the target itself for "self")."""
    from tbjax.engine.speculative import ring_pages
    tok = kv_bytes_per_token(spec, kv_dtype)
    ring = ring_pages(window, page_size, num_tokens)
    full_pages = -(-context // page_size)
    return {"window": window, "num_tokens": num_tokens, "page_size": page_size, "ring_pages": ring,
            "windowed_bytes": ring * page_size * tok, "full_bytes": full_pages * page_size * tok,
            "saved_bytes": max(0, (full_pages - ring) * page_size * tok)}


def plan(spec: ModelSpec, mesh_shape: dict[str, int], layout: DecodeLayout = DecodeLayout(), *,
         hbm_bytes: int = 140 * GIB, context: int = 8192, weights: str = "checkpoint",
         kv_dtype: str = "bfloat16", reserve_bytes: int = 4 * GIB, speculative=None,
         draft_spec: ModelSpec | None = None) -> dict:
    """Per-device memory composition and max batch, replicated vs DP-sharded attention. Bytes everywhere.
    ``speculative`` (a dict or tbjax.engine.speculative.SpeculativeConfig): each sequence also holds its draft's
    KV ring (of ``draft_spec``, default the target: the "self" draft, no extra weights; a separate draft's weights
    are replicated on every device)."""
    shape = {a: int(mesh_shape.get(a, 1)) for a in AXES}
    for a in ("tp", "pp"):
        if shape[a] != 1:
            raise MeshMismatch(f"mesh axis {a}={shape[a]}: the decode layout does not use {a} (set it to 1)")
    n_ep = axes_size(shape, layout.expert_axes)
    n_attn = axes_size(shape, layout.attn_axes) if layout.attn_axes else 1
    n_batch = axes_size(shape, layout.batch_axes)
    if spec.moe and spec.moe.n_experts % n_ep:
        raise MeshMismatch(f"routed experts: {spec.moe.n_experts} cannot be split over mesh axes "
                           f"{' x '.join(f'{a}={shape[a]}' for a in layout.expert_axes)} (size {n_ep})")
    total = weight_bytes(spec, weights)
    lay = attention_layout(spec, weights)
    layer = lay.padded_bytes(1)
    attn_repl = total["attention"]             # replicated: every layer's weights as held resident
    attn_shard = spec.n_layers * lay.shard_bytes(n_attn) + (2 * lay.padded_bytes(n_attn) if n_attn > 1 else 0)
    common = {k: v for k, v in total.items() if k not in ("attention", "routed experts")}
    common["routed experts"] = total["routed experts"] // n_ep if spec.moe else 0
    kv_tok = kv_bytes_per_token(spec, kv_dtype)
    act_tok = activation_bytes_per_token(spec)
    draft = None
    if speculative is not None:
        from tbjax.engine.speculative import SpeculativeConfig
        sc = SpeculativeConfig.parse(speculative)
        dspec = draft_spec or spec
        draft = draft_kv_bytes(dspec, context, window=sc.window, num_tokens=sc.num_tokens, kv_dtype=kv_dtype)
        draft["weights_bytes"] = 0 if draft_spec is None else sum(weight_bytes(draft_spec, weights).values())
        if draft["weights_bytes"]:
            common["speculative draft"] = draft["weights_bytes"]
    cols = {}
    for name, attn in (("replicated", attn_repl), ("dp_sharded", attn_shard)):
        w = sum(common.values()) + attn
        free = hbm_bytes - w - reserve_bytes
        per_seq = context * kv_tok + act_tok + (draft["windowed_bytes"] if draft else 0)
        b = max(0, free // per_seq)
        cols[name] = {"attention": attn, "weights": w, "free": free, "max_batch_per_device": int(b),
                      "max_batch_total": int(b) * n_batch}
    return {"arch": spec.arch, "mesh": shape, "devices": math.prod(shape.values()), "n_ep": n_ep,
            "n_attn": n_attn, "n_batch": n_batch, "hbm_bytes": hbm_bytes, "context": context,
            "weights": resolve_weights(spec, weights), "kv_dtype": kv_dtype, "reserve_bytes": reserve_bytes,
            "total_by_kind": total, "per_device_by_kind": common, "attention_layer_bytes": layer,
            "attention_params_per_layer": param_counts(spec)["attention"] // spec.n_layers,
            "params_total": sum(param_counts(spec).values()),
            "kv_bytes_per_token": kv_tok, "activation_bytes_per_token": act_tok, "columns": cols,
            "draft_kv": draft}


def _g(b) -> str:
    return f"{b / GIB:9.2f} GiB"


def format_plan(p: dict) -> str:
    mesh = " x ".join(f"{a}={n}" for a, n in p["mesh"].items() if n > 1 or a in ("dp", "ep"))
    lines = [f"{p['arch']}: {p['params_total'] / 1e9:.1f}B parameters, attention "
             f"{p['attention_params_per_layer'] / 1e6:.1f}M/layer; weights {p['weights']}, KV {p['kv_dtype']}",
             f"mesh {mesh} ({p['devices']} devices): experts 1/{p['n_ep']}, attention 1/{p['n_attn']} when sharded, "
             f"requests over {p['n_batch']}; HBM {p['hbm_bytes'] / GIB:.1f} GiB/device; context {p['context']}",
             "", f"{'per device':32s}{'replicated attn':>16s}{'DP-sharded attn':>18s}"]
    c = p["columns"]
    lines.append(f"{'attention weights':32s}{_g(c['replicated']['attention']):>16s}{_g(c['dp_sharded']['attention']):>18s}")
    for k in KINDS[1:] + ("speculative draft",):
        v = p["per_device_by_kind"].get(k, 0)
        if v:
            lines.append(f"{k:32s}{_g(v):>16s}{_g(v):>18s}")
    lines.append(f"{'reserve (workspace)':32s}{_g(p['reserve_bytes']):>16s}{_g(p['reserve_bytes']):>18s}")
    lines.append(f"{'free for KV + activations':32s}{_g(c['replicated']['free']):>16s}{_g(c['dp_sharded']['free']):>18s}")
    lines.append(f"{'KV per token (all layers)':32s}{p['kv_bytes_per_token'] / 1024:12.1f} KiB")
    lines.append(f"{'activations per token (est.)':32s}{p['activation_bytes_per_token'] / 1024:12.1f} KiB")
    lines.append(f"{'max batch @ ctx ' + str(p['context']) + ' (per dev)':32s}"
                 f"{c['replicated']['max_batch_per_device']:>16d}{c['dp_sharded']['max_batch_per_device']:>18d}")
    lines.append(f"{'max batch, whole mesh':32s}{c['replicated']['max_batch_total']:>16d}"
                 f"{c['dp_sharded']['max_batch_total']:>18d}")
    released = c["replicated"]["attention"] - c["dp_sharded"]["attention"]
    lines.append(f"DP attention sharding releases {released / GIB:.2f} GiB per device")
    d = p.get("draft_kv")
    if d:
        lines.append(f"speculative draft KV per sequence: window {d['window']} ({d['ring_pages']} pages of "
                     f"{d['page_size']}): {d['windowed_bytes'] / 2**20:.1f} MiB, vs "
                     f"{d['full_bytes'] / 2**20:.1f} MiB with full attention at {p['context']} tokens")
    return "\n".join(lines)


def release_table(specs: dict[str, ModelSpec], dps=(8, 16, 32), weights: str = "checkpoint") -> str:
    """Markdown: per-device attention-weight bytes, replicated vs 1/dp + two gathered layers."""
    rows = ["| model | weights | attention params (per layer x layers) | dp | replicated / device | "
            "DP-sharded / device (1/dp + 2 layers) | released / device |", "|---|---|---|---|---|---|---|"]
    for name, spec in specs.items():
        lay = attention_layout(spec, weights)
        per = param_counts(spec)["attention"] // spec.n_layers
        repl = spec.n_layers * lay.padded_bytes(1)
        for dp in dps:
            sh = spec.n_layers * lay.shard_bytes(dp) + 2 * lay.padded_bytes(dp)
            rows.append(f"| {name} | {resolve_weights(spec, weights)} | {per / 1e6:.1f}M x {spec.n_layers} | {dp} | "
                        f"{repl / GIB:.2f} GiB | {sh / GIB:.2f} GiB | {(repl - sh) / GIB:.2f} GiB |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=cli.prog("python -m tbjax.plan"), description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="+", help="config.json file(s) or model directories")
    ap.add_argument("--mesh", default="dp=8", help="mesh axes, e.g. dp=8,ep=2 (axes: dp, ep, tp, pp)")
    ap.add_argument("--context", type=int, default=8192, help="tokens per request (default 8192)")
    ap.add_argument("--hbm-gib", type=float, default=140.0,
                    help="device memory in GiB (default 140: an H200 reports 143771 MiB)")
    ap.add_argument("--weights", default="checkpoint",
                    help="matrices as held: checkpoint (as stored), fp8, int8, int4, bfloat16, float16, float32")
    ap.add_argument("--kv-dtype", default="bfloat16", help="bfloat16 or fp8")
    ap.add_argument("--reserve-gib", type=float, default=4.0, help="workspace kept free (default 4)")
    ap.add_argument("--experts-over", default="dp,ep", help="mesh axes the experts are split over")
    ap.add_argument("--attn-over", default="dp,ep", help="mesh axes the attention weights are split over")
    ap.add_argument("--release-table", default=None, help="print the markdown release table for dp=LIST, e.g. 8,16,32")
    ap.add_argument("--speculative", default=None,
                    help="count a speculative draft's KV ring per sequence: draft=self,num_tokens=4,window=128")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = ap.parse_args(argv)
    try:
        specs = {c: ModelSpec.from_hf_config(c) for c in a.config}
        if a.release_table:
            dps = tuple(int(x) for x in a.release_table.split(","))
            names = {s.arch if list(specs.values()).count(s) == 1 else c: s for c, s in specs.items()}
            print(release_table(names, dps, a.weights))
            return 0
        mesh = parse_mesh_arg(a.mesh)
        ax = lambda s: tuple(x for x in s.split(",") if x)  # noqa: E731
        layout = DecodeLayout(batch_axes=("dp", "ep"), expert_axes=ax(a.experts_over), attn_axes=ax(a.attn_over))
        for c, spec in specs.items():
            p = plan(spec, mesh, layout, hbm_bytes=int(a.hbm_gib * GIB), context=a.context, weights=a.weights,
                     kv_dtype=a.kv_dtype, reserve_bytes=int(a.reserve_gib * GIB), speculative=a.speculative)
            print(json.dumps(p) if a.json else format_plan(p))
    except (SpecError, MeshMismatch, PlanError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
