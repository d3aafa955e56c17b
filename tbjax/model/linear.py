"""How the model's projections run: XLA dots, or the decode weight-streaming kernel reading a layer in place.

Why this module exists: decode matmuls are bound by how fast the weights stream out of HBM (issue 9). The
Mosaic GPU kernel (pallas_kernels.matmul) reads layer j of a stacked [L, D, F] weight in place; slicing `w[j]`
first and handing the slice to a custom call would make XLA copy it. So layer code never slices a weight it
multiplies: it asks `linear(p, "w_qkv", x)` and `p` decides.

`p` is either
  * a plain dict of per-layer arrays (whole-prompt forwards, mesh forwards, prefill steps): XLA dots, or
  * a `LayerParams` view over the group's stacks + a layer index + a kernel impl (decode steps): the kernel
    dispatcher (`decode_matmul`) for the shapes the kernel takes, XLA dots for the others.
Both accumulate in float32; results are cast to the activations' dtype unless `out_dtype` says otherwise.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul import decode_matmul, kernel_unsupported_reason

log = logging.getLogger(__name__)

MATMUL_IMPLS = ("auto", "xla", "kernel")
KERNEL_MAX_T = 256      # the kernel's wgmma N limit: larger decode batches use XLA dots
# "auto" sends decode batches of at most AUTO_KERNEL_MAX_T tokens to the kernel. Measured on the H200
# (benchmarks/RESULTS.md, probe_launch_overhead.py and bench_engine_decode.py, 2026-11-29): at T=1 XLA's GEMV on a
# statically sliced layer streams 0.71 TB/s against the kernel's 2.2-2.4 (32 layers of 4096x4096); at T=8 XLA's
# Triton GEMM is as fast or faster (2.61 vs 2.39 TB/s), and in the Llama-8B decode step at batch 8 and 32 the
# kernel path was 15% slower (6.47 vs 5.56 ms, 7.65 vs 6.73 ms): its float32 partial epilogue (~0.4 ms/step) and
# the gaps between Mosaic launches (~1 ms/step) outweigh its streaming edge.
AUTO_KERNEL_MAX_T = 4


class LayerParams(Mapping):
    """Layer `layer` of a group's stacked parameters, without slicing the matrices that go to the kernel."""

    def __init__(self, stacks: Mapping, layer: int, impl: str):
        self.stacks, self.layer, self.impl = stacks, layer, impl

    def __getitem__(self, name):
        return self.stacks[name][self.layer]

    def stacked(self, name):
        """(a stacked [L, ...] array, the index of this layer in it) for the kernel, which reads a layer in place:
        the group's stack, or this layer's own buffer seen as a stack of one (per-layer buffers)."""
        w = self.stacks[name]
        if isinstance(w, (list, tuple)):
            return w[self.layer][None], 0
        return w, self.layer

    def __contains__(self, name):
        return name in self.stacks

    def __iter__(self):
        return iter(self.stacks)

    def __len__(self):
        return len(self.stacks)


def layer_params(stacks: Mapping, layer: int, kernel_impl: str | None):
    """The per-layer view the layer kinds receive: a LayerParams when a kernel impl is given, else a dict."""
    if kernel_impl is None:
        return {k: v[layer] for k, v in stacks.items()}     # a static slice of a stack, or a per-layer buffer
    return LayerParams(stacks, layer, kernel_impl)


def _kernel_ok(p, x_TD, *names) -> bool:
    """Whether these projections go to the kernel: a LayerParams view, bf16 operands, shapes the kernel takes.
    Anything else uses XLA dots (never the slow float32 reference the kernel dispatcher would fall back to).
    Stacks of more than 3 dims ([L, D, 2, F] gate/up) are seen as [L, D, prod(rest)]."""
    if not (isinstance(p, LayerParams) and x_TD.shape[0] <= KERNEL_MAX_T and x_TD.dtype == jnp.bfloat16):
        return False
    ws = [p.stacked(n)[0] for n in names]
    return kernel_takes(x_TD, *[jax.ShapeDtypeStruct((*w.shape[:2], int(np.prod(w.shape[2:]))), w.dtype)
                                if w.ndim > 3 else w for w in ws])


def kernel_takes(x_TD, *ws) -> bool:
    """bf16 weights the kernel can stream in one launch against x (else the caller uses XLA dots)."""
    if x_TD.dtype != jnp.bfloat16 or x_TD.shape[0] > KERNEL_MAX_T or any(w.dtype != jnp.bfloat16 for w in ws):
        return False
    why = kernel_unsupported_reason(x_TD, ws)
    if why is not None:
        log.info("decode projection of %s uses XLA dots: %s", [tuple(w.shape) for w in ws], why)
    return why is None


def linear(p, name: str, x_TD, out_dtype=None):
    """x @ p[name] with float32 accumulation, cast to out_dtype (default: x's dtype)."""
    out_dtype = out_dtype or x_TD.dtype
    if _kernel_ok(p, x_TD, name):
        w_LDF, layer = p.stacked(name)
        return decode_matmul(x_TD, w_LDF, layer=layer, impl=p.impl, out_dtype=out_dtype)
    return jnp.dot(x_TD, p[name], preferred_element_type=jnp.float32).astype(out_dtype)


def swiglu(p, x_TD, gate_up="w_gate_up", down="w_down", row_scale_T1=None):
    """silu(x @ gate) * (x @ up) @ down, gate and up read as one [D, 2F] matrix (one GEMM / one kernel launch).

    row_scale_T1: float32 [T, 1] multiplying x @ [gate, up] before the SiLU (a norm folded into gate/up,
    tbjax/model/kinds.py fold_norms); XLA fuses it into the SiLU kernel."""
    if _kernel_ok(p, x_TD, gate_up):
        w_LD2F, layer = p.stacked(gate_up)
        L, D, _, F = w_LD2F.shape
        gu = decode_matmul(x_TD, w_LD2F.reshape(L, D, 2 * F), layer=layer, impl=p.impl, out_dtype=jnp.float32)
    else:
        w_D2F = p[gate_up]
        D, _, F = w_D2F.shape
        gu = jnp.dot(x_TD, w_D2F.reshape(D, 2 * F), preferred_element_type=jnp.float32)
    if row_scale_T1 is not None:
        gu = gu * row_scale_T1
    h = (jax.nn.silu(gu[:, :F]) * gu[:, F:]).astype(x_TD.dtype)
    return linear(p, down, h)


def kernel_impl_for(matmul_impl: str, decode_only: bool, num_tokens: int = 1) -> str | None:
    """The kernel impl a step uses (None => XLA dots).

    "auto": the kernel for decode steps of at most AUTO_KERNEL_MAX_T tokens on a GPU backend; "kernel": for every
    decode step (interpret mode off-GPU: tests); "xla": never. Prefill/mixed steps always use XLA dots.
    """
    if matmul_impl not in MATMUL_IMPLS:
        raise ValueError(f"matmul_impl must be one of {MATMUL_IMPLS}, got {matmul_impl!r}")
    if matmul_impl == "xla" or not decode_only:
        return None
    if matmul_impl == "kernel":
        return "gpu"
    ok = jax.default_backend() == "gpu" and num_tokens <= AUTO_KERNEL_MAX_T
    return "gpu" if ok else None
