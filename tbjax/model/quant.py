"""Weights resident in their stored precision: the quantized weight type, its host-side form used while loading,
quantizers for float checkpoints, and the reference dequantization every fast path is checked against.

Why: a model held in bf16 costs 2-4x the bytes its checkpoint ships (DeepSeek-V3: ~671 GB in fp8, ~1.3 TB in
bf16; the default model: ~100 MB as Q4_1/Q8_0 GGUF, 270 MB in bf16), and decode streams every weight byte once per
step. So loaders convert a checkpoint's quantization once into one of three on-device formats and the matmuls read
them directly (tbjax/model/linear.py):

  int8  int8 codes, symmetric or with a zero point: w = q * scale (+ zero). Per output channel (scale block = the
        whole input axis) when a float checkpoint is quantized at load; groups of 32 along the input axis for GGUF
        Q8_0 (Q6_K: groups of 16) -- exactly the file's values.
  int4  4-bit codes 0..15 with scale and zero per group of 32 along the input axis: w = q * scale + zero. GGUF
        Q4_0 (zero = -8 * scale), Q4_1 (zero = min) and Q4_K (scale = d * sc, zero = -dmin * m) convert exactly.
        Two codes per byte: the low nibbles hold the first half of the last axis, the high nibbles the second half
        (an unpack is one concatenate, no interleave).
  fp8   float8_e4m3fn codes with float32 scales: w = q * scale. Per 128 x 128 block as DeepSeek / Kimi ship them
        (`weight_scale_inv`, transposed to the tree's [in, out] orientation); per output channel when a float
        checkpoint is quantized at load (the scale then multiplies the matmul's result: tbjax/model/linear.py
        reads such a weight once, in its fp8 bytes).

A `QuantizedWeight` is a registered pytree (leaves q, scale, zero) that knows its logical shape, its scale blocks
(one entry per axis: scale.shape[i] == ceil(shape[i] / block[i])) and its compute dtype, so that tree code
(placement on a mesh, orbax, byte counts, stacking and per-layer slicing) treats it like an array.
`dequantize` (float32 math) defines every format; the matmul dispatcher's fast paths are tested against it.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.utils import is_int

FORMATS = ("int8", "int4", "fp8")
# --weight-dtype: "auto" keeps the checkpoint's own format, "bf16" (or "float32") dequantizes at load, the others
# quantize (or convert) every matrix to that format.
WEIGHT_DTYPES = ("auto", "bf16", "bfloat16", "float32", "fp8", "int8", "int4")
FP8 = ml_dtypes.float8_e4m3fn
FP8_MAX = 448.0
INT4_GROUP = 32
FP8_BLOCK = (128, 128)          # (input rows, output columns) of the tree's [in, out] matrices


class QuantError(ValueError):
    """A bad --weight-dtype, or a tensor a format cannot hold."""


def check_weight_dtype(weight_dtype) -> str:
    """The normalized --weight-dtype ("auto", "bf16", "float32", "fp8", "int8", "int4"); else QuantError."""
    if weight_dtype is None:
        return "auto"
    w = str(weight_dtype).lower()
    if w not in WEIGHT_DTYPES:
        raise QuantError(f"--weight-dtype must be one of auto, bf16, fp8, int8, int4 (or float32), got {weight_dtype!r}")
    return "bf16" if w == "bfloat16" else w


def _code_dtype(fmt: str):
    return {"int8": np.int8, "int4": np.uint8, "fp8": FP8}[fmt]


# ---- the device-side weight -------------------------------------------------------------------------------------
@jax.tree_util.register_pytree_with_keys_class
class QuantizedWeight:
    """q (codes; int4: two per byte along the last axis), scale, optional zero, with static format metadata.

    shape: the logical (dequantized) shape; block: per axis, how many logical elements share one scale
    (scale.shape[i] == ceil(shape[i] / block[i])); dtype: the compute dtype the dequantized weight is used in."""

    def __init__(self, q, scale, zero=None, *, fmt: str, block: tuple[int, ...], shape: tuple[int, ...],
                 dtype="bfloat16", index: int | None = None):
        self.q, self.scale, self.zero = q, scale, zero
        self.fmt, self.block = fmt, tuple(int(b) for b in block)
        # the logical shape is read from the codes (so that a shard inside shard_map knows its own shape); only the
        # last axis, halved by int4 packing and never sharded, is kept
        self.last = int(shape[-1])
        self.dtype = jnp.dtype(dtype)
        # index: this weight is entry `index` of the leading axis of the stacked leaves it holds (a view: see
        # __getitem__); None: the leaves are this weight's own
        self.index = None if index is None else int(index)

    # pytree
    def tree_flatten_with_keys(self):
        ch = [(jax.tree_util.GetAttrKey("q"), self.q), (jax.tree_util.GetAttrKey("scale"), self.scale)]
        if self.zero is not None:
            ch.append((jax.tree_util.GetAttrKey("zero"), self.zero))
        return ch, (self.fmt, self.block, self.last, self.dtype.name, self.zero is not None, self.index)

    def tree_flatten(self):
        ch, aux = self.tree_flatten_with_keys()
        return [c for _, c in ch], aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        fmt, block, last, dtype, has_zero, index = aux
        q, scale = children[0], children[1]
        zero = children[2] if has_zero else None
        return cls(q, scale, zero, fmt=fmt, block=block, shape=(last,), dtype=dtype, index=index)

    # array-like
    @property
    def shape(self) -> tuple[int, ...]:
        qs = tuple(int(n) for n in self.q.shape)
        if self.index is not None:
            qs = qs[1:]
        return (*qs[:-1], self.last)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Resident bytes: codes + scales + zeros (of this weight; a view counts its own entry)."""
        n = sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in self.leaves())
        return n if self.index is None else n // int(self.q.shape[0])

    def leaves(self):
        return [a for a in (self.q, self.scale, self.zero) if a is not None]

    def __repr__(self):
        try:
            shape = self.shape
        except (AttributeError, TypeError):       # leaves that are not arrays (a tree.map over the weights)
            shape = "?"
        return (f"QuantizedWeight({self.fmt}, shape={shape}, block={self.block}, dtype={self.dtype.name}, "
                f"q={getattr(self.q, 'dtype', '?')}{tuple(getattr(self.q, 'shape', ()))}, "
                f"scale={getattr(self.scale, 'dtype', '?')}, zero={self.zero is not None})")

    def _check_index(self, i):
        if not is_int(i, numpy=True):
            raise TypeError(f"QuantizedWeight supports indexing its leading axis by an int, got {i!r}")
        if self.ndim < 2 or self.block[0] != 1 or self.index is not None:
            raise TypeError(f"cannot index axis 0 of {self!r}: it is not a stacking axis")
        if not -self.shape[0] <= i < self.shape[0]:
            raise IndexError(f"index {i} out of range for {self.shape[0]} stacked weights")
        return int(i) % self.shape[0]

    def __getitem__(self, i):
        """Entry i of the leading (stacking) axis, as a view over the stacked leaves: nothing is sliced until the
        weight is used. Why: a custom call (the CPU kernels) given `q[i]` of a stacked parameter makes XLA copy the
        slice first; a view hands the kernel the whole stack and the index (as the GPU decode kernel reads a layer
        in place). XLA's own dots fuse the slice of `materialize()`."""
        i = self._check_index(i)
        return QuantizedWeight(self.q, self.scale, self.zero, fmt=self.fmt, block=self.block[1:],
                               shape=self.shape[1:], dtype=self.dtype, index=i)

    def take(self, i) -> "QuantizedWeight":
        """Entry i of the leading axis with leaves of its own (copies: per-layer buffers)."""
        return self[i].materialize()

    def materialize(self) -> "QuantizedWeight":
        """A view's own slice of the stacked leaves (the weight itself when it is not a view)."""
        if self.index is None:
            return self
        i = self.index
        return QuantizedWeight(self.q[i], self.scale[i], None if self.zero is None else self.zero[i], fmt=self.fmt,
                               block=self.block, shape=self.shape, dtype=self.dtype)

    def astype(self, dtype) -> "QuantizedWeight":
        """The same codes with another compute dtype."""
        return QuantizedWeight(self.q, self.scale, self.zero, fmt=self.fmt, block=self.block, shape=self.shape,
                               dtype=dtype, index=self.index)

    def dequantize(self, dtype=None):
        """The float weight (float32 math, cast once to `dtype`, default the compute dtype): the definition."""
        return dequantize(self, dtype)


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


def _is_leaf(x) -> bool:
    return isinstance(x, QuantizedWeight)


def unpack_int4(p, n_last: int):
    """uint8 [..., n/2] -> codes uint8 [..., n]: low nibbles are the first half of the last axis."""
    return jnp.concatenate([p & 15, p >> 4], axis=-1)[..., :n_last]


def expand_blocks(s, shape, block):
    """Per-block values [ceil(shape / block)] broadcast to `shape` (reshape + broadcast where blocks divide, else a
    repeat and a slice)."""
    s = jnp.asarray(s, jnp.float32)
    for ax, (n, b) in enumerate(zip(shape, block)):
        if b == 1:
            continue
        s = jnp.repeat(s, b, axis=ax)
        if s.shape[ax] != n:
            s = jax.lax.slice_in_dim(s, 0, n, axis=ax)
    return s


def codes_f32(w: QuantizedWeight):
    w = w.materialize()
    q = w.q
    if w.fmt == "int4":
        q = unpack_int4(q, w.shape[-1])
    return q.astype(jnp.float32)


def dequantize(w, dtype=None):
    """QuantizedWeight -> float array (q * scale (+ zero), float32 math); a float array is returned as it is (cast
    to `dtype` if given)."""
    if not isinstance(w, QuantizedWeight):
        return w if dtype is None else jnp.asarray(w).astype(dtype)
    w = w.materialize()
    out = codes_f32(w) * expand_blocks(w.scale, w.shape, w.block)
    if w.zero is not None:
        out = out + expand_blocks(w.zero, w.shape, w.block)
    return out.astype(dtype or w.dtype)


def take_rows(w, ids):
    """Rows `ids` of a [V, D] embedding: a quantized one dequantizes only the gathered rows."""
    if not isinstance(w, QuantizedWeight):
        return jnp.take(w, ids, axis=0)
    w = w.materialize()
    sids = ids // w.block[0]             # rows that share scales (fp8 blocks) read their block's scales
    sub = QuantizedWeight(jnp.take(w.q, ids, axis=0), jnp.take(w.scale, sids, axis=0),
                          None if w.zero is None else jnp.take(w.zero, sids, axis=0), fmt=w.fmt,
                          block=(1, *w.block[1:]), shape=(ids.shape[0], *w.shape[1:]), dtype=w.dtype)
    return dequantize(sub)


def params_dtype(params) -> str:
    """The model's compute dtype: the first float leaf's, or the first quantized weight's compute dtype."""
    for leaf in jax.tree.leaves(params, is_leaf=_is_leaf):
        if isinstance(leaf, QuantizedWeight):
            return leaf.dtype.name
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            return jnp.dtype(leaf.dtype).name
    raise QuantError("parameter tree has no float or quantized leaf")


def resident_bytes(params) -> dict[str, int]:
    """Bytes of the tree by storage: {"int4": .., "int8": .., "fp8": .., "float": .., "total": ..}."""
    out = {"int4": 0, "int8": 0, "fp8": 0, "float": 0}
    for leaf in jax.tree.leaves(params, is_leaf=_is_leaf):
        if isinstance(leaf, QuantizedWeight):
            out[leaf.fmt] += leaf.nbytes
        else:
            out["float"] += int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    out["total"] = sum(out.values())
    return out


def weight_formats(params) -> dict[str, int]:
    """How many weights of each storage the tree holds: {"int4": n, "float32": m, ...}."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(params, is_leaf=_is_leaf):
        k = leaf.fmt if isinstance(leaf, QuantizedWeight) else jnp.dtype(leaf.dtype).name
        out[k] = out.get(k, 0) + 1
    return out


# ---- the host-side form (loading) -------------------------------------------------------------------------------
class HostQuant:
    """Unpacked codes, scales and zeros in numpy while a checkpoint is assembled into the tree: supports what
    tbjax/weights/assemble.py does to tensors (transpose of a matrix, row permutation, concatenation along the output
    rows, stacking), then `to_device` packs and places it."""

    def __init__(self, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, fmt: str,
                 block: tuple[int, ...]):
        if fmt not in FORMATS:
            raise QuantError(f"unknown quantized format {fmt!r}")
        self.codes, self.scale, self.zero, self.fmt, self.block = codes, scale, zero, fmt, tuple(block)
        need = tuple(-(-n // b) for n, b in zip(codes.shape, self.block))
        if tuple(scale.shape) != need or (zero is not None and tuple(zero.shape) != need):
            raise QuantError(f"{fmt} scales {scale.shape} do not match codes {codes.shape} in blocks {self.block}")

    @property
    def shape(self):
        return self.codes.shape

    @property
    def ndim(self):
        return self.codes.ndim

    @property
    def T(self) -> "HostQuant":
        return HostQuant(self.codes.T, self.scale.T, None if self.zero is None else self.zero.T, self.fmt,
                         self.block[::-1])

    def take(self, idx, axis: int = 0) -> "HostQuant":
        """Permute/select along an axis whose block is 1 (e.g. output rows)."""
        if self.block[axis] != 1:
            raise QuantError(f"cannot permute axis {axis} of a {self.fmt} tensor with blocks {self.block}")
        return HostQuant(np.take(self.codes, idx, axis), np.take(self.scale, idx, axis),
                         None if self.zero is None else np.take(self.zero, idx, axis), self.fmt, self.block)

    def dequantize(self) -> np.ndarray:
        """float32 values (numpy; for the format conversions below and for tests)."""
        def exp(s):
            s = np.asarray(s, np.float32)
            for ax, (n, b) in enumerate(zip(self.shape, self.block)):
                if b > 1:
                    s = np.repeat(s, b, axis=ax)[(slice(None),) * ax + (slice(0, n),)]
            return s
        out = self.codes.astype(np.float32) * exp(self.scale)
        if self.zero is not None:
            out = out + exp(self.zero)
        return out

    def to_device(self, dtype) -> QuantizedWeight:
        q = self.codes
        if self.fmt == "int4":
            n = q.shape[-1]
            if n % 2:
                q = np.concatenate([q, np.zeros((*q.shape[:-1], 1), q.dtype)], axis=-1)
            h = q.shape[-1] // 2
            q = (q[..., :h] & 15) | ((q[..., h:] & 15) << 4)
            q = q.astype(np.uint8)
        return QuantizedWeight(jnp.asarray(q), jnp.asarray(self.scale),
                               None if self.zero is None else jnp.asarray(self.zero), fmt=self.fmt,
                               block=self.block, shape=self.codes.shape, dtype=dtype)


def _refine(h: HostQuant, block: tuple[int, ...]) -> HostQuant:
    """The same values with finer scale blocks (each old block's scale repeated): exact."""
    if h.block == tuple(block):
        return h
    s, z = h.scale, h.zero
    for ax, (old, new) in enumerate(zip(h.block, block)):
        if old % new:
            raise QuantError(f"cannot refine blocks {h.block} to {block}")
        if old != new:
            r = old // new
            n = -(-h.shape[ax] // new)
            s = np.repeat(s, r, axis=ax)[(slice(None),) * ax + (slice(0, n),)]
            if z is not None:
                z = np.repeat(z, r, axis=ax)[(slice(None),) * ax + (slice(0, n),)]
    return HostQuant(h.codes, s, z, h.fmt, block)


def _common(parts: list[HostQuant]) -> list[HostQuant]:
    """Bring tensors to one format and block (exactly: int4 codes fit int8 with the same scale and zero; blocks are
    refined to the finest); fp8 mixed with integer formats goes through float32 and int8 per-group quantization."""
    fmts = {p.fmt for p in parts}
    if len(fmts) > 1 and "fp8" in fmts:
        g = min(min(p.block[-1] for p in parts if p.fmt != "fp8"), INT4_GROUP)
        parts = [quantize(p.dequantize(), "int8", in_axis=p.ndim - 1, group=g) if p.fmt == "fp8" else p
                 for p in parts]
        fmts = {p.fmt for p in parts}
    fmt = "int8" if "int8" in fmts else parts[0].fmt
    block = tuple(math.gcd(*[p.block[ax] for p in parts]) for ax in range(parts[0].ndim))
    out = []
    any_zero = any(p.zero is not None for p in parts)
    sdt = np.result_type(*[p.scale.dtype for p in parts])
    for p in parts:
        p = _refine(p, block)
        codes = p.codes.astype(_code_dtype(fmt)) if p.fmt != fmt else p.codes
        zero = p.zero if p.zero is not None or not any_zero else np.zeros_like(p.scale)
        out.append(HostQuant(codes, p.scale.astype(sdt), None if zero is None else zero.astype(sdt), fmt, block))
    return out


def _common_quant(parts):
    """The parts as HostQuant of one format and block (float arrays quantized like the first HostQuant), or None
    when no part is a HostQuant."""
    if not any(isinstance(p, HostQuant) for p in parts):
        return None
    ref = next(p for p in parts if isinstance(p, HostQuant))
    return _common([p if isinstance(p, HostQuant) else quantize(p, ref.fmt, in_axis=p.ndim - 1, group=ref.block[-1])
                    for p in parts])


def concat(parts, axis: int):
    """np.concatenate for float arrays and HostQuant (mixed: floats are quantized like the others)."""
    quant = _common_quant(parts)
    if quant is None:
        return np.concatenate(parts, axis=axis)
    parts = quant
    b = parts[0].block[axis]
    if b != 1 and any(p.shape[axis] % b for p in parts[:-1]):
        raise QuantError(f"cannot concatenate along axis {axis}: sizes {[p.shape[axis] for p in parts]} are not "
                         f"whole scale blocks of {b}")
    z = None if parts[0].zero is None else np.concatenate([p.zero for p in parts], axis)
    return HostQuant(np.concatenate([p.codes for p in parts], axis), np.concatenate([p.scale for p in parts], axis),
                     z, parts[0].fmt, parts[0].block)


def stack(parts, axis: int = 0):
    """np.stack for float arrays and HostQuant (the new axis has block 1)."""
    quant = _common_quant(parts)
    if quant is None:
        return np.stack(parts, axis=axis)
    parts = quant
    block = parts[0].block[:axis] + (1,) + parts[0].block[axis:]
    z = None if parts[0].zero is None else np.stack([p.zero for p in parts], axis)
    return HostQuant(np.stack([p.codes for p in parts], axis), np.stack([p.scale for p in parts], axis), z,
                     parts[0].fmt, block)


# ---- quantizers (float checkpoints, or converting between formats) ----------------------------------------------
def scale_block(shape, fmt: str, in_axis: int, group: int | None = None, out_axis: int | None = None) -> tuple:
    """Per axis, how many elements of a `shape` tensor share one scale when `quantize` puts it in `fmt` (see there)."""
    nd = len(shape)
    in_axis %= nd
    block = [1] * nd
    if fmt == "int8":
        block[in_axis] = shape[in_axis] if group is None else group
    elif fmt == "int4":
        block[in_axis] = INT4_GROUP if group is None else group
    elif fmt == "fp8":
        if group is None and out_axis is None:          # per output channel, as int8
            block[in_axis] = shape[in_axis]
        else:                                           # DeepSeek-style blocks of (group or 128) x 128
            if out_axis is None:
                out_axis = nd - 1 if in_axis != nd - 1 else nd - 2
            block[in_axis], block[out_axis % nd] = (group or FP8_BLOCK[0]), FP8_BLOCK[1]
    else:
        raise QuantError(f"unknown quantized format {fmt!r}")
    if fmt != "fp8" and shape[in_axis] % block[in_axis]:
        block[in_axis] = math.gcd(shape[in_axis], block[in_axis])
    return tuple(int(b) for b in block)


def quantized_nbytes(shape, fmt: str, in_axis: int, group: int | None = None) -> int:
    """Resident bytes of a `shape` tensor quantized to `fmt` along `in_axis` (codes, float32 scales, int4's float32
    zeros), without building it: what `quantize(...).to_device(...)` holds. For planners."""
    block = scale_block(shape, fmt, in_axis, group)
    n_scales = math.prod(-(-int(n) // b) for n, b in zip(shape, block))
    if fmt == "int4":                    # two codes per byte along the last axis; scale and zero per group
        return math.prod(shape[:-1]) * -(-int(shape[-1]) // 2) + 8 * n_scales
    return math.prod(shape) + 4 * n_scales


def quantize(w, fmt: str, in_axis: int, group: int | None = None, out_axis: int | None = None) -> HostQuant:
    """Quantize a float array (numpy, float32 math) along its input axis `in_axis`.

    int8: symmetric, amax/127 per output channel (group None: the whole input axis) or per `group` inputs.
    int4: asymmetric, (max - min)/15 per `group` (default 32) inputs, zero = min.
    fp8:  amax/448 per output channel (group and out_axis None), else per (group or 128) x 128 block of
          (in_axis, out_axis) (out_axis default: the last axis other than in_axis)."""
    w = np.asarray(w, np.float32)
    nd = w.ndim
    block = scale_block(w.shape, fmt, in_axis, group, out_axis)
    # view every block's elements on axes of their own: pad to whole blocks, reshape (n/b, b) per axis
    pads = [(0, -(-n // b) * b - n) for n, b in zip(w.shape, block)]
    wp = np.pad(w, pads) if any(p[1] for p in pads) else w
    split = []
    for n, b in zip(wp.shape, block):
        split += [n // b, b]
    wb = wp.reshape(split)
    red = tuple(range(1, 2 * nd, 2))
    if fmt == "int4":
        lo, hi = wb.min(axis=red, keepdims=True), wb.max(axis=red, keepdims=True)
        s = (hi - lo) / 15.0
        inv = np.where(s > 0, 1.0 / np.where(s > 0, s, 1.0), 0.0)
        q = np.clip(np.round((wb - lo) * inv), 0, 15).astype(np.uint8)
        zero = lo
        s = np.where(s > 0, s, 1.0)
    else:
        qmax = 127.0 if fmt == "int8" else FP8_MAX
        amax = np.abs(wb).max(axis=red, keepdims=True)
        s = np.where(amax > 0, amax / qmax, 1.0)
        x = wb / s
        q = np.clip(np.round(x), -127, 127).astype(np.int8) if fmt == "int8" else \
            np.clip(x, -FP8_MAX, FP8_MAX).astype(FP8)
        zero = None
    q = q.reshape(wp.shape)[tuple(slice(0, n) for n in w.shape)]
    sq = tuple(-(-n // b) for n, b in zip(w.shape, block))
    return HostQuant(q, s.astype(np.float32).reshape(sq),
                     None if zero is None else zero.astype(np.float32).reshape(sq), fmt, block)


def convert(h: HostQuant, fmt: str, in_axis: int) -> HostQuant:
    """A host tensor in another format: int4 -> int8 exactly (same scale and zero), anything else through float32."""
    if h.fmt == fmt:
        return h
    if h.fmt == "int4" and fmt == "int8":
        return HostQuant(h.codes.astype(np.int8), h.scale, h.zero, "int8", h.block)
    return quantize(h.dequantize(), fmt, in_axis=in_axis)


# ---- which tree parameters are matrices, and their input axis ----------------------------------------------------
_NOT_MATRICES = ("norm", "bias", "router")


def matrix_in_axis(name: str, ndim: int) -> int | None:
    """The input (contraction) axis of tree parameter `name` of rank `ndim`, or None when it is not a matrix that
    formats apply to (norms, biases, routers stay float). Tree matrices are [..., in, out]; w_gate_up is
    [L, D, 2, F]; the embedding [V, D] contracts over D for a tied head."""
    if any(s in name for s in _NOT_MATRICES) or ndim < 2:
        return None
    if name == "embed":
        return 1
    if name == "w_gate_up":
        return ndim - 3
    return ndim - 2


@functools.partial(jax.jit, static_argnames=("fmt", "in_axis", "group"))
def _quantize_on_device(w, qmax, fmt: str, in_axis: int, group: int | None = None):
    def div(a, b):                       # a / b as numpy divides (b broadcast to a's shape)
        return a / jax.lax.optimization_barrier(jnp.broadcast_to(b, a.shape))

    """`quantize` in jnp (the same float32 operations, so the same codes and scales), codes packed as stored. XLA
    rewrites a division by a broadcast into a multiplication by the broadcast reciprocal, which rounds differently
    from numpy's division: every divisor here is broadcast to its dividend's shape behind an optimization barrier."""
    shape, nd = w.shape, w.ndim
    block = scale_block(shape, fmt, in_axis, group)
    w = w.astype(jnp.float32)
    pads = [(0, -(-n // b) * b - n) for n, b in zip(shape, block)]
    wp = jnp.pad(w, pads) if any(p[1] for p in pads) else w
    split = []
    for n, b in zip(wp.shape, block):
        split += [n // b, b]
    wb = wp.reshape(split)
    red = tuple(range(1, 2 * nd, 2))
    zero = None
    if fmt == "int4":
        lo, hi = wb.min(axis=red, keepdims=True), wb.max(axis=red, keepdims=True)
        s = div(hi - lo, qmax)
        inv = jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)
        q = jnp.clip(jnp.round((wb - lo) * inv), 0, 15).astype(jnp.uint8)
        zero, s = lo, jnp.where(s > 0, s, 1.0)
    else:
        amax = jnp.abs(wb).max(axis=red, keepdims=True)
        s = jnp.where(amax > 0, div(amax, qmax), 1.0)
        x = div(wb, s)
        q = jnp.clip(jnp.round(x), -127, 127).astype(jnp.int8) if fmt == "int8" else \
            jnp.clip(x, -FP8_MAX, FP8_MAX).astype(FP8)
    q = q.reshape(wp.shape)[tuple(slice(0, n) for n in shape)]
    sq = tuple(-(-n // b) for n, b in zip(shape, block))
    if fmt == "int4":                    # packed as HostQuant.to_device packs
        if shape[-1] % 2:
            q = jnp.pad(q, [(0, 0)] * (nd - 1) + [(0, 1)])
        h = q.shape[-1] // 2
        q = ((q[..., :h] & 15) | ((q[..., h:] & 15) << 4)).astype(jnp.uint8)
    return q, s.reshape(sq), None if zero is None else zero.reshape(sq)


def quantize_on_device(w, fmt: str, in_axis: int, dtype=None, group: int | None = None) -> QuantizedWeight:
    """A device array quantized to `fmt` along `in_axis` where it lives (the rules and results of `quantize`,
    without a host copy: a bf16 checkpoint already on the accelerator, synthetic benchmark weights)."""
    if fmt not in FORMATS:
        raise QuantError(f"unknown quantized format {fmt!r}")
    in_axis %= w.ndim
    qmax = {"int8": 127.0, "fp8": FP8_MAX, "int4": 15.0}[fmt]
    q, s, z = _quantize_on_device(w, jnp.float32(qmax), fmt, in_axis, group)
    return QuantizedWeight(q, s, z, fmt=fmt, block=scale_block(w.shape, fmt, in_axis, group), shape=w.shape,
                           dtype=dtype or w.dtype)


def quantize_tree(params, fmt: str, dtype=None, *, on_device: bool = False, group: int | None = None):
    """The tree with every matrix (see matrix_in_axis) quantized to `fmt` on the host (float32 math), placed as
    QuantizedWeights whose compute dtype is `dtype` (default: the float leaf's dtype). Already quantized weights are
    converted (int4 -> int8 exactly, others through float32). For float checkpoints and tests; loaders convert
    their own formats while assembling. `on_device`: float matrices are quantized where they live
    (`quantize_on_device`, the same codes). `group`: as in `quantize` (fp8: 128 gives DeepSeek's 128 x 128
    blocks, None per-channel scales)."""
    if fmt not in FORMATS:
        raise QuantError(f"quantize_tree: format must be one of {FORMATS}, got {fmt!r}")

    def one(path, leaf):
        name = str(getattr(path[-1], "key", getattr(path[-1], "name", path[-1])))
        ndim = len(leaf.shape)
        ax = matrix_in_axis(name, ndim)
        if ax is None:
            return leaf
        dt = dtype or leaf.dtype
        if isinstance(leaf, QuantizedWeight):
            if leaf.fmt == fmt:
                return leaf
            leaf = np.asarray(dequantize(leaf, jnp.float32))
        elif on_device:
            return quantize_on_device(leaf, fmt, ax, dt, group)
        h = quantize(np.asarray(jnp.asarray(leaf, jnp.float32)), fmt, in_axis=ax, group=group)
        return h.to_device(dt)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_leaf)


def abstract_like(w: QuantizedWeight, sharding=None) -> QuantizedWeight:
    """The same weight with ShapeDtypeStruct leaves (orbax restore targets, planners)."""
    def sd(a):
        return None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    w = w.materialize()
    return QuantizedWeight(sd(w.q), sd(w.scale), sd(w.zero), fmt=w.fmt, block=w.block, shape=w.shape, dtype=w.dtype)


def describe(w: QuantizedWeight) -> dict:
    """JSON description of a quantized weight's layout (checkpoint metadata)."""
    w = w.materialize()
    return {"fmt": w.fmt, "block": list(w.block), "shape": list(w.shape), "dtype": w.dtype.name,
            "q": [list(w.q.shape), jnp.dtype(w.q.dtype).name], "scale": [list(w.scale.shape),
                                                                        jnp.dtype(w.scale.dtype).name],
            "zero": None if w.zero is None else [list(w.zero.shape), jnp.dtype(w.zero.dtype).name]}


def from_description(d: dict, dtype=None) -> QuantizedWeight:
    def sd(x):
        return None if x is None else jax.ShapeDtypeStruct(tuple(x[0]), jnp.dtype(x[1]))
    return QuantizedWeight(sd(d["q"]), sd(d["scale"]), sd(d["zero"]), fmt=d["fmt"], block=tuple(d["block"]),
                           shape=tuple(d["shape"]), dtype=dtype or d["dtype"])
