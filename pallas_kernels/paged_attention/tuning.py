"""Tuned launch parameters of the Mosaic GPU paged-attention kernels, as data.

One row per device kind (`jax.Device.device_kind`), each value with the measurement behind it; kinds not in the
table take the "default" row. The kernels read `current()` when they are traced (every field can still be passed
explicitly to `gpu.make_config` / `paged_decode_attention_gpu`); `override(**fields)` replaces fields for a block of
code (tests, benchmark sweeps) without touching module state.

Fields:
  fp8_converters   converter warpgroups of the fp8 decode kernel (0: inline conversion). H200: 1 converter with
                   128-token steps x 2 stages = 0.64x the inline kernel's time at batch 8 x 8k.
  fp8_compute_wgs  compute warpgroups of the warp-specialized fp8 kernel (2: opt-in, not measured on a GPU).
  fp8_qk           fp8 decode: QK^T as an fp8 wgmma on the stored K bytes with q quantized per row to e4m3 (only V
                   widened); False = the exact f16 path. Not measured on a GPU.
  fp8_convert      warp-specialized widening: "cvt" (hardware cvt) or "bits" (integer ops; 1.4-1.6x slower on H200).
  split_policy     split-K policy of the static split count (gpu.choose_splits): "waves" beat "sms2" at every
                   measured H200 shape.
  ragged_waves     ragged kernels: persistent programs = this many waves, each looping over the real work items.
  work_list        dense decode: the split count chosen at run time from the real lengths (gpu.decode_work_list).
                   Off: the static split over a table as wide as the engine's (8192 pages) measured as fast
                   (benchmarks/RESULTS.md, paged attention Run E).
The measurements: benchmarks/RESULTS.md, "Paged attention" (runs A-E).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax

__all__ = ["GpuAttentionTuning", "TABLE", "current", "override"]


@dataclasses.dataclass(frozen=True)
class GpuAttentionTuning:
  fp8_converters: int = 1
  fp8_compute_wgs: int = 1
  fp8_qk: bool = False
  fp8_convert: str = "cvt"
  split_policy: str = "waves"
  ragged_waves: int = 4
  work_list: bool = False


TABLE: dict[str, GpuAttentionTuning] = {
    "default": GpuAttentionTuning(),
    "NVIDIA H200": GpuAttentionTuning(),          # every field above was measured on this kind
}

_override: contextvars.ContextVar = contextvars.ContextVar("paged_attention_tuning", default=None)


def _device_kind() -> str:
  try:
    return jax.devices()[0].device_kind
  except Exception:  # noqa: BLE001 - no backend: the default row
    return "default"


def current() -> GpuAttentionTuning:
  """The row of this process's first device kind (or "default"), with any active `override` applied."""
  o = _override.get()
  return o if o is not None else TABLE.get(_device_kind(), TABLE["default"])


@contextlib.contextmanager
def override(**fields):
  """Within the block, `current()` returns the current row with `fields` replaced (unknown names raise)."""
  token = _override.set(dataclasses.replace(current(), **fields))
  try:
    yield _override.get()
  finally:
    _override.reset(token)
