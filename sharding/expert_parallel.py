"""Expert parallelism: routed (token, expert) pairs go to the device that holds the expert, are computed there with
one grouped matmul (`jax.lax.ragged_dot`), and come back weighted and summed per token.

Why: a trillion-parameter MoE only fits when each device holds 1/N of the experts; tokens travel, weights don't.
Runs inside `jax.shard_map`; with no expert axes (one device) the same code computes all experts locally.

Experts are split in contiguous ranges: device i of the expert axes (linear index, major-to-minor in the given
axis order, as `jax.lax.axis_index(axes)`) holds experts [i*E_local, (i+1)*E_local).

Modes
  "gather":     all-gather tokens and their routing over the expert axes, compute the local experts' pairs,
                reduce-scatter (psum_scatter) the per-token sums back. Exact; traffic 2 * N * T * D per device.
  "all_to_all": pack pairs per destination device into fixed `capacity` slots, all_to_all there and back.
                capacity = T * top_k never drops (exact); smaller capacities drop the overflowing pairs (their
                contribution is zero) and the number dropped is returned.
(`jax.lax.ragged_all_to_all` would avoid the capacity padding but XLA:CPU does not implement it, so it cannot be
tested here.)
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp


def grouped_swiglu(x_YD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD):
    """SwiGLU expert FFN on rows sorted by expert: rows [sum(sizes[:e]), sum(sizes[:e+1])) use expert e.
    Rows past sum(group_sizes) give zeros. float32 accumulation; returns [Y, D] float32."""
    g = jax.lax.ragged_dot(x_YD, w_gate_EDF, group_sizes_E, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot(x_YD, w_up_EDF, group_sizes_E, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g) * u).astype(x_YD.dtype)
    return jax.lax.ragged_dot(h, w_down_EFD, group_sizes_E, preferred_element_type=jnp.float32)


def local_experts(x_YD, local_id_Y, weights):
    """Rows with local expert id in [0, E) go through that expert; id E (or more) means "not here" -> zeros.
    Sorts by id (stable), one grouped matmul per projection, unsorts. Returns [Y, D] float32."""
    w_gate, w_up, w_down = weights
    E = w_gate.shape[0]
    lid = jnp.minimum(local_id_Y, E)
    order = jnp.argsort(lid, stable=True)
    sizes = jnp.sum(lid[:, None] == jnp.arange(E, dtype=lid.dtype)[None, :], axis=0).astype(jnp.int32)
    y_sorted = grouped_swiglu(x_YD[order], sizes, w_gate, w_up, w_down)
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted)


def _n(axes) -> int:
    return jax.lax.axis_size(tuple(axes)) if axes else 1


def moe_dispatch_combine(x_TD, ids_TA, w_TA, weights, *, n_experts: int, axes: Sequence[str] = (),
                         mode: str = "gather", capacity: int | None = None):
    """Routed-expert output for this device's tokens. weights = (w_gate [E_local, D, F], w_up [E_local, D, F],
    w_down [E_local, F, D]) are this device's experts. Returns (y_TD float32, dropped pairs (int32, this device))."""
    axes = tuple(axes)
    n = _n(axes)
    T, A = ids_TA.shape
    E_local = weights[0].shape[0]
    if E_local * n != n_experts:
        raise ValueError(f"expert weights hold {E_local} experts per device x {n} devices != {n_experts} experts")
    if n == 1:
        ids = ids_TA.reshape(-1)
        x_pairs = jnp.repeat(x_TD, A, axis=0)
        y = local_experts(x_pairs, ids, weights) * w_TA.reshape(-1, 1).astype(jnp.float32)
        return y.reshape(T, A, -1).sum(axis=1), jnp.int32(0)
    if mode == "gather":
        return _gather_mode(x_TD, ids_TA, w_TA, weights, axes, E_local), jnp.int32(0)
    if mode == "all_to_all":
        return _all_to_all_mode(x_TD, ids_TA, w_TA, weights, axes, n, E_local, capacity)
    raise ValueError(f"expert-parallel mode must be 'gather' or 'all_to_all', got {mode!r}")


def _gather_mode(x_TD, ids_TA, w_TA, weights, axes, E_local):
    A = ids_TA.shape[1]
    xg = jax.lax.all_gather(x_TD, axes, axis=0, tiled=True)           # [nT, D]
    ids = jax.lax.all_gather(ids_TA, axes, axis=0, tiled=True).reshape(-1)
    w = jax.lax.all_gather(w_TA, axes, axis=0, tiled=True).reshape(-1)
    e0 = jax.lax.axis_index(axes) * E_local
    local = ids - e0
    here = (local >= 0) & (local < E_local)
    lid = jnp.where(here, local, E_local)
    y = local_experts(jnp.repeat(xg, A, axis=0), lid, weights) * jnp.where(here, w, 0.0)[:, None].astype(jnp.float32)
    y_full = y.reshape(xg.shape[0], A, -1).sum(axis=1)               # [nT, D] partial sums of local experts
    return jax.lax.psum_scatter(y_full, axes, scatter_dimension=0, tiled=True)


def _all_to_all_mode(x_TD, ids_TA, w_TA, weights, axes, n, E_local, capacity):
    T, A = ids_TA.shape
    D = x_TD.shape[1]
    Y = T * A
    C = Y if capacity is None else int(min(max(capacity, 1), Y))
    e = ids_TA.reshape(-1)
    tok = jnp.arange(Y, dtype=jnp.int32) // A
    dest = e // E_local
    onehot = dest[:, None] == jnp.arange(n, dtype=dest.dtype)[None, :]
    slot = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, dest[:, None], axis=1)[:, 0]
    keep = slot < C
    slot_c = jnp.where(keep, slot, C)                                   # C = out of range -> dropped by scatter
    send_x = jnp.zeros((n, C, D), x_TD.dtype).at[dest, slot_c].set(x_TD[tok], mode="drop")
    send_id = jnp.full((n, C), E_local, jnp.int32).at[dest, slot_c].set((e % E_local).astype(jnp.int32), mode="drop")
    recv_x = jax.lax.all_to_all(send_x, axes, 0, 0, tiled=True)         # [n, C, D]: row block i came from device i
    recv_id = jax.lax.all_to_all(send_id, axes, 0, 0, tiled=True)
    y = local_experts(recv_x.reshape(n * C, D), recv_id.reshape(-1), weights).reshape(n, C, D)
    back = jax.lax.all_to_all(y, axes, 0, 0, tiled=True)               # [n, C, D]: block j = results from device j
    y_pairs = back.at[dest, slot_c].get(mode="fill", fill_value=0.0)   # [Y, D]
    y_pairs = y_pairs * jnp.where(keep, w_TA.reshape(-1), 0.0)[:, None].astype(jnp.float32)
    dropped = jnp.sum(~keep).astype(jnp.int32)
    return jnp.zeros((T, D), jnp.float32).at[tok].add(y_pairs), dropped


def capacity_for(T_local: int, top_k: int, n_ep: int, factor: float | None) -> int | None:
    """Per-destination slots for all_to_all: None (= T*k, never drops) or ceil(factor * T*k / n_ep)."""
    if factor is None:
        return None
    return min(T_local * top_k, max(1, math.ceil(factor * T_local * top_k / n_ep)))


def expert_load(ids_TA, n_experts: int, axes: Sequence[str] = ()):
    """Number of (token, expert) assignments per expert [E] int32, summed over `axes` (the batch axes)."""
    cnt = jnp.sum(ids_TA.reshape(-1)[:, None] == jnp.arange(n_experts, dtype=ids_TA.dtype)[None, :], axis=0)
    cnt = cnt.astype(jnp.int32)
    return jax.lax.psum(cnt, tuple(axes)) if axes else cnt
