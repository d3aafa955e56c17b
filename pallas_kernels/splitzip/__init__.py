"""SplitZip: the exponent-split lossless codec that shrinks prefill -> decode KV transfers.

A BF16 element is split into an exact sign+mantissa byte and a 4-bit code of its exponent in a
calibrated 16-entry codebook; exponents outside the codebook go to a sparse escape stream. Ratio
ceiling 4/3 for BF16 (8/7 for float8_e5m2; float8_e4m3fn passes through raw). See layout.py for the
stream layout, framing.py for the framed buffer, dispatch.py for the implementations.

Public API:
    Codebook.calibrate(samples) / .save(path) / Codebook.load(path) / .hash
    encode(x, codebook, impl="auto", chunk=None) -> Encoded        (chunk None: 8192, or 1024 if small)
    decode(enc, codebook, impl="auto") -> array
    encode_pages(pages_list, codebook, impl="auto") -> bytes
    decode_pages(buf, codebook=None, impl="auto") -> list of arrays
"""
from .codebook import Codebook, default_codebook
from .dispatch import IMPLS, decode, decode_pages, encode, encode_pages, resolve_impl
from .framing import FrameError
from .layout import DEFAULT_CHUNK, Encoded, payload_bytes

__all__ = ["Codebook", "default_codebook", "encode", "decode", "encode_pages", "decode_pages",
           "Encoded", "FrameError", "IMPLS", "DEFAULT_CHUNK", "payload_bytes", "resolve_impl"]
