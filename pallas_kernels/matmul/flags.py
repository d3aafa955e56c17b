"""XLA flags the library sets for decode (the lead applies them before JAX starts its backend).

Why this module exists: flags are process-wide and read once, when the backend initializes, so
they can't be chosen per call; the library owns the choice and the measurement behind it.

Measured on an H200, JAX 0.11.2 (benchmarks/RESULTS.md), 4096x14336 bf16,
16 layers, weight TB/s, XLA dots:
                                      T=1 default  T=1 no-triton  T=32 default  T=32 no-triton
    Python loop, separate arrays         2.61          0.77           3.17          3.45
    lax.scan over stacked weights        1.05          0.75           1.17          3.21
    scan(unroll=True)                    0.80          0.79           3.20          3.39
`--xla_gpu_enable_triton_gemm=false` (cuBLAS) cuts the T=1 GEMV of the Python loop from 2.61 to
0.77 TB/s and helps only at T >= 8; no single setting wins, and the decode matmuls go to the
Mosaic kernel (3.1-3.3 TB/s at T=1 in every loop arrangement), which no XLA flag touches.
So the library sets no flag. GPU_NO_TRITON_GEMM is kept for callers who run XLA dots at
T >= 8 in a scan (e.g. a prefill path).
"""
from __future__ import annotations

GPU_DECODE_FLAGS: tuple[str, ...] = ()
GPU_NO_TRITON_GEMM = "--xla_gpu_enable_triton_gemm=false"


def xla_flags_for_decode(backend: str = "gpu") -> list[str]:
    """The XLA flags to add to XLA_FLAGS for decode on `backend` ("gpu", "tpu", "cpu")."""
    if backend == "gpu":
        return list(GPU_DECODE_FLAGS)
    if backend in ("tpu", "cpu"):
        return []
    raise ValueError(f"backend must be 'gpu', 'tpu' or 'cpu', got {backend!r}")


def merged_xla_flags(existing: str | None, backend: str = "gpu", extra: tuple[str, ...] = ()) -> str:
    """`existing` XLA_FLAGS plus the decode flags (and `extra`) whose names it doesn't already set."""
    existing = existing or ""
    names = {f.split("=", 1)[0] for f in existing.split()}
    add = [f for f in [*xla_flags_for_decode(backend), *extra] if f.split("=", 1)[0] not in names]
    return " ".join([existing, *add]).strip()
