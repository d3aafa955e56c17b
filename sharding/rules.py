"""Partition rules: parameter paths ("ffn/mla_moe/we_gate") matched by regular expressions to PartitionSpecs.

Why: one table says how every parameter is laid out on a mesh, so loaders, checkpoint restore and the decode
program agree, and a new layout is a new table rather than new code. The first matching rule wins; a parameter
that no rule matches is an error (silently replicating a trillion-parameter tensor is never what you want), unless
the table ends with a catch-all.
"""
from __future__ import annotations

import re
from typing import Iterable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

Rule = tuple[str, P]


class RuleError(ValueError):
    """No rule matches a parameter, or a rule's spec does not fit the parameter."""


def path_str(path) -> str:
    """A tree path (from tree_flatten_with_path) as 'a/b/c'."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def match_rules(tree, rules: Sequence[Rule]):
    """Tree of PartitionSpecs, one per leaf, from the first rule whose regex `re.search`es the leaf's path.
    Leaves may be arrays or ShapeDtypeStructs; the spec's rank must not exceed the leaf's."""
    compiled = [(re.compile(pat), spec) for pat, spec in rules]

    def one(path, leaf):
        ps = path_str(path)
        for rx, spec in compiled:
            if rx.search(ps):
                if len(spec) > len(leaf.shape):
                    raise RuleError(f"rule {rx.pattern!r} gives {spec} (rank {len(spec)}) to {ps} of shape "
                                    f"{tuple(leaf.shape)}")
                return spec
        raise RuleError(f"no partition rule matches parameter {ps!r} (shape {tuple(leaf.shape)})")

    return jax.tree_util.tree_map_with_path(one, tree)


def check_specs_fit(tree, specs, mesh_shape: dict[str, int]):
    """Every sharded dimension must divide by the product of its axes' sizes: else RuleError naming them."""
    def one(path, leaf, spec):
        for d, entry in enumerate(spec):
            axes = _axes_of(entry)
            size = 1
            for a in axes:
                if a not in mesh_shape:
                    raise RuleError(f"{path_str(path)}: axis {a!r} is not in the mesh ({', '.join(mesh_shape)})")
                size *= int(mesh_shape[a])
            if leaf.shape[d] % size:
                raise RuleError(f"{path_str(path)}: dimension {d} of size {leaf.shape[d]} cannot be split over "
                                f"mesh axes {' x '.join(f'{a}={mesh_shape[a]}' for a in axes)} (size {size})")
        return spec

    return jax.tree_util.tree_map_with_path(one, tree, specs)


def shardings(tree, rules: Sequence[Rule], mesh) -> object:
    """Tree of NamedShardings on `mesh` for the leaves of `tree` (checked to fit)."""
    specs = match_rules(tree, rules)
    check_specs_fit(tree, specs, dict(mesh.shape))
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def shard_tree(tree, rules: Sequence[Rule], mesh):
    """device_put every leaf with the sharding its rule gives."""
    return jax.device_put(tree, shardings(tree, rules, mesh))


def _ax(axes: Iterable[str]):
    axes = tuple(axes)
    if not axes:
        return None
    return axes if len(axes) > 1 else axes[0]


def decode_rules(expert_axes: Sequence[str], attn_axes: Sequence[str]) -> list[Rule]:
    """Rules for the decode-mesh parameter tree built by tbjax (see tbjax/model/mesh_forward.py):
      attn_packed           uint8 [L, bytes]: split over attn_axes (replicated when attn_axes is empty)
      groups/<g>/we_*       routed experts [L, E, ...]: E split over expert_axes
      groups/<g>/we_*/<l>   the same as per-layer buffers [E, ...]
      everything else       replicated (embeddings, head, norms, routers, dense and shared-expert FFNs)
    A quantized weight's leaves (<param>/q, /scale, /zero: codes, scales, zero points with the weight's leading
    axes) follow the weight's rule.
    """
    ea, aa = _ax(expert_axes), _ax(attn_axes)
    qleaf = r"(/(q|scale|zero))?$"
    return [
        (r"^attn_packed$", P(None, aa)),
        (r"^groups/[^/]+/we_(gate|up|down)" + qleaf, P(None, ea)),
        (r"^groups/[^/]+/we_(gate|up|down)/\d+" + qleaf, P(ea)),
        (r".*", P()),
    ]
