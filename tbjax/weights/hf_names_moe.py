"""Hugging Face tensor names of MoE and MLA checkpoints (Mixtral, Qwen3-MoE, DeepSeek-V3, Kimi-K2), and DeepSeek's
fp8 block-scaled weights (`weight_scale_inv`), mapped onto tbjax's parameter tree.

Why: the dense loader (safetensors_dir.py) knows llama-style names; MoE and MLA checkpoints add routers, correction
biases, per-expert matrices, shared experts and latent-attention projections, and DeepSeek stores most matrices as
float8_e4m3fn with one float32 scale per 128x128 block. `assemble.py` maps the logical names (`mla.*`, `moe.*`)
onto the tree; this module maps them onto checkpoint tensor names.

fp8: a weight W [out, in] stored as q (e4m3) with `weight_scale_inv` s [ceil(out/bo), ceil(in/bi)]
(`quantization_config.weight_block_size` = [bo, bi]) means W = q * s of its block (DeepSeek's `weight_dequant`).
We dequantize in float32 and record s, transposed to the tree's [in, out] orientation, so DP attention can ship
the weights in fp8 again without loss (sharding/packed.py, encoding "fp8_block").
Tensors are read through safetensors_dir.SafetensorsIndex, which also returns float8 tensors.
"""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from tbjax.model.quant import HostQuant, check_weight_dtype
from tbjax.spec import ModelSpec
from tbjax.weights.assemble import WeightLoadError, assemble
from tbjax.weights.safetensors_dir import HF_NAMES, SafetensorsIndex

# Names the dense loader already knows.
BASE_NAMES = HF_NAMES
MLA_NAMES = {
    "mla.q_a": "model.layers.{i}.self_attn.q_a_proj.weight",
    "mla.q_a_norm": "model.layers.{i}.self_attn.q_a_layernorm.weight",
    "mla.q_b": "model.layers.{i}.self_attn.q_b_proj.weight",
    "mla.q": "model.layers.{i}.self_attn.q_proj.weight",
    "mla.kv_a": "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",
    "mla.kv_a_norm": "model.layers.{i}.self_attn.kv_a_layernorm.weight",
    "mla.kv_b": "model.layers.{i}.self_attn.kv_b_proj.weight",
    "mla.o": "model.layers.{i}.self_attn.o_proj.weight",
}
_MIXTRAL = {
    "moe.router": "model.layers.{i}.block_sparse_moe.gate.weight",
    "moe.expert.gate": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    "moe.expert.up": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
    "moe.expert.down": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
}
_MLP_MOE = {
    "moe.router": "model.layers.{i}.mlp.gate.weight",
    "moe.router_bias": "model.layers.{i}.mlp.gate.e_score_correction_bias",
    "moe.expert.gate": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "moe.expert.up": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    "moe.expert.down": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
    "moe.shared.gate": "model.layers.{i}.mlp.shared_experts.gate_proj.weight",
    "moe.shared.up": "model.layers.{i}.mlp.shared_experts.up_proj.weight",
    "moe.shared.down": "model.layers.{i}.mlp.shared_experts.down_proj.weight",
}
MOE_NAMES = {"mixtral": _MIXTRAL, "qwen3_moe": _MLP_MOE, "deepseek_v3": _MLP_MOE, "kimi_k2": _MLP_MOE}

# tree parameter -> logical source name (single source, transposed): the matrices that can carry fp8 scales.
_MLA_SOURCES = {"wq_a": "mla.q_a", "wq_b": "mla.q_b", "wq": "mla.q", "wkv_a": "mla.kv_a", "wkv_b": "mla.kv_b",
                "w_o": "mla.o"}
_FFN_SOURCES = {"w_gate": "gate", "w_up": "up", "w_down": "down", "ws_gate": "moe.shared.gate",
                "ws_up": "moe.shared.up", "ws_down": "moe.shared.down"}
_EXPERT_SOURCES = {"we_gate": "moe.expert.gate", "we_up": "moe.expert.up", "we_down": "moe.expert.down"}


def hf_key(arch: str, name: str, layer: int | None) -> str | None:
    """Logical name (plus layer) -> HF tensor name, or None. Experts: 'moe.expert.<e>.<gate|up|down>'."""
    if name.startswith("moe.expert."):
        _, _, e, proj = name.split(".")
        t = MOE_NAMES.get(arch, {}).get(f"moe.expert.{proj}")
        return None if t is None else t.format(i=layer, e=int(e))
    t = MLA_NAMES.get(name) or MOE_NAMES.get(arch, {}).get(name) or BASE_NAMES.get(name)
    return None if t is None else t.format(i=layer)


def block_dequant(q, scale_inv, block_out_in: tuple[int, int]) -> np.ndarray:
    """float32 W [out, in] = q * scale_inv of its (bo x bi) block; partial edge blocks use their block's scale."""
    o, i = q.shape
    bo, bi = block_out_in
    need = (-(-o // bo), -(-i // bi))
    if tuple(scale_inv.shape) != need:
        raise WeightLoadError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, but a {o}x{i} weight in "
                              f"{bo}x{bi} blocks needs {need}")
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bo, axis=0), bi, axis=1)[:o, :i]
    return np.asarray(q, np.float32) * s


class HFGetter:
    """Getter (logical name, layer) -> float32 array in HF orientation, dequantizing fp8 block-scaled weights, or
    (keep_fp8) the fp8 codes and their scales as they are (HostQuant, fp8 format, blocks [bo, bi]).

    `scales[(name, layer)]` keeps each fp8 weight's `weight_scale_inv` (HF orientation [out_blocks, in_blocks])."""

    def __init__(self, path: str, spec: ModelSpec, block_out_in: tuple[int, int] = (128, 128), keep_fp8=False):
        self.path, self.spec, self.block, self.keep_fp8 = path, spec, tuple(block_out_in), keep_fp8
        self.index = SafetensorsIndex(path)
        self.scales: dict[tuple[str, int | None], np.ndarray] = {}

    def __call__(self, name: str, layer: int | None):
        key = hf_key(self.spec.arch, name, layer)
        if key is None:
            return None
        t = self.index.read(key)
        if t is None:
            return None
        if t.dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
            skey = key[: -len(".weight")] + ".weight_scale_inv" if key.endswith(".weight") else key + "_scale_inv"
            s = self.index.read(skey)
            if s is None:
                raise WeightLoadError(f"{self.path}: {key} is {t.dtype} but {skey} (its block scales) is missing")
            self.scales[(name, layer)] = np.asarray(s, np.float32)
            if self.keep_fp8 and t.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
                need = tuple(-(-n // b) for n, b in zip(t.shape, self.block))
                if tuple(s.shape) != need:
                    raise WeightLoadError(f"{self.path}: {skey} has shape {tuple(s.shape)}, but a {t.shape[0]}x"
                                          f"{t.shape[1]} weight in {self.block[0]}x{self.block[1]} blocks needs {need}")
                return HostQuant(np.asarray(t), np.asarray(s, np.float32), None, "fp8", self.block)
            return block_dequant(t, s, self.block)
        return t.astype(np.float32)


def quant_block(config: dict) -> tuple[int, int] | None:
    """`quantization_config.weight_block_size` ([out, in]) of an fp8 checkpoint, else None."""
    q = config.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return None
    b = q.get("weight_block_size")
    if not (isinstance(b, (list, tuple)) and len(b) == 2):
        raise WeightLoadError(f"fp8 quantization_config without a 2-entry weight_block_size: {q}")
    return int(b[0]), int(b[1])


def load_hf(path: str | os.PathLike, dtype=None, progress: bool = False, weight_dtype: str = "bf16"):
    """Load a HF MoE / MLA (or dense) safetensors directory. Returns (spec, params, fp8_scales).

    weight_dtype "auto" (or "fp8") keeps fp8 block-scaled matrices resident as fp8 QuantizedWeights (codes and
    `weight_scale_inv`, blocks transposed to the tree's [in, out]); "bf16"/"float32" dequantize them (float32
    math) to `dtype`; "int8"/"int4" quantize every matrix. fp8_scales is None for non-fp8 checkpoints, else
    {"block": (rows, cols) in the tree's [in, out] orientation, "groups": {group: {param: float32 [L, rb, cb]}}}
    for every matrix parameter stored as fp8 (experts: [L, E, rb, cb])."""
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    spec = ModelSpec.from_hf_config(config)
    block = quant_block(config) or (128, 128)
    weight_dtype = check_weight_dtype(weight_dtype)
    get = HFGetter(path, spec, block, keep_fp8=weight_dtype in ("auto", "fp8"))
    params = assemble(spec, get, dtype or spec.dtype, path, progress, weight_dtype=weight_dtype)
    return spec, params, collect_scales(spec, get) if get.scales else None


def collect_scales(spec: ModelSpec, get: HFGetter):
    """The fp8 scales the getter saw, arranged like the parameter tree (transposed to [in, out] blocks)."""
    out = {}
    for g in spec.layer_groups:
        gs = {}
        names = list(_MLA_SOURCES.items()) + list(_FFN_SOURCES.items())
        for pname, src in names:
            ss = [get.scales.get((src, i)) for i in g.layers]
            if all(s is not None for s in ss):
                gs[pname] = np.stack([s.T for s in ss])
        if spec.moe is not None:
            for pname, src in _EXPERT_SOURCES.items():
                proj = src.rsplit(".", 1)[1]
                ss = [[get.scales.get((f"moe.expert.{e}.{proj}", i)) for e in range(spec.moe.n_experts)]
                      for i in g.layers]
                if all(s is not None for row in ss for s in row):
                    gs[pname] = np.stack([np.stack([s.T for s in row]) for row in ss])
        if gs:
            out[g.name] = gs
    bo, bi = get.block
    return {"block": (bi, bo), "groups": out}
