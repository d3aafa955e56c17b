"""GGUF loading through the `gguf` package: metadata -> ModelSpec, tensors dequantized to the target dtype.

llama.cpp stores the q/k projection rows of llama-family models permuted for its interleaved ("GPT-J") RoPE;
tbjax uses the Hugging Face rotate-half RoPE, so those rows are permuted back here (the inverse of the
permutation llama.cpp's converter applies). Qwen2/3 GGUFs are not permuted.
"""
from __future__ import annotations

import os

import numpy as np

from tbjax.spec import ModelSpec, SpecError
from tbjax.weights.assemble import WeightLoadError, assemble

_GGUF_NAMES = {
    "embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight", "mlp_norm": "blk.{i}.ffn_norm.weight",
    "q": "blk.{i}.attn_q.weight", "k": "blk.{i}.attn_k.weight", "v": "blk.{i}.attn_v.weight",
    "o": "blk.{i}.attn_output.weight", "q_bias": "blk.{i}.attn_q.bias", "k_bias": "blk.{i}.attn_k.bias",
    "v_bias": "blk.{i}.attn_v.bias", "q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight", "up": "blk.{i}.ffn_up.weight", "down": "blk.{i}.ffn_down.weight",
}
_PERMUTED_ARCHS = {"llama", "mistral"}


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows (pairs interleaved) -> (first halves, second halves)."""
    out_dim = w.shape[0]
    hd = out_dim // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    def __init__(self, path: str | os.PathLike):
        import gguf

        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise WeightLoadError(f"no GGUF file at {self.path}")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the gguf package raises ValueError/struct errors/IndexError on bad files
            raise WeightLoadError(f"{self.path}: not a readable GGUF file (truncated or corrupt?): "
                                  f"{type(e).__name__}: {e}") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:
            need = int(t.n_bytes)
            if t.data.nbytes != need:
                raise WeightLoadError(f"{self.path}: tensor {t.name} holds {t.data.nbytes} bytes, expected {need} "
                                      "(file truncated or corrupt)")

    def metadata(self) -> dict:
        meta = {}
        for k, f in self.reader.fields.items():
            if k.startswith("GGUF."):
                continue
            try:
                meta[k] = f.contents()
            except Exception as e:
                raise WeightLoadError(f"{self.path}: unreadable metadata field {k!r}: {e}") from None
        meta["_tbjax.tied_embeddings"] = "output.weight" not in self.tensors
        return meta

    def spec(self) -> ModelSpec:
        try:
            return ModelSpec.from_gguf_metadata(self.metadata())
        except SpecError as e:
            raise type(e)(f"{self.path}: {e}") from None

    def tensor(self, name: str) -> np.ndarray | None:
        import gguf

        t = self.tensors.get(name)
        if t is None:
            return None
        try:
            a = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise WeightLoadError(f"{self.path}: cannot dequantize {name} ({t.tensor_type.name}): {e}") from None
        return np.asarray(a, np.float32).reshape([int(x) for x in reversed(t.shape)])

    def load(self, spec: ModelSpec | None = None, dtype=None, progress: bool = True):
        """Returns (spec, params). A given spec is checked against the file's tensors."""
        spec = spec or self.spec()
        permute = spec.arch in _PERMUTED_ARCHS

        def get(name, layer):
            key = _GGUF_NAMES.get(name)
            if key is None:
                return None
            t = self.tensor(key.format(i=layer))
            if t is not None and permute and name in ("q", "k"):
                n = spec.n_heads if name == "q" else spec.n_kv_heads
                if t.shape[0] % n or (t.shape[0] // n) % 2:
                    raise WeightLoadError(f"{self.path}: {key.format(i=layer)} has {t.shape[0]} rows, "
                                          f"not divisible into {n} heads of even size")
                t = unpermute_rows(t, n)
            return t

        return spec, assemble(spec, get, dtype or spec.dtype, self.path, progress)
