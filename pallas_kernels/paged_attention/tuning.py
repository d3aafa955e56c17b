"""Tuned launch parameters of the Mosaic GPU paged-attention kernels, as data.

One row per device kind (`jax.Device.device_kind`), each value with the measurement behind it; kinds not in the
table take the "default" row. The kernels' entry points read `current()` once per call and pass the row to the
jitted kernel as a static argument (every field can still be passed explicitly to `gpu.make_config` /
`paged_decode_attention_gpu`, which then replaces it in the row); `override(**fields)` replaces fields for a block
of code (tests, benchmark sweeps) without touching module state.

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
                   (benchmarks/RESULTS.md, "Paged attention", a block table 8192 pages wide).
  decode_block     (kv tokens per step, stages) of the one-warpgroup bf16 decode kernel (gpu.choose_block): 64 x 2
                   (~81 KiB of shared memory, two CTAs per SM) gave 78-105% of the copy ceiling from batch 8 x 1k
                   up with the "waves" policy, where 128 x 2 (one CTA per SM) gave 59-104%.
  ragged_block     the same for the ragged (prefill / mixed) kernel: 128 x 2.
  fp8_inline_stages  stages of the one-warpgroup fp8 kernel (inline conversion; 64-token steps up to pages of 64).
  num_sms          SMs the grid heuristics plan for; 0 = the device's count (utils.device_sm_count). Tests set it
                   small to force several work items per persistent program.
  detect_races     interpret mode only: the GPU interpreter reports unsynchronized shared-memory accesses of the
                   warp-specialized fp8 kernel (a check, not a tuned value; off by default: slow).
The measurements: benchmarks/RESULTS.md, "Paged attention" (one H200, 2026-11-29 and 12-01).
"""
from __future__ import annotations

import dataclasses

from pallas_kernels.utils import TuningTable, device_sm_count

__all__ = ["GpuAttentionTuning", "TABLE", "current", "override", "num_sms"]


@dataclasses.dataclass(frozen=True)
class GpuAttentionTuning:
  fp8_converters: int = 1
  fp8_compute_wgs: int = 1
  fp8_qk: bool = False
  fp8_convert: str = "cvt"
  split_policy: str = "waves"
  ragged_waves: int = 4
  work_list: bool = False
  decode_block: tuple[int, int] = (64, 2)
  ragged_block: tuple[int, int] = (128, 2)
  fp8_inline_stages: int = 3
  num_sms: int = 0
  detect_races: bool = False


# every field above: measured on the H200; other kinds take the default row (the same values)
TABLE: dict[str, GpuAttentionTuning] = {"default": GpuAttentionTuning(), "NVIDIA H200": GpuAttentionTuning()}
current, override = TuningTable("paged_attention_tuning", TABLE).bind()


def num_sms(row: GpuAttentionTuning | None = None) -> int:
  """The SM count the heuristics plan for: the row's (`current()` by default), else the device's."""
  row = current() if row is None else row
  return row.num_sms or device_sm_count()
