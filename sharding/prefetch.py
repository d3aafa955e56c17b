"""Just-in-time gathering of 1/N-sharded per-layer buffers, double-buffered through a layer scan.

Why: with DP attention every device runs every layer's attention on its own requests, so it needs the whole
layer's attention weights, but it only stores 1/N of them. Layer l+1's buffer is gathered while layer l computes:
the scan carry holds the gathered buffer of the current layer, and each step starts the gather of the next one
before it computes. A rolled scan keeps at most two gathered layers alive (the current one and the next).

Two ways to gather (inside `jax.shard_map`, over one or several mesh axes):
  "all_gather": one `all_gather(tiled=True)` per layer.
  "ppermute":   a ring of N-1 `ppermute` steps (collective-permute); each device forwards the chunk it received
                last and writes it at its owner's offset. Same bytes on the wire, no all-gather primitive.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp


def gather_buffer(shard_Z, axes: Sequence[str], mode: str = "all_gather"):
    """Assemble the full buffer [N*Z] from this device's shard [Z] (N = size of `axes`, shard i on index i)."""
    axes = tuple(axes)
    if not axes:
        return shard_Z
    if mode == "all_gather":
        return jax.lax.all_gather(shard_Z, axes, axis=0, tiled=True)
    if mode != "ppermute":
        raise ValueError(f"gather mode must be 'all_gather' or 'ppermute', got {mode!r}")
    n = jax.lax.axis_size(axes)
    if n == 1:
        return shard_Z
    Z = shard_Z.shape[0]
    idx = jax.lax.axis_index(axes)
    full = jnp.zeros((n * Z,), shard_Z.dtype)
    full = jax.lax.pcast(full, axes, to="varying")
    full = jax.lax.dynamic_update_slice(full, shard_Z, (idx * Z,))
    cur = shard_Z
    ring = [(j, (j + 1) % n) for j in range(n)]
    for step in range(1, n):
        cur = jax.lax.ppermute(cur, axes, ring)          # now holds the shard of device idx - step
        src = (idx - step) % n
        full = jax.lax.dynamic_update_slice(full, cur, (src * Z,))
    return full


def prefetch_scan(step: Callable, x, buf0, xs, next_shards_LZ, fetch: Callable, unroll: int | bool = 1):
    """Scan `step(x, buf, xs_l) -> (x, ys_l)` over layers, gathering layer l+1 while layer l computes.

    buf0: the gathered buffer of the first layer; next_shards_LZ[l]: this device's shard of layer l+1's buffer;
    fetch(shard) -> gathered buffer. Returns (x, buf_after_last, ys): buf_after_last is the gathered buffer of the
    layer after the scanned ones (for a following scan or a final peeled layer).
    """
    def body(carry, inp):
        x, buf = carry
        xs_l, nxt_shard = inp
        nxt = fetch(nxt_shard)          # issued before this layer's compute: the scheduler overlaps the two
        x, ys = step(x, buf, xs_l)
        return (x, nxt), ys

    (x, buf), ys = jax.lax.scan(body, (x, buf0), (xs, next_shards_LZ), unroll=unroll)
    return x, buf, ys
