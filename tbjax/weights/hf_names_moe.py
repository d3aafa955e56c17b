"""Hugging Face tensor names of MoE and MLA checkpoints (Mixtral, Qwen3-MoE, DeepSeek-V3, Kimi-K2), and DeepSeek's
fp8 block-scaled weights (`weight_scale_inv`), mapped onto tbjax's parameter tree.

Why: the dense loader (safetensors_dir.py) knows llama-style names; MoE and MLA checkpoints add routers, correction
biases, per-expert matrices, shared experts and latent-attention projections, and DeepSeek stores most matrices as
float8_e4m3fn with one float32 scale per 128x128 block. `assemble.py` hands every parameter name it does not own
to `layer_param` here.

fp8: a weight W [out, in] stored as q (e4m3) with `weight_scale_inv` s [ceil(out/bo), ceil(in/bi)]
(`quantization_config.weight_block_size` = [bo, bi]) means W = q * s of its block (DeepSeek's `weight_dequant`).
We dequantize in float32 and record s, transposed to the tree's [in, out] orientation, so DP attention can ship
the weights in fp8 again without loss (sharding/packed.py, encoding "fp8_block").
safetensors' numpy reader cannot return float8 tensors, so tensors are read here from the files directly
(header JSON + raw bytes, through numpy memmaps).
"""
from __future__ import annotations

import glob
import json
import os
import struct

import ml_dtypes
import numpy as np

from tbjax.spec import ModelSpec
from tbjax.weights.assemble import WeightLoadError, _need, assemble
from tbjax.weights.safetensors_dir import HF_NAMES

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}

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


class _Index:
    """Tensor name -> (file, dtype, shape, byte offsets) for every *.safetensors file of a directory."""

    def __init__(self, path: str):
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise WeightLoadError(f"no *.safetensors files in {path}")
        self.where: dict[str, tuple] = {}
        for f in files:
            try:
                with open(f, "rb") as fh:
                    n = struct.unpack("<Q", fh.read(8))[0]
                    header = json.loads(fh.read(n))
            except Exception as e:
                raise WeightLoadError(f"{f}: not a readable safetensors file (truncated or corrupt?): {e}") from None
            size = os.path.getsize(f)
            for k, v in header.items():
                if k == "__metadata__":
                    continue
                b, e = v["data_offsets"]
                if 8 + n + e > size:
                    raise WeightLoadError(f"{f}: tensor {k} extends past the end of the file (truncated?)")
                self.where[k] = (f, v["dtype"], tuple(v["shape"]), 8 + n + b, e - b)

    def read(self, key: str) -> np.ndarray | None:
        w = self.where.get(key)
        if w is None:
            return None
        f, dt, shape, off, nbytes = w
        if dt not in _ST_DTYPES:
            raise WeightLoadError(f"{f}: tensor {key} has unsupported dtype {dt}")
        npdt = np.dtype(_ST_DTYPES[dt])
        if nbytes != int(np.prod(shape, dtype=np.int64)) * npdt.itemsize:
            raise WeightLoadError(f"{f}: tensor {key} holds {nbytes} bytes, shape {shape} x {dt} needs "
                                  f"{int(np.prod(shape)) * npdt.itemsize}")
        return np.array(np.memmap(f, dtype=npdt, mode="r", offset=off, shape=shape))


class HFGetter:
    """Getter (logical name, layer) -> float32 array in HF orientation, dequantizing fp8 block-scaled weights.

    `scales[(name, layer)]` keeps each fp8 weight's `weight_scale_inv` (HF orientation [out_blocks, in_blocks])."""

    def __init__(self, path: str, spec: ModelSpec, block_out_in: tuple[int, int] = (128, 128)):
        self.path, self.spec, self.block = path, spec, tuple(block_out_in)
        self.index = _Index(path)
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
            return block_dequant(t, s, self.block)
        return t.astype(np.float32)


def layer_param(spec: ModelSpec, get, name: str, i: int, where: str) -> np.ndarray | None:
    """Tree parameter `name` of layer i ([in, out] matrices) for MoE / MLA parameters; None if not one of them."""
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
        if name in _EXPERT_SOURCES:
            proj = name[len("we_"):]
            shp = (D, F) if proj == "down" else (F, D)
            return np.stack([_need(get, f"moe.expert.{e}.{proj}", i, shp, where).T for e in range(E)])
        if name in ("ws_gate", "ws_up", "ws_down"):
            proj = name[len("ws_"):]
            shp = (D, Fs) if proj == "down" else (Fs, D)
            return _need(get, f"moe.shared.{proj}", i, shp, where).T
    return None


def quant_block(config: dict) -> tuple[int, int] | None:
    """`quantization_config.weight_block_size` ([out, in]) of an fp8 checkpoint, else None."""
    q = config.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return None
    b = q.get("weight_block_size")
    if not (isinstance(b, (list, tuple)) and len(b) == 2):
        raise WeightLoadError(f"fp8 quantization_config without a 2-entry weight_block_size: {q}")
    return int(b[0]), int(b[1])


def load_hf(path: str | os.PathLike, dtype=None, progress: bool = False):
    """Load a HF MoE / MLA (or dense) safetensors directory. Returns (spec, params, fp8_scales).

    fp8 weights are dequantized (float32 math) to `dtype`. fp8_scales is None for non-fp8 checkpoints, else
    {"block": (rows, cols) in the tree's [in, out] orientation, "groups": {group: {param: float32 [L, rb, cb]}}}
    for every matrix parameter stored as fp8 (experts: [L, E, rb, cb])."""
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    spec = ModelSpec.from_hf_config(config)
    block = quant_block(config) or (128, 128)
    get = HFGetter(path, spec, block)
    params = assemble(spec, get, dtype or spec.dtype, path, progress)
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
