"""Tuned choices of the SplitZip dispatcher and kernels, as data.

Why a table: which path encode/decode take on a GPU, the chunk size picked by tensor size, the static escape
capacity and the GPU kernels' options were each chosen by a measurement on one device kind. They live here, one row
per `jax.Device.device_kind` ("default" for kinds not in the table), read through `current()`; `override(**fields)`
replaces fields for a block of code (tests, benchmark sweeps). Options a caller passes to encode/decode
(`lookup=`, `slots=`, `group=`, `lut=`) replace the row's for that call.

Fields (one H200, 1 GiB BF16 KV, benchmarks/RESULTS.md "SplitZip"):
  gpu_encode, gpu_decode  impl="auto" on a GPU: the Mosaic kernels ("gpu"): encode 1081 GB/s vs the XLA-fused jnp
                          path's 9.7 (512 without listing escapes), decode 1932 GB/s vs 666.
  chunk_small, chunk_large, chunk_large_from
                          chunk size when the caller names none: chunk_large (fewer counts, the fast kernel shape)
                          from chunk_large_from elements up, chunk_small below, so padding the last chunk stays small.
  capacity_per, capacity_min
                          static escape slots on device: one per capacity_per elements (real KV escapes ~1/1700),
                          at least capacity_min, rounded up to a power of two.
  encode_lookup, encode_slots, encode_group, decode_lut, decode_group
                          the GPU kernels' defaults (gpu.encode_kernel / gpu.decode_kernel).
"""
from __future__ import annotations

import dataclasses

from pallas_kernels.utils import TuningTable

from .layout import DEFAULT_CHUNK, MIN_CHUNK

__all__ = ["SplitZipTuning", "TABLE", "current", "override"]


@dataclasses.dataclass(frozen=True)
class SplitZipTuning:
    gpu_encode: str = "gpu"
    gpu_decode: str = "gpu"
    chunk_small: int = MIN_CHUNK
    chunk_large: int = DEFAULT_CHUNK
    chunk_large_from: int = 1 << 20
    capacity_per: int = 512
    capacity_min: int = 1024
    encode_lookup: str = "auto"
    encode_slots: int = 16
    encode_group: int = 1
    decode_lut: str = "swar"
    decode_group: int = 1

    def encode_opts(self) -> dict:
        """The encode kernels' options of this row (gpu.encode_kernel; the TPU kernel takes `lookup`)."""
        return {"lookup": self.encode_lookup, "slots": self.encode_slots, "group": self.encode_group}

    def decode_opts(self) -> dict:
        return {"lut": self.decode_lut, "group": self.decode_group}


# every field above: measured on the H200; other kinds take the default row (the same values)
TABLE: dict[str, SplitZipTuning] = {"default": SplitZipTuning(), "NVIDIA H200": SplitZipTuning()}
current, override = TuningTable("splitzip_tuning", TABLE).bind()
