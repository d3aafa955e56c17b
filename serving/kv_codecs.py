"""Lossless codecs for KV pages on the wire (the gRPC byte path of ``serving/kv_transfer.py``).

``raw`` is always registered; ``SplitZipCodec`` (the exponent-split codec of ``pallas_kernels.splitzip``) is
registered by a worker that wants it (``register_codec(SplitZipCodec(codebook))``), and the two sides of a transfer
agree on a codec at Announce. One interface (``Codec``): a name, ``encode(pages) -> bytes`` and
``decode(payload, dtype, shape) -> pages``.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

__all__ = ["Codec", "RawCodec", "SplitZipCodec", "CODECS", "register_codec", "np_dtype"]


def np_dtype(name: str) -> np.dtype:
    """numpy dtype from its name, including the ml_dtypes ones (bfloat16, float8_*)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes
        t = getattr(ml_dtypes, name, None)
        if t is None:
            raise ValueError(f"unknown dtype {name!r}") from None
        return np.dtype(t)


class Codec(Protocol):
    name: str

    def encode(self, pages: np.ndarray) -> bytes: ...

    def decode(self, payload: bytes, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray: ...


class RawCodec:
    """No compression: the pages' bytes as they are (C order)."""

    name = "raw"

    def encode(self, pages: np.ndarray) -> bytes:
        return np.ascontiguousarray(pages).tobytes()

    def decode(self, payload: bytes, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape)) * dtype.itemsize
        if len(payload) != n:
            raise ValueError(f"raw payload has {len(payload)} bytes, {n} expected for {shape} {dtype}")
        return np.frombuffer(payload, dtype=dtype).reshape(shape)


class SplitZipCodec:
    """The exponent-split lossless codec (pallas_kernels.splitzip): ~4/3 smaller bf16 KV. The codebook
    travels inside each chunk's frame, so the receiver needs no calibration of its own."""

    name = "splitzip"

    def __init__(self, codebook=None, impl: str = "auto"):
        from pallas_kernels import splitzip

        self._sz = splitzip
        self.codebook = codebook
        self.impl = impl

    def encode(self, pages: np.ndarray) -> bytes:
        cb = self.codebook or self._sz.default_codebook(pages.dtype.name)
        return self._sz.encode_pages([pages], cb, self.impl)

    def decode(self, payload: bytes, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        out = self._sz.decode_pages(payload, None, self.impl)
        if len(out) != 1:
            raise ValueError(f"splitzip frame holds {len(out)} arrays, 1 expected")
        arr = np.asarray(out[0])
        if arr.dtype != dtype or arr.shape != tuple(shape):
            raise ValueError(f"splitzip frame holds {arr.shape} {arr.dtype}, {tuple(shape)} {dtype} expected")
        return arr


CODECS: dict[str, Codec] = {"raw": RawCodec()}


def register_codec(codec: Codec) -> None:
    """Make a codec available to senders and receivers by its name (e.g. ``register_codec(SplitZipCodec())``)."""
    CODECS[codec.name] = codec
