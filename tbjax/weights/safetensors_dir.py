"""Hugging Face model directories: config.json + *.safetensors (sharded or not), loaded with `safetensors`."""
from __future__ import annotations

import glob
import json
import os

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


class SafetensorsDir:
    """A directory with config.json and safetensors shards. Tensors are read lazily by name."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = os.fspath(path)
        files = sorted(glob.glob(os.path.join(self.path, "*.safetensors")))
        if not files:
            raise WeightLoadError(f"no *.safetensors files in {self.path}")
        self._where: dict[str, object] = {}
        for f in files:
            try:
                h = safe_open(f, framework="numpy")
            except Exception as e:
                raise WeightLoadError(f"{f}: not a readable safetensors file (truncated or corrupt?): {e}") from None
            for k in h.keys():
                self._where[k] = h
        self.names = set(self._where)

    def spec(self) -> ModelSpec:
        return ModelSpec.from_hf_config(self.path)

    def raw(self, name: str) -> np.ndarray | None:
        h = self._where.get(name)
        if h is None:
            return None
        try:
            t = h.get_tensor(name)
        except Exception as e:
            raise WeightLoadError(f"{self.path}: cannot read tensor {name}: {e}") from None
        return np.asarray(t)

    def load(self, spec: ModelSpec | None = None, dtype=None, progress: bool = True):
        spec = spec or self.spec()

        def get(name, layer):
            key = HF_NAMES.get(name)
            if key is None:
                return None
            t = self.raw(key.format(i=layer))
            if t is None and name == "lm_head" and spec.tie_embeddings:
                return None
            return None if t is None else t.astype(np.float32)

        return spec, assemble(spec, get, dtype or spec.dtype, self.path, progress)


def write_config(path: str, config: dict):
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
