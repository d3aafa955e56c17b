"""Turn per-layer checkpoint tensors into tbjax's stacked parameter tree, checking every shape against the spec.

Loaders (GGUF, safetensors) only know how to fetch one named tensor in Hugging Face orientation ([out, in]);
this module owns the mapping to the tree layout (stacked per layer group, [in, out] matrices, fused QKV, gate and
up as one [in, 2, out] matrix).
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

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


def _layer_param(spec: ModelSpec, get: Getter, name: str, i: int, where: str) -> np.ndarray:
    D, N, K, H, F = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.ffn_dim
    if spec.moe is not None or spec.mla is not None:   # MoE / MLA parameters: tbjax/weights/hf_names_moe.py
        from tbjax.weights.hf_names_moe import layer_param as _moe_mla_param
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
        return np.concatenate([q, k, v], axis=0).T
    if name == "b_qkv":
        return np.concatenate([_need(get, "q_bias", i, (N * H,), where), _need(get, "k_bias", i, (K * H,), where),
                               _need(get, "v_bias", i, (K * H,), where)])
    if name == "w_o":
        return _need(get, "o", i, (D, N * H), where).T
    if name == "w_gate_up":
        return np.stack([_need(get, "gate", i, (F, D), where).T, _need(get, "up", i, (F, D), where).T], axis=1)
    if name == "w_down":
        return _need(get, "down", i, (D, F), where).T
    raise WeightLoadError(f"{where}: no loader mapping for parameter {name!r} ({spec.arch})")


def assemble(spec: ModelSpec, get: Getter, dtype, where: str, progress: bool = True):
    """Build the parameter tree (jax arrays of `dtype`) from a Getter."""
    dtype = jnp.dtype(dtype)
    shapes = param_shapes(spec, dtype)
    V, D = spec.vocab_size, spec.d_model
    total = 2 + (0 if spec.tie_embeddings else 1) + sum(len(v) for v in shapes["groups"].values())
    bar = tqdm(total=total, desc=f"loading {where.split('/')[-1]}", disable=not progress, unit="tensor")

    def put(a):
        bar.update(1)
        return jnp.asarray(np.asarray(a, np.float32), dtype)

    params = {"embed": put(_need(get, "embed", None, (V, D), where)),
              "final_norm": put(_need(get, "final_norm", None, (D,), where))}
    if not spec.tie_embeddings:
        params["lm_head"] = put(_need(get, "lm_head", None, (V, D), where).T)
    groups = {}
    for g in spec.layer_groups:
        gp = {}
        for name, shp in shapes["groups"][g.name].items():
            stacked = np.stack([_layer_param(spec, get, name, i, where) for i in g.layers])
            assert stacked.shape == shp.shape, (name, stacked.shape, shp.shape)
            gp[name] = put(stacked)
        groups[g.name] = gp
    params["groups"] = groups
    bar.close()
    return params
