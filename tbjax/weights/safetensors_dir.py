"""Hugging Face model directories: config.json + *.safetensors (sharded or not).

One reader serves every safetensors loader (this dense one and hf_names_moe's MoE / MLA / fp8 one): `safetensors`'
own numpy reader cannot return float8 tensors, so tensors are read from the files directly (header JSON + raw bytes,
through numpy memmaps).
"""
from __future__ import annotations

import glob
import json
import os
import struct

import ml_dtypes
import numpy as np

from tbjax.spec import ModelSpec
from tbjax.weights.assemble import WeightLoadError, assemble

HF_NAMES = {
    "embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight", "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight", "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight", "o": "model.layers.{i}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias", "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight", "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight", "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class SafetensorsIndex:
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


class SafetensorsDir:
    """A directory with config.json and safetensors shards. Tensors are read lazily by name."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.index = SafetensorsIndex(self.path)
        self.names = set(self.index.where)

    def spec(self) -> ModelSpec:
        return ModelSpec.from_hf_config(self.path)

    def raw(self, name: str) -> np.ndarray | None:
        return self.index.read(name)

    def load(self, spec: ModelSpec | None = None, dtype=None, progress: bool = True, weight_dtype: str = "bf16"):
        """(spec, params); weight_dtype "int8"/"int4"/"fp8" quantizes every matrix at load (tbjax/model/quant.py),
        "auto"/"bf16"/"float32" keep float weights."""
        spec = spec or self.spec()

        def get(name, layer):
            key = HF_NAMES.get(name)
            if key is None:
                return None
            t = self.raw(key.format(i=layer))
            if t is None and name == "lm_head" and spec.tie_embeddings:
                return None
            return None if t is None else t.astype(np.float32)

        return spec, assemble(spec, get, dtype or spec.dtype, self.path, progress, weight_dtype=weight_dtype)
