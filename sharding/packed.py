"""One contiguous byte buffer per layer for a set of named weights, with a static table to unpack it.

Why: DP attention-weight sharding gathers every layer's attention weights just in time. Gathering one buffer per
layer is one collective instead of one per tensor, and a flat byte buffer splits 1/N over any number of devices
regardless of the tensors' shapes and dtypes. The buffer is uint8 in every mode, so tensors of different dtypes
(bf16 matrices, f32 block scales, fp8 payloads) live in the same buffer and are recovered by bitcasts.

Encodings of an entry:
  "raw"        the tensor's bytes in the stored dtype (the weights' own dtype).
  "fp8_block"  a matrix [R, C] as float8_e4m3fn bytes plus float32 scales [ceil(R/br), ceil(C/bc)]; the value
               is q * scale of its block (DeepSeek's `weight_scale_inv` convention). When the scales given to
               `pack` are a checkpoint's own scales and the weights are that checkpoint dequantized, the round
               trip is exact: w / s recovers the fp8 code (the dequantized value's rounding error, <= 2^-9
               relative for bf16, is far below half an e4m3 step), and unpack recomputes q * s in float32.
               Without given scales, scales are amax/448 per block (lossy, like any fp8 quantization).
Offsets are aligned to `ALIGN` bytes; the buffer is padded to a multiple of N * ALIGN when split over N devices.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import jax.numpy as jnp

ALIGN = 256
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0


class PackError(ValueError):
    """Tensors do not match the packed layout (missing name, wrong shape, bad scales)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str                      # dtype of the unpacked tensor
    encoding: str                   # "raw" | "fp8_block"
    offset: int                     # byte offset of the payload
    nbytes: int                     # payload bytes
    block: tuple[int, int] = (0, 0)  # fp8_block: block shape (rows, cols)
    scale_offset: int = 0           # fp8_block: byte offset of the float32 scales
    scale_shape: tuple[int, int] = (0, 0)


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    entries: tuple[Entry, ...]
    nbytes: int                     # bytes used (before padding for sharding)

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise PackError(f"no entry {name!r} in packed layout (entries: {', '.join(self.names)})")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    def shard_bytes(self, n: int) -> int:
        """Bytes each of n devices holds: ceil(nbytes / n) rounded up to ALIGN."""
        if n < 1:
            raise PackError(f"cannot split a packed buffer over {n} devices")
        return -(-self.nbytes // (n * ALIGN)) * ALIGN

    def padded_bytes(self, n: int) -> int:
        return self.shard_bytes(n) * n

    def tensor_bytes(self) -> int:
        """Bytes of the unpacked tensors (what a replicated copy in their own dtype costs)."""
        return sum(math.prod(e.shape) * jnp.dtype(e.dtype).itemsize for e in self.entries)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def make_layout(tensors: Mapping[str, tuple[tuple[int, ...], object]], wire: str = "native",
                block: tuple[int, int] = (128, 128), fp8_names: tuple[str, ...] | None = None) -> PackedLayout:
    """Layout for {name: (shape, dtype)}. wire="fp8": 2-D entries (or those in fp8_names) use fp8_block."""
    if wire not in ("native", "fp8"):
        raise PackError(f"wire must be 'native' or 'fp8', got {wire!r}")
    if not tensors:
        raise PackError("cannot pack an empty set of tensors")
    entries = []
    off = 0
    for name, (shape, dtype) in tensors.items():
        shape = tuple(int(s) for s in shape)
        dt = jnp.dtype(dtype)
        use_fp8 = wire == "fp8" and (name in fp8_names if fp8_names is not None else len(shape) == 2)
        if use_fp8:
            if len(shape) != 2:
                raise PackError(f"{name}: fp8 block encoding needs a 2-D matrix, got shape {shape}")
            r, c = shape
            sshape = (-(-r // block[0]), -(-c // block[1]))
            nb = r * c
            soff = _align(off + nb)
            entries.append(Entry(name, shape, dt.name, "fp8_block", off, nb, tuple(block), soff, sshape))
            off = _align(soff + 4 * sshape[0] * sshape[1])
        else:
            nb = math.prod(shape) * dt.itemsize
            entries.append(Entry(name, shape, dt.name, "raw", off, nb))
            off = _align(off + nb)
    return PackedLayout(tuple(entries), off)


def _to_bytes(x) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.asarray(x), jnp.uint8).reshape(-1)


def _from_bytes(b, dtype, shape) -> jax.Array:
    dt = jnp.dtype(dtype)
    if dt.itemsize == 1:
        return jax.lax.bitcast_convert_type(b, dt).reshape(shape)
    return jax.lax.bitcast_convert_type(b.reshape(-1, dt.itemsize), dt).reshape(shape)


def expand_scales(s_RbCb, shape, block):
    """Block scales [ceil(R/br), ceil(C/bc)] -> per-element [R, C]."""
    r, c = shape
    return jnp.repeat(jnp.repeat(s_RbCb, block[0], axis=0), block[1], axis=1)[:r, :c]


def block_amax_scales(w_RC, block) -> jax.Array:
    """amax/448 per block (1.0 for an all-zero block), float32 [ceil(R/br), ceil(C/bc)]."""
    r, c = w_RC.shape
    br, bc = block
    R, C = -(-r // br) * br, -(-c // bc) * bc
    a = jnp.abs(jnp.pad(w_RC.astype(jnp.float32), ((0, R - r), (0, C - c))))
    amax = a.reshape(R // br, br, C // bc, bc).max(axis=(1, 3))
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)


def quantize_fp8_block(w_RC, s_RbCb, block) -> jax.Array:
    """float8_e4m3fn codes of w / scale (clipped to +-448)."""
    q = w_RC.astype(jnp.float32) / expand_scales(s_RbCb.astype(jnp.float32), w_RC.shape, block)
    return jnp.clip(q, -FP8_MAX, FP8_MAX).astype(FP8)


def dequantize_fp8_block(q_RC, s_RbCb, block, dtype) -> jax.Array:
    return (q_RC.astype(jnp.float32) * expand_scales(s_RbCb.astype(jnp.float32), q_RC.shape, block)).astype(dtype)


def pack(tensors: Mapping[str, jax.Array], layout: PackedLayout, scales: Mapping[str, jax.Array] | None = None,
         total_bytes: int | None = None) -> jax.Array:
    """One layer's tensors -> uint8 [total_bytes or layout.nbytes]. `scales` (fp8 entries only) are optional."""
    scales = dict(scales or {})
    extra = set(tensors) - set(layout.names)
    if extra:
        raise PackError(f"tensors not in the packed layout: {sorted(extra)}")
    total = layout.nbytes if total_bytes is None else total_bytes
    if total < layout.nbytes:
        raise PackError(f"total_bytes {total} < layout size {layout.nbytes}")
    buf = jnp.zeros((total,), jnp.uint8)
    for e in layout.entries:
        if e.name not in tensors:
            raise PackError(f"missing tensor {e.name!r} for the packed layout")
        t = jnp.asarray(tensors[e.name])
        if tuple(t.shape) != e.shape:
            raise PackError(f"tensor {e.name!r} has shape {tuple(t.shape)}, layout expects {e.shape}")
        if e.encoding == "raw":
            buf = jax.lax.dynamic_update_slice(buf, _to_bytes(t.astype(e.dtype)), (e.offset,))
        else:
            s = scales.get(e.name)
            if s is None:
                s = block_amax_scales(t, e.block)
            elif tuple(s.shape) != e.scale_shape:
                raise PackError(f"scales of {e.name!r} have shape {tuple(s.shape)}, expected {e.scale_shape} "
                                f"(blocks {e.block} over {e.shape})")
            s = jnp.asarray(s, jnp.float32)
            buf = jax.lax.dynamic_update_slice(buf, _to_bytes(quantize_fp8_block(t, s, e.block)), (e.offset,))
            buf = jax.lax.dynamic_update_slice(buf, _to_bytes(s), (e.scale_offset,))
    return buf


def pack_stacked(tensors_L: Mapping[str, jax.Array], layout: PackedLayout, n_shards: int = 1,
                 scales_L: Mapping[str, jax.Array] | None = None) -> jax.Array:
    """Stacked tensors [L, ...] -> uint8 [L, layout.padded_bytes(n_shards)] (one packed buffer per layer)."""
    total = layout.padded_bytes(n_shards)
    scales_L = dict(scales_L or {})
    f = jax.jit(lambda t, s: jax.vmap(lambda tt, ss: pack(tt, layout, ss, total))(t, s))
    return f(dict(tensors_L), scales_L)


def unpack(buf, layout: PackedLayout, dtype=None) -> dict[str, jax.Array]:
    """uint8 buffer (at least layout.nbytes long) -> {name: tensor}. fp8 entries are dequantized to `dtype`
    (default: the entry's dtype), computing q * scale in float32."""
    out = {}
    for e in layout.entries:
        dt = jnp.dtype(dtype or e.dtype)
        seg = jax.lax.slice_in_dim(buf, e.offset, e.offset + e.nbytes)
        if e.encoding == "raw":
            out[e.name] = _from_bytes(seg, e.dtype, e.shape).astype(dt)
        else:
            q = _from_bytes(seg, FP8, e.shape)
            ns = e.scale_shape[0] * e.scale_shape[1]
            s = _from_bytes(jax.lax.slice_in_dim(buf, e.scale_offset, e.scale_offset + 4 * ns), jnp.float32,
                            e.scale_shape)
            out[e.name] = dequantize_fp8_block(q, s, e.block, dt)
    return out
