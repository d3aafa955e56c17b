"""Tuned parameters of the decode weight-streaming matmuls (gpu.py, gpu_fused.py, dispatch.py), as data.

Why a table: the tile searches (gpu.auto_config, gpu_fused.auto_config) and the fused-mode choice
(gpu_fused.auto_mode) are shape heuristics whose preferences and thresholds were measured on one device kind. They
live here, one row per `jax.Device.device_kind` ("default" for kinds not in the table), read through `current()`;
`override(**fields)` replaces fields for a block of code (tests, benchmark sweeps), and the search functions take
an explicit `tun=` row as well. What fits (registers, shared memory, divisibility) is computed, not tuned: it stays
in the kernels' plans.

Fields (measured on an H200, benchmarks/RESULTS.md "Decode matmuls"):
  fused            the one-launch kernel mode taken when a caller passes no `fused=`: "auto" = auto_mode's per-shape
                   choice between "direct" and the partials + XLA epilogue kernel (None: always the latter).
  interpret_sms    grid size assumed when the GPU kernel runs in interpret mode (no GPU).
  tiles_f, tiles_d candidate F rows per CTA and D steps of the tile search, in order of preference on ties.
  narrow_f_tp      bf16 at lo <= Tp <= hi prefers tile_f = 64: each CTA covers twice the D range per F tile, so its
                   float32 partials halve; +5-12% on the <= 50 MB matrices at T = 32/64, neutral on 4096x28672,
                   slower at T = 128.
  ws_tp, ws_tile_d, ws_tile_f, ws_n_wg, ws_smem_budget
                   fp8 with block scales at Tp == ws_tp, one matrix, F % ws_tile_f == 0 takes the warp-specialized
                   kernel with ws_n_wg compute warpgroups over a ws_tile_f-row F tile (+5-13% over one warpgroup on
                   4096x4096 and 4096x28672).
  direct_tiles_f   F-tile preference of the fused "direct" mode (64 first: twice the CTAs of 128 on a small F).
  direct_max_tp, direct_min_busy, direct_short_tp, direct_min_d
                   auto_mode takes "direct" for bf16 at Tp <= direct_max_tp where its whole-tile runs occupy
                   >= direct_min_busy of the SMs and (Tp <= direct_short_tp or D >= direct_min_d): the gate/up pair
                   (112 CTAs) +3..10% at T = 1 and +17..25% at T = 32/64, qkv (96 CTAs) +4% / +31% at T = 1 / 64,
                   2048x7168 +15..23% at T <= 8; it lost with few CTAs (7168x2048: 32 CTAs, -20..-53%) or short runs
                   with many x rows (2048x7168 at T = 32: -16%); with 64 CTAs two runs disagreed (not taken). fp8
                   "direct" measured 0.65-0.78x the default: never taken.
"""
from __future__ import annotations

import dataclasses

from pallas_kernels.utils import TuningTable

__all__ = ["MatmulTuning", "TABLE", "current", "override"]


@dataclasses.dataclass(frozen=True)
class MatmulTuning:
    fused: str | None = "auto"
    interpret_sms: int = 4
    tiles_f: tuple[int, ...] = (128, 64)
    tiles_d: tuple[int, ...] = (256, 128, 64)
    narrow_f_tp: tuple[int, int] = (32, 64)
    ws_tp: int = 8
    ws_tile_d: int = 128
    ws_tile_f: int = 256
    ws_n_wg: int = 2
    ws_smem_budget: int = 224 * 1024
    direct_tiles_f: tuple[int, ...] = (64, 128)
    direct_max_tp: int = 64
    direct_min_busy: float = 0.7
    direct_short_tp: int = 8
    direct_min_d: int = 4096

    def narrow_f(self, tp: int, fp8: bool) -> bool:
        """Whether bf16 weights at this padded T prefer the 64-row F tile."""
        lo, hi = self.narrow_f_tp
        return not fp8 and lo <= tp <= hi


# every field above: measured on the H200; other kinds take the default row (the same values)
TABLE: dict[str, MatmulTuning] = {"default": MatmulTuning(), "NVIDIA H200": MatmulTuning()}
current, override = TuningTable("matmul_tuning", TABLE).bind()
