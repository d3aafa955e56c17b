"""Parameter trees of a model: shapes from the spec, random initialisation (benchmarks, tests).

Tree layout:
  {"embed": [V, D], "final_norm": [D], "lm_head": [D, V] (absent when tied),
   "groups": {group_name: {param: [L_group, ...]}}}
`jax.eval_shape(init_params, ...)` gives exact shapes and bytes without allocating (used by the planner).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tbjax.model.kinds import ATTENTION_KINDS, FFN_KINDS, require_kind
from tbjax.model.quant import QuantizedWeight
from tbjax.spec import ModelSpec


def group_shapes(spec: ModelSpec) -> dict[str, dict[str, tuple[int, ...]]]:
    out = {}
    for g in spec.layer_groups:
        require_kind(spec, g.attention, g.ffn)
        per = {**ATTENTION_KINDS[g.attention].shapes(spec), **FFN_KINDS[g.ffn].shapes(spec)}
        out[g.name] = {k: (len(g.layers), *v) for k, v in per.items()}
    return out


def param_shapes(spec: ModelSpec, dtype=None):
    dtype = jnp.dtype(dtype or spec.dtype)
    sd = lambda shp: jax.ShapeDtypeStruct(shp, dtype)  # noqa: E731
    tree = {"embed": sd((spec.vocab_size, spec.d_model)), "final_norm": sd((spec.d_model,)),
            "groups": {g: {k: sd(v) for k, v in ps.items()} for g, ps in group_shapes(spec).items()}}
    if not spec.tie_embeddings:
        tree["lm_head"] = sd((spec.d_model, spec.vocab_size))
    return tree


def _is_norm(spec, group, name):
    g = next(x for x in spec.layer_groups if x.name == group)
    return name in ATTENTION_KINDS[g.attention].norms or name in FFN_KINDS[g.ffn].norms


def init_params(spec: ModelSpec, key, dtype=None, std: float = 0.02):
    """Random weights at the spec's real shapes (norms = 1)."""
    shapes = param_shapes(spec, dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, s), k in zip(leaves, keys):
        names = [getattr(p, "key", None) for p in path]
        if names[-1] == "final_norm" or (names[0] == "groups" and _is_norm(spec, names[1], names[-1])):
            out.append(jnp.ones(s.shape, s.dtype))
        else:
            out.append((jax.random.normal(k, s.shape, jnp.float32) * std).astype(s.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def split_layer_buffers(params):
    """The same tree with each group's stacked [L, ...] parameters as a list of L per-layer arrays (copies).

    Why: XLA slices layer j out of a stacked weight inside the GEMM fusion that reads it, so the L layers' GEMMs are
    L distinct fusions, each autotuned and compiled (a Llama-8B decode program takes ~40 s to compile on the H200).
    Per-layer buffers make the layers' fusions identical, so XLA compiles each once. Costs a copy of the group
    weights while the stacked originals are still referenced."""
    groups = {g: {k: [v.take(i) if isinstance(v, QuantizedWeight) else v[i] for i in range(v.shape[0])]
                  for k, v in gp.items()} for g, gp in params["groups"].items()}
    return {**params, "groups": groups}


def first_layers(spec: ModelSpec, params, n: int):
    """(spec, params) of the model's first `n` layers with its own embedding, final norm and head: a small real
    model (its weights, tokenizer and layer kinds) for tests and quick experiments. Quantized weights slice along
    their stacking axis like arrays."""
    if not 0 < n <= spec.n_layers:
        raise ValueError(f"first_layers: n={n}, the model has {spec.n_layers} layers")
    small = spec.replace(n_layers=n, sliding_window_layers=tuple(i for i in spec.sliding_window_layers if i < n))
    keep = {g.name: sum(i < n for i in g.layers) for g in spec.layer_groups}
    groups = {name: jax.tree.map(lambda a, k=keep[name]: a[:k], tree)
              for name, tree in params["groups"].items() if keep[name]}
    if set(groups) != {g.name for g in small.layer_groups}:
        raise ValueError(f"first_layers: groups {sorted(groups)} do not match the small spec's "
                         f"{[g.name for g in small.layer_groups]}")
    return small, {**params, "groups": groups}
