"""Turn per-layer checkpoint tensors into tbjax's stacked parameter tree, checking every shape against the spec.

Loaders (GGUF, safetensors) only know how to fetch one named tensor in Hugging Face orientation ([out, in]);
this module owns the mapping to the tree layout (stacked per layer group, [in, out] matrices, fused QKV, gate and
up as one [in, 2, out] matrix; MoE routers and experts, MLA projections). It imports no other loader: GGUF,
safetensors_dir and hf_names_moe sit above it.
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from tbjax.model import quant as qz
from tbjax.model.params import param_shapes
from tbjax.spec import ModelSpec


class WeightLoadError(ValueError):
    """A weight file is unreadable, truncated, or disagrees with the model's config."""


# Logical names a source must serve. Matrices come as [out, in] (HF nn.Linear layout), vectors as [n].
# get(name, layer) -> np.ndarray, or None when the tensor is absent.
Getter = Callable[[str, int | None], "np.ndarray | None"]


def _need(get: Getter, name: str, layer: int | None, shape: tuple[int, ...], where: str) -> np.ndarray:
    t = get(name, layer)
    if t is None:
        raise WeightLoadError(f"{where}: missing tensor {name!r}" + (f" of layer {layer}" if layer is not None else ""))
    if tuple(t.shape) != tuple(shape):
        raise WeightLoadError(f"{where}: tensor {name!r}" + (f" of layer {layer}" if layer is not None else "")
                              + f" has shape {tuple(t.shape)} but the config implies {tuple(shape)}")
    return t


def _moe_mla_param(spec: ModelSpec, get: Getter, name: str, i: int, where: str) -> np.ndarray | None:
    """Tree parameter `name` of layer i ([in, out] matrices) for MoE / MLA parameters; None if not one of them.

    The logical source names (`mla.*`, `moe.*`) are mapped to checkpoint tensor names in hf_names_moe.py."""
    D = spec.d_model
    if spec.mla is not None:
        m = spec.mla
        N, dq = spec.n_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
        shapes = {"wq_a": ("mla.q_a", (m.q_lora_rank, D)), "wq_b": ("mla.q_b", (N * dq, m.q_lora_rank)),
                  "wq": ("mla.q", (N * dq, D)),
                  "wkv_a": ("mla.kv_a", (m.kv_lora_rank + m.qk_rope_head_dim, D)),
                  "wkv_b": ("mla.kv_b", (N * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)),
                  "w_o": ("mla.o", (D, N * m.v_head_dim))}
        if name in shapes:
            src, shp = shapes[name]
            return _need(get, src, i, shp, where).T
        if name == "q_a_norm":
            return _need(get, "mla.q_a_norm", i, (m.q_lora_rank,), where)
        if name == "kv_a_norm":
            return _need(get, "mla.kv_a_norm", i, (m.kv_lora_rank,), where)
    if spec.moe is not None:
        mo = spec.moe
        E, F, Fs = mo.n_experts, mo.expert_ffn_dim, mo.shared_ffn_dim
        if name == "router":
            return _need(get, "moe.router", i, (E, D), where).T
        if name == "router_bias":
            return _need(get, "moe.router_bias", i, (E,), where)
        if name in ("we_gate", "we_up", "we_down"):
            proj = name[len("we_"):]
            shp = (D, F) if proj == "down" else (F, D)
            return qz.stack([_need(get, f"moe.expert.{e}.{proj}", i, shp, where).T for e in range(E)])
        if name in ("ws_gate", "ws_up", "ws_down"):
            proj = name[len("ws_"):]
            shp = (D, Fs) if proj == "down" else (Fs, D)
            return _need(get, f"moe.shared.{proj}", i, shp, where).T
    return None


def _layer_param(spec: ModelSpec, get: Getter, name: str, i: int, where: str) -> np.ndarray:
    D, N, K, H, F = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.ffn_dim
    if spec.moe is not None or spec.mla is not None:
        t = _moe_mla_param(spec, get, name, i, where)
        if t is not None:
            return t
    if name == "attn_norm":
        return _need(get, "attn_norm", i, (D,), where)
    if name == "mlp_norm":
        return _need(get, "mlp_norm", i, (D,), where)
    if name in ("q_norm", "k_norm"):
        return _need(get, name, i, (H,), where)
    if name == "w_qkv":
        q = _need(get, "q", i, (N * H, D), where)
        k = _need(get, "k", i, (K * H, D), where)
        v = _need(get, "v", i, (K * H, D), where)
        return qz.concat([q, k, v], axis=0).T
    if name == "b_qkv":
        return np.concatenate([_need(get, "q_bias", i, (N * H,), where), _need(get, "k_bias", i, (K * H,), where),
                               _need(get, "v_bias", i, (K * H,), where)])
    if name == "w_o":
        return _need(get, "o", i, (D, N * H), where).T
    if name == "w_gate_up":
        return qz.stack([_need(get, "gate", i, (F, D), where).T, _need(get, "up", i, (F, D), where).T], axis=1)
    if name == "w_down":
        return _need(get, "down", i, (D, F), where).T
    raise WeightLoadError(f"{where}: no loader mapping for parameter {name!r} ({spec.arch})")


def _place(name: str, a, dtype, weight_dtype: str):
    """One stacked tree parameter on the device, in the resident format weight_dtype asks for (tbjax/model/quant.py):
    "auto" keeps a source tensor's quantization (HostQuant) and float tensors float; "bf16"/"float32" makes every
    tensor float; "int8"/"int4"/"fp8" converts every matrix (embedding and head too, except for fp8, where they
    stay float as in DeepSeek's checkpoints) to that format."""
    ax = qz.matrix_in_axis(name, a.ndim)
    if weight_dtype in qz.FORMATS and ax is not None and not (weight_dtype == "fp8" and name in ("embed", "lm_head")):
        h = qz.convert(a, weight_dtype, ax) if isinstance(a, qz.HostQuant) else qz.quantize(a, weight_dtype, ax)
        return h.to_device(dtype)
    if isinstance(a, qz.HostQuant):
        if weight_dtype == "auto" and ax is not None:
            return a.to_device(dtype)
        a = a.dequantize()
    return jnp.asarray(np.asarray(a, np.float32), dtype)


def assemble(spec: ModelSpec, get: Getter, dtype, where: str, progress: bool = True, weight_dtype: str = "bf16"):
    """Build the parameter tree from a Getter: float arrays of `dtype`, or QuantizedWeights computing in `dtype`
    where the getter serves quantized tensors (HostQuant) or weight_dtype asks for a format (see _place)."""
    dtype = jnp.dtype(dtype)
    weight_dtype = qz.check_weight_dtype(weight_dtype)
    shapes = param_shapes(spec, dtype)
    V, D = spec.vocab_size, spec.d_model
    total = 2 + (0 if spec.tie_embeddings else 1) + sum(len(v) for v in shapes["groups"].values())
    bar = tqdm(total=total, desc=f"loading {where.split('/')[-1]}", disable=not progress, unit="tensor")

    def put(name, a):
        bar.update(1)
        return _place(name, a, dtype, weight_dtype)

    params = {"embed": put("embed", _need(get, "embed", None, (V, D), where)),
              "final_norm": put("final_norm", _need(get, "final_norm", None, (D,), where))}
    if not spec.tie_embeddings:
        params["lm_head"] = put("lm_head", _need(get, "lm_head", None, (V, D), where).T)
    groups = {}
    for g in spec.layer_groups:
        gp = {}
        for name, shp in shapes["groups"][g.name].items():
            stacked = qz.stack([_layer_param(spec, get, name, i, where) for i in g.layers])
            assert stacked.shape == shp.shape, (name, stacked.shape, shp.shape)
            gp[name] = put(name, stacked)
        groups[g.name] = gp
    params["groups"] = groups
    bar.close()
    return params
