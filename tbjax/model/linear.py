"""How the model's projections run: XLA dots, or the decode weight-streaming kernel reading a layer in place.

Why this module exists: decode matmuls are bound by how fast the weights stream out of HBM (benchmarks/RESULTS.md,
"Decode matmuls"). The Mosaic GPU kernel (pallas_kernels.matmul) reads layer j of a stacked [L, D, F] weight in place;
slicing `w[j]` first and handing the slice to a custom call would make XLA copy it. So layer code never slices a
weight it multiplies: it asks `linear(p, "w_qkv", x)` and `p` decides.

`p` is either
  * a plain dict of per-layer arrays (whole-prompt forwards, mesh forwards, prefill steps): XLA dots, or
  * a `LayerParams` view over the group's stacks + a layer index + a kernel impl (decode steps): the kernel
    dispatcher (`decode_matmul`) for the shapes the kernel takes, XLA dots for the others.
Both accumulate in float32; results are cast to the activations' dtype unless `out_dtype` says otherwise.

A weight may be a `QuantizedWeight` (tbjax/model/quant.py: int8 / int4 / fp8 resident in its stored precision).
`matmul` is the one dispatcher for every dense projection of the model (layer kinds, MoE shared experts, MLA, the
head): float weights take XLA's dot; quantized ones
  * fp8 with 128 x 128 block scales on a `LayerParams` view in a decode step: the decode kernel's fp8 path (it reads
    codes and scales of the layer in place);
  * int8 / int4 on CPU at every token count (cpu_qgemv.MAX_T rows per call, so a row never depends on the step's
    bucket): the CPU custom call (tbjax/model/cpu_qgemv.py),
    which streams the codes once and accumulates in float32 (XLA's dequantize + dot writes and re-reads a bf16
    copy of the weight: slower than the bf16 model);
  * otherwise `dequant_dot`: the weight dequantized inside the program to the compute dtype (XLA fuses the
    dequantization into one loop over the codes) and XLA's dot with float32 accumulation. With bf16 compute that
    is the bf16 model's own arithmetic (the weights a bf16 load would hold, bf16(q * scale + zero)), so the
    quantized and the float model give the same logits; only the resident bytes differ.
`matmul_reference` (dequantize in float32, float32 dot) defines the result; tests compare every path against it.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul import decode_matmul, kernel_unsupported_reason
from tbjax.model import cpu_qgemv
from tbjax.model.quant import QuantizedWeight, dequantize

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
            w = w[self.layer]
            if isinstance(w, QuantizedWeight):
                return QuantizedWeight(w.q[None], w.scale[None], None, fmt=w.fmt, block=(1, *w.block),
                                       shape=(1, *w.shape), dtype=w.dtype), 0
            return w[None], 0
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


def _kernel_fp8(w) -> bool:
    """An fp8 weight in the kernel's layout: [D, F] (or stacked [L, D, F]) codes with [ceil(D/128), ceil(F/128)]
    (stacked: [L, ...]) block scales."""
    return isinstance(w, QuantizedWeight) and w.fmt == "fp8" and w.zero is None and (
        (w.ndim == 3 and w.block == (1, 128, 128)) or (w.ndim == 2 and w.block == (128, 128)))


def _kernel_operands(w):
    """(codes or bf16 weight, its block scales or None) as the kernel takes them."""
    return (w.q, w.scale) if isinstance(w, QuantizedWeight) else (w, None)


def _kernel_ok(p, x_TD, *names) -> bool:
    """Whether these projections go to the kernel: a LayerParams view, bf16 operands (or fp8 block-scaled weights),
    shapes the kernel takes. Anything else uses XLA dots (never the slow float32 reference the kernel dispatcher would
    fall back to). Stacks of more than 3 dims ([L, D, 2, F] gate/up) are seen as [L, D, prod(rest)] (bf16 only)."""
    if not (isinstance(p, LayerParams) and x_TD.shape[0] <= KERNEL_MAX_T and x_TD.dtype == jnp.bfloat16):
        return False
    ws = [p.stacked(n)[0] for n in names]
    if any(isinstance(w, QuantizedWeight) for w in ws):
        if not all(_kernel_fp8(w) for w in ws):
            return False
        return kernel_takes(x_TD, *ws)
    return kernel_takes(x_TD, *[jax.ShapeDtypeStruct((*w.shape[:2], int(np.prod(w.shape[2:]))), w.dtype)
                                if w.ndim > 3 else w for w in ws])


def kernel_takes(x_TD, *ws) -> bool:
    """bf16 weights (or fp8 weights with 128 x 128 block scales) the kernel can stream in one launch against x (else
    the caller uses XLA dots)."""
    if x_TD.dtype != jnp.bfloat16 or x_TD.shape[0] > KERNEL_MAX_T:
        return False
    if any(not (_kernel_fp8(w) or (not isinstance(w, QuantizedWeight) and w.dtype == jnp.bfloat16)) for w in ws):
        return False
    ops = [_kernel_operands(w) for w in ws]
    why = kernel_unsupported_reason(x_TD, [o[0] for o in ops], [o[1] for o in ops])
    if why is not None:
        log.info("decode projection of %s uses XLA dots: %s", [tuple(w.shape) for w in ws], why)
    return why is None


def matmul_reference(x_TD, w, out_dtype=None):
    """The definition: x (float32) @ the weight dequantized in float32, float32 accumulation. w is [D, ...]
    (contracting its first axis); returns [T, ...] in out_dtype (default x's dtype)."""
    out_dtype = out_dtype or x_TD.dtype
    wf = dequantize(w, jnp.float32)
    y = jnp.dot(x_TD.astype(jnp.float32), wf.reshape(wf.shape[0], -1), preferred_element_type=jnp.float32,
                precision=jax.lax.Precision.HIGHEST)
    return y.reshape(x_TD.shape[0], *wf.shape[1:]).astype(out_dtype)


def dequant_dot(x_TD, w: QuantizedWeight, out_dtype=None):
    """x @ w for a quantized [D, ...] weight through XLA: dequantized to the compute dtype inside the program
    (float32 math, rounded once), then XLA's dot with float32 accumulation."""
    out_dtype = out_dtype or x_TD.dtype
    wd = dequantize(w, x_TD.dtype)
    y = jnp.dot(x_TD, wd.reshape(wd.shape[0], -1), preferred_element_type=jnp.float32)
    return y.reshape(x_TD.shape[0], *w.shape[1:]).astype(out_dtype)


def _codes_exact_in(w: QuantizedWeight, dtype) -> bool:
    """Whether every code of w converts to `dtype` exactly (int8 and e4m3 into bf16 / f16 / f32)."""
    return w.zero is None and w.fmt in ("int8", "fp8") and jnp.dtype(dtype) in (
        jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def per_channel(w: QuantizedWeight) -> bool:
    """One scale per output column (the scale block spans the whole contraction axis), no zero point."""
    return w.zero is None and w.block[0] >= w.shape[0] and all(b == 1 for b in w.block[1:])


def row_scaled(x_TD, w_VD: QuantizedWeight) -> bool:
    """A [V, D] table (a tied head, contracting D) with one scale per row and codes exact in x's dtype."""
    return _codes_exact_in(w_VD, x_TD.dtype) and w_VD.ndim == 2 and w_VD.block == (1, w_VD.shape[1]) and \
        w_VD.index is None


def channel_dot(x_TD, w: QuantizedWeight, out_dtype=None):
    """x @ w for a per-channel weight: (x @ codes) * scale, the scale applied to the float32 result. The codes
    convert to x's dtype exactly, and a bare convert is what XLA:GPU fuses into its GEMM: the weight is read once
    in its stored bytes (dequantizing first writes and re-reads a bf16 copy, 5 bytes per fp8 weight instead of 1)."""
    out_dtype = out_dtype or x_TD.dtype
    w = w.materialize()                          # a layer's view of a stack: XLA fuses the slice into the GEMM
    D = w.shape[0]
    y = jnp.dot(x_TD, w.q.reshape(D, -1).astype(x_TD.dtype), preferred_element_type=jnp.float32)
    y = y * w.scale.reshape(1, -1).astype(jnp.float32)
    return y.reshape(x_TD.shape[0], *w.shape[1:]).astype(out_dtype)


# block_dot for steps of at most this fraction of a column block's width in tokens (64 for 128-wide fp8 blocks):
# its extra traffic, 4 T / bN bytes per weight element, stays at most half of dequantizing's.
BLOCK_DOT_MAX_T_PER_COL = 0.5


def _block_layout(w: QuantizedWeight):
    """(rows per block bD, columns per block bN) when w's scales are blocks of bD contraction rows x bN contiguous
    columns of the [D, N] matrix (N = the flattened output axes) that tile it exactly, else None."""
    if w.zero is not None or w.ndim < 2:
        return None
    bD, rest, brest = w.block[0], w.shape[1:], w.block[1:]
    if any(b != 1 for b in brest[:-1]) or w.shape[0] % bD or rest[-1] % brest[-1] or bD >= w.shape[0]:
        return None
    return bD, brest[-1]


def block_dot(x_TD, w: QuantizedWeight, out_dtype=None):
    """x @ w for a block-scaled weight (scales per bD rows x bN columns, DeepSeek's fp8 128 x 128) at decode token
    counts, without dequantizing the weight: for column block n, x @ (q * s) = (x * s[:, n] per row block) @ q[:, n].
    x is scaled once per column block (a [N/bN, T, D] operand, float32 math rounded once to x's dtype), then one
    batched GEMM over the column blocks reads the codes through a bare convert (fused into the GEMM on XLA:GPU).
    Extra traffic: the scaled x, 4 T / bN bytes per weight element (write + read) -- below dequantizing's 4 (a bf16
    copy written and read) while T < bN; `matmul` takes this path for T <= BLOCK_DOT_MAX_T_PER_COL * bN."""
    out_dtype = out_dtype or x_TD.dtype
    w = w.materialize()
    T, D = x_TD.shape
    bD, bN = _block_layout(w)
    N = int(np.prod(w.shape[1:]))
    nb = N // bN
    s = w.scale.reshape(D // bD, nb).astype(jnp.float32)                        # [Db, Nb]
    xs = x_TD.astype(jnp.float32).reshape(1, T, D // bD, bD) * s.T[:, None, :, None]
    xs = xs.reshape(nb, T, D).astype(x_TD.dtype)                                # [Nb, T, D]
    q = w.q.reshape(D, nb, bN).astype(x_TD.dtype)                               # [D, Nb, bN]
    y = jax.lax.dot_general(xs, q, (((2,), (0,)), ((0,), (1,))), preferred_element_type=jnp.float32)  # [Nb, T, bN]
    return y.transpose(1, 0, 2).reshape(T, *w.shape[1:]).astype(out_dtype)


def quantized_dot(x_TD, w: QuantizedWeight, out_dtype=None):
    """x @ w for a QuantizedWeight through XLA, the cheapest exact-code form: per-channel scales on the result
    (channel_dot), block scales on x at decode token counts (block_dot), else the weight dequantized in the
    program (dequant_dot: what prefill-sized steps take, where the GEMM's FLOPs hide the copy)."""
    if _codes_exact_in(w, x_TD.dtype):
        if per_channel(w):
            return channel_dot(x_TD, w, out_dtype)
        lay = _block_layout(w)
        if lay is not None and x_TD.shape[0] <= BLOCK_DOT_MAX_T_PER_COL * lay[1]:
            return block_dot(x_TD, w, out_dtype)
    return dequant_dot(x_TD, w, out_dtype)


def matmul(x_TD, w, out_dtype=None):
    """x [T, D] @ w [D, ...] (float or QuantizedWeight) with float32 accumulation, in out_dtype (default x's)."""
    out_dtype = out_dtype or x_TD.dtype
    if isinstance(w, QuantizedWeight):
        if cpu_qgemv.takes_cols(x_TD, w):
            return cpu_qgemv.qgemv_cols(x_TD, w).reshape(x_TD.shape[0], *w.shape[1:]).astype(out_dtype)
        return quantized_dot(x_TD, w, out_dtype)
    if w.ndim > 2:
        y = jnp.dot(x_TD, w.reshape(w.shape[0], -1), preferred_element_type=jnp.float32)
        return y.reshape(x_TD.shape[0], *w.shape[1:]).astype(out_dtype)
    return jnp.dot(x_TD, w, preferred_element_type=jnp.float32).astype(out_dtype)


def kernel_matmul(x_TD, w_LDF, layer, impl, out_dtype):
    """The decode kernel on a bf16 weight or on an fp8 one's codes and block scales (layer: index into a stack)."""
    q, s = _kernel_operands(w_LDF)
    return decode_matmul(x_TD, q, w_scale=s, layer=layer, impl=impl, out_dtype=out_dtype)


def linear(p, name: str, x_TD, out_dtype=None):
    """x @ p[name] with float32 accumulation, cast to out_dtype (default: x's dtype)."""
    out_dtype = out_dtype or x_TD.dtype
    if _kernel_ok(p, x_TD, name):
        w_LDF, layer = p.stacked(name)
        return kernel_matmul(x_TD, w_LDF, layer, p.impl, out_dtype)
    return matmul(x_TD, p[name], out_dtype)


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
        gu = matmul(x_TD, w_D2F, jnp.float32).reshape(x_TD.shape[0], 2 * F)
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
