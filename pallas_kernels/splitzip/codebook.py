"""Exponent codebooks for SplitZip: calibration from sample KV, save/load, and the hash that names one.

Why this module exists: encoder and decoder must use the very same 16-entry table (code -> exponent).
A codebook is calibrated once from sample tensors (the 16 most frequent exponents, code 0 the most
frequent), saved next to the model or agreed per connection, and named in every stream by a hash so
that a stream decoded with another codebook is refused instead of silently producing wrong values.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Iterable

import numpy as np

from .layout import DTYPES, NUM_CODES, dtype_spec


def _exponents(x: np.ndarray, dtype_name: str) -> np.ndarray:
    spec = DTYPES[dtype_name]
    u = np.ascontiguousarray(x).reshape(-1).view(spec.uint_dtype)
    return ((u >> spec.exp_shift) & ((1 << spec.exp_bits) - 1)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Codebook:
    """code -> exponent table. `exponents[j]` is the raw exponent field coded by j (16 distinct values)."""
    dtype: str
    exponents: tuple

    def __post_init__(self):
        if self.dtype not in DTYPES or not DTYPES[self.dtype].split:
            raise ValueError(f"splitzip: a codebook needs a split dtype (bfloat16 or float8_e5m2), "
                             f"got {self.dtype!r}")
        ex = tuple(int(e) for e in self.exponents)
        object.__setattr__(self, "exponents", ex)
        limit = 1 << DTYPES[self.dtype].exp_bits
        if len(ex) != NUM_CODES:
            raise ValueError(f"splitzip: a codebook has {NUM_CODES} exponents, got {len(ex)}")
        if len(set(ex)) != NUM_CODES:
            raise ValueError(f"splitzip: codebook exponents must be distinct, got {ex}")
        if any(e < 0 or e >= limit for e in ex):
            raise ValueError(f"splitzip: codebook exponents must lie in [0, {limit}), got {ex}")

    # --- identity -----------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        return bytes(self.exponents)

    @property
    def hash(self) -> bytes:
        """8-byte name of this codebook (blake2b over dtype and table)."""
        return hashlib.blake2b(self.dtype.encode() + b"\0" + self.to_bytes(), digest_size=8).digest()

    @property
    def array(self) -> np.ndarray:
        return np.asarray(self.exponents, dtype=np.int32)

    def lookup_table(self) -> np.ndarray:
        """int32[2**exp_bits]: exponent -> code, or -1 when the exponent escapes."""
        t = np.full(1 << DTYPES[self.dtype].exp_bits, -1, np.int32)
        t[self.array] = np.arange(NUM_CODES, dtype=np.int32)
        return t

    def range_perm(self):
        """(lo, perm) when the exponents are exactly lo .. lo+15 (the usual case for KV), else None.

        perm[r] is the code of exponent lo + r; kernels then compute a code as perm[e - lo], a
        16-entry lookup done four at a time in the bytes of a 32-bit word.
        """
        lo = min(self.exponents)
        if max(self.exponents) - lo != NUM_CODES - 1:
            return None
        perm = [0] * NUM_CODES
        for code, e in enumerate(self.exponents):
            perm[e - lo] = code
        return lo, tuple(perm)

    # --- calibration --------------------------------------------------------------------------
    @classmethod
    def calibrate(cls, samples: Iterable[np.ndarray] | np.ndarray, dtype=None) -> "Codebook":
        """The 16 most frequent exponents of `samples` (ties: smaller exponent first), code 0 the most
        frequent. Fewer than 16 distinct exponents are topped up with unused ones, smallest first."""
        if isinstance(samples, np.ndarray) or hasattr(samples, "dtype"):
            samples = [samples]
        hist = None
        name = None
        for s in samples:
            s = np.asarray(s)
            sname = np.dtype(dtype).name if dtype is not None else s.dtype.name
            if s.dtype.name != sname:
                raise TypeError(f"splitzip: calibration sample has dtype {s.dtype.name}, expected {sname}")
            spec = dtype_spec(sname)
            if not spec.split:
                raise ValueError(f"splitzip: {sname} is passed through raw and needs no codebook")
            if name is None:
                name = sname
                hist = np.zeros(1 << spec.exp_bits, np.int64)
            elif sname != name:
                raise TypeError(f"splitzip: calibration samples mix {name} and {sname}")
            hist += np.bincount(_exponents(s, sname), minlength=hist.size)
        if name is None:
            raise ValueError("splitzip: calibrate needs at least one sample")
        order = sorted(range(hist.size), key=lambda e: (-hist[e], e))
        return cls(name, tuple(order[:NUM_CODES]))

    def coverage(self, x: np.ndarray) -> float:
        """Fraction of elements of x whose exponent is in this codebook."""
        e = _exponents(np.asarray(x), self.dtype)
        return float(np.isin(e, self.array).mean()) if e.size else 1.0

    # --- persistence --------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"format": "splitzip-codebook", "version": 1, "dtype": self.dtype,
                           "exponents": list(self.exponents), "hash": self.hash.hex()})

    @classmethod
    def from_json(cls, text: str) -> "Codebook":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"splitzip: codebook file is not JSON: {e}") from None
        if not isinstance(d, dict) or d.get("format") != "splitzip-codebook":
            raise ValueError("splitzip: not a splitzip codebook file")
        if d.get("version") != 1:
            raise ValueError(f"splitzip: unsupported codebook version {d.get('version')!r}")
        cb = cls(d["dtype"], tuple(d["exponents"]))
        if "hash" in d and d["hash"] != cb.hash.hex():
            raise ValueError("splitzip: codebook file is corrupted (hash does not match its table)")
        return cb

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Codebook":
        with open(path) as f:
            return cls.from_json(f.read())


def default_codebook(dtype="bfloat16") -> Codebook:
    """A codebook around exponent 0 (|x| ~ 1) for when no calibration is at hand."""
    spec = dtype_spec(dtype)
    bias = (1 << (spec.exp_bits - 1)) - 1
    order = [bias]
    for d in range(1, 16):
        order += [bias - d, bias + d] if d % 2 else [bias + d, bias - d]
    return Codebook(spec.name, tuple(order[:NUM_CODES]))
