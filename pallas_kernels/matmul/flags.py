"""XLA flags the library sets for decode (the lead applies them before JAX starts its backend).

Why: flags are process-wide and read once, when the backend initializes, so they can't be
set per call. Measured on an H200 with JAX 0.11.2 (benchmarks/RESULTS.md, issue 9): with default
flags XLA routes skinny bf16 dots to Triton GEMMs that read weights at ~1.0 TB/s; with
`--xla_gpu_enable_triton_gemm=false` they go to cuBLAS at 2.3-2.7 TB/s. The decode matmul
kernel itself is a Mosaic GPU custom call that no flag touches; the flag matters for every
dot still left to XLA (fallbacks, prefill, the LM head if not routed to the kernel).
"""
from __future__ import annotations

GPU_DECODE_FLAGS = ("--xla_gpu_enable_triton_gemm=false",)


def xla_flags_for_decode(backend: str = "gpu") -> list[str]:
    """The XLA flags to add to XLA_FLAGS for decode on `backend` ("gpu", "tpu", "cpu")."""
    if backend == "gpu":
        return list(GPU_DECODE_FLAGS)
    if backend in ("tpu", "cpu"):
        return []
    raise ValueError(f"backend must be 'gpu', 'tpu' or 'cpu', got {backend!r}")


def merged_xla_flags(existing: str | None, backend: str = "gpu") -> str:
    """`existing` XLA_FLAGS plus the decode flags whose names it doesn't already set."""
    existing = existing or ""
    names = {f.split("=", 1)[0] for f in existing.split()}
    extra = [f for f in xla_flags_for_decode(backend) if f.split("=", 1)[0] not in names]
    return " ".join([existing, *extra]).strip()
