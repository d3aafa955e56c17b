"""The SplitZip stream layout: one place that says where every bit of an encoded tensor lives.

Why this module exists: the numpy reference, the jnp reference, the Mosaic GPU kernels, the Mosaic TPU
kernels and the framing must agree on the layout bit for bit; each of them imports the geometry from here.

Layout (format version 1). A tensor of n elements is flattened (C order) and padded with filler
elements up to n_pad, a multiple of the chunk size C (a power of two, 1024 <= C <= 32768). The filler
has sign 0, mantissa 0 and the exponent of code 0, so it never escapes; the decoder drops it.
A chunk is seen as R = 8 rows of W = C / 8 lanes: element (chunk c, row k, lane i) is flat element
c*C + k*W + i. Its in-chunk *position* is the natural index p = k*W + i.

Per element (BF16: sign bit 15, exponent bits 14..7, mantissa bits 6..0):
  sm   = (sign << 7) | mantissa            (8 bits, BF16)   /  (sign << 2) | mantissa  (3 bits, e5m2)
  code = index of the exponent in the 16-entry codebook, or 0 when it is not there (an *escape*).

Streams (all integers little-endian):
  codes  : per chunk W uint32 words; word i = sum_k code(k, i) << 4k, i.e. byte 4i+b holds rows 2b
           (low nibble) and 2b+1 (high nibble) of lane i.            n_pad / 2 bytes.
  sm     : BF16: per chunk 2 x W uint32 words; word (h, i) = sum_{j<4} sm(4h+j, i) << 8j.   n_pad bytes.
           e5m2: per chunk W 24-bit words, 3 bytes each, word i = sum_k sm(k, i) << 3k.    3 n_pad / 8 bytes.
  counts : uint16 per chunk, the number of escapes in the chunk.                           2 n_pad / C bytes.
  esc_pos: uint16 per escape, its in-chunk position p; ordered by chunk, then by position. 2 bytes each.
  esc_val: uint8 per escape, the raw exponent (8 bits BF16, 5 bits e5m2), same order.     1 byte each.

This row/lane split (instead of pairing neighbouring elements) lets a kernel build every packed word
from elements that sit at the same lane of 8 separately loaded rows: pure elementwise work, no
shuffles, 16-byte loads and stores. The format is fixed by this file; kernels only reproduce it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

ROWS = 8                      # rows per chunk (one 4-bit code per row in a 32-bit codes word)
MIN_CHUNK = 1024
MAX_CHUNK = 32768
DEFAULT_CHUNK = 8192
NUM_CODES = 16

BIG_KEY = np.int32(2**31 - 1)


@dataclasses.dataclass(frozen=True)
class DtypeSpec:
    """Bit geometry of one element type handled by the codec."""
    name: str          # numpy/ml_dtypes name
    bits: int          # element width
    exp_shift: int     # lowest exponent bit
    exp_bits: int
    man_bits: int      # mantissa bits (below the exponent)
    split: bool        # False: exponent split gains nothing; stored raw

    @property
    def exp_mask(self) -> int:
        return ((1 << self.exp_bits) - 1) << self.exp_shift

    @property
    def sign_shift(self) -> int:
        return self.bits - 1

    @property
    def sm_bits(self) -> int:
        return 1 + self.man_bits

    @property
    def uint_dtype(self):
        return np.uint16 if self.bits == 16 else np.uint8


DTYPES = {
    "bfloat16": DtypeSpec("bfloat16", 16, 7, 8, 7, True),
    "float8_e5m2": DtypeSpec("float8_e5m2", 8, 2, 5, 2, True),
    # e4m3: a 4-bit exponent coded by a 4-bit code saves nothing; such tensors pass through raw.
    "float8_e4m3fn": DtypeSpec("float8_e4m3fn", 8, 3, 4, 3, False),
}


def dtype_spec(dtype: Any) -> DtypeSpec:
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise TypeError(f"splitzip: unsupported dtype {name!r}; supported: {sorted(DTYPES)}")
    return DTYPES[name]


def check_chunk(chunk: int) -> int:
    chunk = int(chunk)
    if chunk < MIN_CHUNK or chunk > MAX_CHUNK or chunk & (chunk - 1):
        raise ValueError(
            f"splitzip: chunk must be a power of two in [{MIN_CHUNK}, {MAX_CHUNK}], got {chunk}")
    return chunk


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Sizes derived from (number of elements, chunk)."""
    n: int
    chunk: int

    @property
    def lanes(self) -> int:
        return self.chunk // ROWS

    @property
    def num_chunks(self) -> int:
        return max(1, -(-self.n // self.chunk))

    @property
    def n_pad(self) -> int:
        return self.num_chunks * self.chunk


def sm_stream_bytes(spec: DtypeSpec, geo: Geometry) -> int:
    return geo.n_pad if spec.bits == 16 else 3 * geo.n_pad // 8


def payload_bytes(spec: DtypeSpec, geo: Geometry, n_esc: int) -> int:
    """Bytes of the split streams: sm + codes + counts + escapes (the format's size formula)."""
    return sm_stream_bytes(spec, geo) + geo.n_pad // 2 + 2 * geo.num_chunks + 3 * int(n_esc)


def raw_bytes(spec: DtypeSpec, n: int) -> int:
    return n * spec.bits // 8


@dataclasses.dataclass
class Encoded:
    """One encoded tensor. Arrays are numpy (host) or jax (device); shapes are fixed by Geometry.

    kind "split": sm_words, code_words, counts, esc_pos, esc_val are set; esc_* may be longer than
    n_esc (static capacity on device): only the first n_esc entries are meaningful.
    kind "raw":   raw holds the tensor's bits (uint16 / uint8 view), flattened.
    """
    kind: str
    dtype: str
    shape: tuple
    chunk: int
    n_esc: int = 0
    sm_words: Any = None      # bf16: uint32 [nch, 2, W]; e5m2: uint32 [nch, W] (24 bits used)
    code_words: Any = None    # uint32 [nch, W]
    counts: Any = None        # int32/uint16 [nch]
    esc_pos: Any = None       # uint16/int32 [>= n_esc]
    esc_val: Any = None       # uint8/int32 [>= n_esc]
    raw: Any = None
    codebook_hash: bytes = b""

    @property
    def n(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.n, self.chunk)

    @property
    def spec(self) -> DtypeSpec:
        return DTYPES[self.dtype]

    def nbytes(self) -> int:
        """Payload bytes (no header): the size formula for split streams, the raw size otherwise."""
        if self.kind == "raw":
            return raw_bytes(self.spec, self.n)
        return payload_bytes(self.spec, self.geometry, self.n_esc)
