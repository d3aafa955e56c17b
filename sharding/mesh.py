"""Named device meshes for tbjax: axes `dp`, `ep`, `tp`, `pp`, and the checks that a model fits a mesh.

Why this module exists: every program in tbjax runs under `jax.shard_map` over a named mesh (a 1x1x1x1 mesh on
one device), so the places where a model can fail to fit (heads, experts, batch not divisible by an axis; too few
devices) are checked once, here, with errors that name the axis and the numbers.

Axis roles (the defaults used by the decode mesh, see `DecodeLayout`):
  dp  attention data parallel: requests are split over it; attention weights are split 1/N over it
      (DP attention-weight sharding) or replicated.
  ep  expert parallel: experts are split over it.
  tp  tensor parallel (attention heads / FFN columns). Meshes may carry it; the decode forward refuses tp > 1.
  pp  pipeline stages (prefill). Meshes may carry it; the decode forward refuses pp > 1.
Which axes play which role is a setting (`DecodeLayout`), not hard-wired: e.g. the trillion-parameter layout
puts requests, experts and attention-weight shards over ('dp', 'ep') together, i.e. over every device.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from pallas_kernels.utils import is_int

AXES = ("dp", "ep", "tp", "pp")


class MeshMismatch(ValueError):
    """A model, batch or layout does not fit a mesh (names the axis and the numbers)."""


def make_mesh(dp: int = 1, ep: int = 1, tp: int = 1, pp: int = 1, devices: Sequence | None = None) -> Mesh:
    """A mesh with all four named axes (size-1 axes included), shape (dp, ep, tp, pp), axis types Explicit.

    `devices` defaults to `jax.devices()`; the first dp*ep*tp*pp of them are used.
    """
    sizes = dict(dp=dp, ep=ep, tp=tp, pp=pp)
    for name, n in sizes.items():
        if not is_int(n, numpy=True) or n < 1:
            raise MeshMismatch(f"mesh axis {name!r} must be a positive integer, got {n!r}")
    need = dp * ep * tp * pp
    devs = list(jax.devices() if devices is None else devices)
    if need > len(devs):
        raise MeshMismatch(f"mesh dp={dp} x ep={ep} x tp={tp} x pp={pp} needs {need} devices "
                           f"but only {len(devs)} are available")
    arr = np.array(devs[:need], dtype=object).reshape(dp, ep, tp, pp)
    return Mesh(arr, AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 4)


def parse_mesh_arg(text: str) -> dict[str, int]:
    """'dp=8,ep=2' -> {'dp': 8, 'ep': 2}. Unknown axes and malformed entries raise MeshMismatch."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise MeshMismatch(f"mesh entry {part!r} is not of the form axis=size (axes: {', '.join(AXES)})")
        k, v = (s.strip() for s in part.split("=", 1))
        if k not in AXES:
            raise MeshMismatch(f"unknown mesh axis {k!r}; axes are {', '.join(AXES)}")
        try:
            n = int(v)
        except ValueError:
            raise MeshMismatch(f"mesh axis {k!r}: size {v!r} is not an integer") from None
        if n < 1:
            raise MeshMismatch(f"mesh axis {k!r}: size must be >= 1, got {n}")
        out[k] = n
    return out


def axes_size(mesh_shape: dict[str, int], axes: Sequence[str]) -> int:
    """Product of the sizes of `axes` in a mesh shape (a dict axis -> size, e.g. `mesh.shape`)."""
    for a in axes:
        if a not in mesh_shape:
            raise MeshMismatch(f"axis {a!r} is not in the mesh (axes: {', '.join(mesh_shape)})")
    return math.prod(int(mesh_shape[a]) for a in axes)


def _fmt_axes(mesh_shape, axes) -> str:
    return " x ".join(f"{a}={mesh_shape[a]}" for a in axes) or "(no axes)"


def check_divisible(what: str, n: int, mesh_shape: dict[str, int], axes: Sequence[str]):
    """Raise MeshMismatch naming `what`, the axes and the numbers unless n is divisible by their total size."""
    size = axes_size(mesh_shape, axes)
    if n % size:
        raise MeshMismatch(f"{what}: {n} cannot be split over mesh axes {_fmt_axes(mesh_shape, axes)} "
                           f"(size {size}; {n} % {size} = {n % size})")


@dataclasses.dataclass(frozen=True)
class DecodeLayout:
    """Which mesh axes play which role in the decode program, and how attention weights travel.

    batch_axes:   requests (tokens) are split over these (attention data parallelism).
    expert_axes:  routed experts are split over these (expert parallelism); replicated over the others.
    attn_axes:    every layer's packed attention buffer is split 1/N over these and gathered per layer;
                  () means replicated ("plain replication": no gather at all).
    attn_gather:  "all_gather" (one all-gather per layer) or "ppermute" (a ring of N-1 collective permutes).
    attn_wire:    "native" (the weights' dtype) or "fp8" (e4m3 with block scales; exact for fp8 checkpoints).
    ep_mode:      "gather" (all-gather tokens over expert_axes, reduce-scatter results) or
                  "all_to_all" (dispatch / combine with fixed per-destination capacity).
    capacity_factor: for all_to_all: per-destination slots = ceil(factor * T_local * top_k / n_ep), capped at
                  T_local * top_k; None = T_local * top_k (never drops). Dropped pairs are counted.
    unroll:       passed to the layer `lax.scan` (1 = rolled loop, which bounds in-flight gathers to one layer).
    """
    batch_axes: tuple[str, ...] = ("dp", "ep")
    expert_axes: tuple[str, ...] = ("dp", "ep")
    attn_axes: tuple[str, ...] = ("dp", "ep")
    attn_gather: str = "all_gather"
    attn_wire: str = "native"
    ep_mode: str = "gather"
    capacity_factor: float | None = None
    unroll: int | bool = 1

    def __post_init__(self):
        for f in ("batch_axes", "expert_axes", "attn_axes"):
            v = getattr(self, f)
            if not isinstance(v, tuple):
                object.__setattr__(self, f, tuple(v))
            for a in getattr(self, f):
                if a not in AXES:
                    raise MeshMismatch(f"DecodeLayout.{f}: unknown axis {a!r} (axes: {', '.join(AXES)})")
        if self.attn_gather not in ("all_gather", "ppermute"):
            raise MeshMismatch(f"DecodeLayout.attn_gather must be 'all_gather' or 'ppermute', got {self.attn_gather!r}")
        if self.attn_wire not in ("native", "fp8"):
            raise MeshMismatch(f"DecodeLayout.attn_wire must be 'native' or 'fp8', got {self.attn_wire!r}")
        if self.ep_mode not in ("gather", "all_to_all"):
            raise MeshMismatch(f"DecodeLayout.ep_mode must be 'gather' or 'all_to_all', got {self.ep_mode!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise MeshMismatch(f"DecodeLayout.capacity_factor must be > 0, got {self.capacity_factor!r}")

    def replace(self, **kw) -> "DecodeLayout":
        return dataclasses.replace(self, **kw)


def check_decode_fit(mesh_shape: dict[str, int], layout: DecodeLayout, *, n_tokens: int, n_experts: int | None,
                     n_heads: int, n_kv_heads: int):
    """Refuse a decode mesh that does not fit: names the axis and the numbers.

    tokens must split over batch_axes, experts over expert_axes; tp and pp must be 1 (not implemented in the
    decode forward: heads are never split, so `n_heads`/`n_kv_heads` only need tp=1).
    """
    for a in ("tp", "pp"):
        if int(mesh_shape.get(a, 1)) != 1:
            raise MeshMismatch(f"mesh axis {a}={mesh_shape[a]}: the decode forward does not implement {a} > 1 "
                               f"(n_heads={n_heads}, n_kv_heads={n_kv_heads} stay whole on each device)")
    check_divisible("batch (tokens)", n_tokens, mesh_shape, layout.batch_axes)
    if n_experts is not None:
        check_divisible("routed experts", n_experts, mesh_shape, layout.expert_axes)
