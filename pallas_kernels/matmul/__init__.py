"""Decode matmuls at the memory-bandwidth limit: weight-streaming kernels + dispatcher.

Public API:
    decode_matmul(x_TD, w_DF, *, w_scale=None, layer=None, impl="auto")    -> y_TF
    gate_up_silu(x_TD, w_gate_DF, w_up_DF, *, gate_scale=None, up_scale=None, layer=None,
                 impl="auto")                                                -> h_TF
    xla_flags_for_decode(backend="gpu")                                      -> list[str]
    kernel_unsupported_reason(x_TD, ws, scales=None)                         -> str | None
reference.py defines the math; gpu.py is the Mosaic GPU (Hopper) kernel and chooses between its variants
(gpu_fused.py: one launch, gpu_ws.py: warp-specialized; the pieces they share in gpu_blocks.py); tpu.py the XLA
fallback used on TPU; dispatch.py picks one.
"""
from pallas_kernels.matmul.dispatch import decode_matmul, gate_up_silu, kernel_unsupported_reason
from pallas_kernels.matmul.flags import merged_xla_flags, xla_flags_for_decode
from pallas_kernels.matmul.reference import decode_matmul_reference, dequantize, gate_up_silu_reference

__all__ = [
    "decode_matmul", "gate_up_silu", "kernel_unsupported_reason", "xla_flags_for_decode", "merged_xla_flags",
    "decode_matmul_reference", "gate_up_silu_reference", "dequantize",
]
