"""One entry point per decode matmul; picks the implementation by platform and shape.

impl="auto": on a GPU backend the Mosaic GPU kernel (gpu.py), falling back to the reference
with a logged warning when the kernel can't take the operands; on TPU the XLA path (tpu.py);
elsewhere the reference. impl="gpu" forces the kernel (in interpret mode off-GPU) and raises if
it can't take the operands; impl="tpu"/"xla" force the XLA path; impl="reference" the definition.

Weights may be one matrix [D, F] or a stack [L, D, F] with `layer` (an int32 scalar, may be
traced, e.g. a fori_loop counter): the kernel then reads that layer in place. Measured on the
H200 (benchmarks/RESULTS.md), every layer-loop arrangement streams within ~7% with the kernel
(Python loop with layer= fastest, fori_loop slowest); XLA's dot varies 3x with flags/arrangement.
The reference fallback dequantizes to float32 first: correct everywhere, slow for fp8 on GPU.
"""
from __future__ import annotations

import logging

import jax

from pallas_kernels.matmul import gpu, reference, tpu, tuning

log = logging.getLogger(__name__)
IMPLS = ("auto", "reference", "gpu", "tpu", "xla")
_warned: set = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def _check(x_TD, w, scale, layer, what: str):
    """Validate shapes/dtypes; returns the single-layer views used for the checks."""
    if w.ndim == 3:
        if layer is None:
            raise ValueError(f"{what}: stacked weights [L, D, F]={w.shape} need layer=")
        exp_scale_nd = (2, 3)
        if scale is not None and (scale.ndim not in exp_scale_nd or scale.shape[0] != w.shape[0]):
            raise ValueError(f"{what}: scale for stacked weights {w.shape} must be [L, F] or "
                             f"[L, ceil(D/128), ceil(F/128)] with L={w.shape[0]}, got {scale.shape}")
        w2 = jax.ShapeDtypeStruct(w.shape[1:], w.dtype)
        s2 = None if scale is None else jax.ShapeDtypeStruct(scale.shape[1:], scale.dtype)
        if jax.numpy.ndim(layer) != 0:
            raise ValueError(f"{what}: layer must be a scalar, got shape {jax.numpy.shape(layer)}")
    else:
        if layer is not None:
            raise ValueError(f"{what}: layer= given but weights are not stacked (shape {w.shape})")
        w2, s2 = w, scale
    reference.check_operands(x_TD, w2, s2)
    return w2, s2


def _pick(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    if backend == "gpu":
        return "gpu"
    if backend == "tpu":
        return "tpu"
    return "reference"


def kernel_unsupported_reason(x_TD, ws, scales=None) -> str | None:
    """Why the GPU kernel can't take x @ each of `ws` (one launch), or None if it can. For callers (the model) that
    prefer their own fallback (XLA dots) to the reference this dispatcher falls back to."""
    scales = list(scales) if scales is not None else [None] * len(ws)
    nsm = None if jax.default_backend() == "gpu" else tuning.current().interpret_sms
    c, why = gpu.plan_for(x_TD, list(ws), scales, None, nsm)
    return None if c is not None else why


def _slice(a, layer):
    return None if a is None or layer is None else a[layer]


def decode_matmul(x_TD, w_DF, *, w_scale=None, layer=None, impl: str = "auto", cfg=None, out_dtype=None):
    """y[T, F] = x[T, D] @ dequant(w[D, F]) with float32 accumulation, in out_dtype (default: x's dtype).

    w: bf16/f16/f32, or float8_e4m3fn with w_scale float32 [F] (per channel) or
    [ceil(D/128), ceil(F/128)] (128x128 blocks, real = stored * scale). Stacked [L, D, F]
    weights need layer=. cfg: optional gpu.TileConfig (benchmarks/tuning).
    """
    _check(x_TD, w_DF, w_scale, layer, "decode_matmul")
    out_dtype = jax.numpy.dtype(out_dtype or x_TD.dtype)
    chosen = _pick(impl)
    if chosen == "gpu":
        on_gpu = jax.default_backend() == "gpu"
        nsm = None if on_gpu else tuning.current().interpret_sms
        c, why = gpu.plan_for(x_TD, [w_DF], [w_scale], cfg, nsm)
        if c is not None:     # one launch writes y itself where a fused mode measured faster (tuning.py: fused)
            return gpu.decode_matmul_gpu(x_TD, w_DF, w_scale=w_scale, layer=layer, cfg=cfg, num_sms=nsm,
                                         interpret=not on_gpu, out_dtype=out_dtype)
        if impl == "gpu":
            raise ValueError(f"decode_matmul: GPU kernel can't take these operands: {why}")
        _warn_once(f"decode_matmul: falling back to the reference: {why}")
        chosen = "reference"
    if chosen in ("tpu", "xla") and out_dtype == x_TD.dtype:
        return tpu.decode_matmul_xla(x_TD, w_DF, w_scale=w_scale, layer=layer)
    w = w_DF if layer is None else w_DF[layer]
    s = w_scale if layer is None else _slice(w_scale, layer)
    if out_dtype == x_TD.dtype:
        return reference.decode_matmul_reference(x_TD, w, w_scale=s)
    return jax.numpy.dot(x_TD.astype(jax.numpy.float32), reference.dequantize(w, s),
                         preferred_element_type=jax.numpy.float32).astype(out_dtype)


def gate_up_silu(x_TD, w_gate_DF, w_up_DF, *, gate_scale=None, up_scale=None, layer=None,
                 impl: str = "auto", cfg=None):
    """h[T, F] = silu(x @ wg) * (x @ wu): both matrices stream through one kernel launch."""
    _check(x_TD, w_gate_DF, gate_scale, layer, "gate_up_silu (gate)")
    _check(x_TD, w_up_DF, up_scale, layer, "gate_up_silu (up)")
    if w_gate_DF.shape != w_up_DF.shape or w_gate_DF.dtype != w_up_DF.dtype:
        raise ValueError(f"gate_up_silu: gate {w_gate_DF.shape} {w_gate_DF.dtype} and up "
                         f"{w_up_DF.shape} {w_up_DF.dtype} must match in shape and dtype")
    if (gate_scale is None) != (up_scale is None) or (
            gate_scale is not None and gate_scale.shape != up_scale.shape):
        raise ValueError("gate_up_silu: gate_scale and up_scale must both be given with one shape, or both None")
    chosen = _pick(impl)
    if chosen == "gpu":
        on_gpu = jax.default_backend() == "gpu"
        nsm = None if on_gpu else tuning.current().interpret_sms
        ws, ss = [w_gate_DF, w_up_DF], [gate_scale, up_scale]
        c, why = gpu.plan_for(x_TD, ws, ss, cfg, nsm)
        if c is not None:
            return gpu.gate_up_silu_gpu(x_TD, w_gate_DF, w_up_DF, gate_scale=gate_scale,
                                        up_scale=up_scale, layer=layer, cfg=cfg, num_sms=nsm,
                                        interpret=not on_gpu)
        # Too large for one fused launch (e.g. T > 128): two kernel launches, same math.
        cg, _ = gpu.plan_for(x_TD, [w_gate_DF], [gate_scale], cfg, nsm)
        if cg is not None:
            kw = dict(layer=layer, cfg=cfg, num_sms=nsm, interpret=not on_gpu)
            g = gpu.partial_products(x_TD, [w_gate_DF], [gate_scale], **kw)[0]
            u = gpu.partial_products(x_TD, [w_up_DF], [up_scale], **kw)[0]
            g = gpu._channel_scale(g, gate_scale, layer)
            u = gpu._channel_scale(u, up_scale, layer)
            return (jax.nn.silu(g) * u).astype(x_TD.dtype)
        if impl == "gpu":
            raise ValueError(f"gate_up_silu: GPU kernel can't take these operands: {why}")
        _warn_once(f"gate_up_silu: falling back to the reference: {why}")
        chosen = "reference"
    if chosen in ("tpu", "xla"):
        return tpu.gate_up_silu_xla(x_TD, w_gate_DF, w_up_DF, gate_scale=gate_scale,
                                    up_scale=up_scale, layer=layer)
    if layer is not None:
        w_gate_DF, w_up_DF = w_gate_DF[layer], w_up_DF[layer]
        gate_scale, up_scale = _slice(gate_scale, layer), _slice(up_scale, layer)
    return reference.gate_up_silu_reference(x_TD, w_gate_DF, w_up_DF, gate_scale=gate_scale,
                                            up_scale=up_scale)
