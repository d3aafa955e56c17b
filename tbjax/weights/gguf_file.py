"""GGUF loading through the `gguf` package: metadata -> ModelSpec; tensors either kept in their quantization
(converted exactly into tbjax's int8 / int4 on-device formats, tbjax/model/quant.py) or dequantized to a float dtype.

Which formats convert exactly (codes, scales and zeros read from the blocks; tests compare the result with
`gguf.quants.dequantize`): Q8_0 -> int8 in groups of 32 (float16 scales), Q6_K -> int8 in groups of 16 (float32
scales d * sc), Q4_0 -> int4 (scale d, zero -8 d), Q4_1 -> int4 (scale d, zero m), Q4_K -> int4 (scale d * sc,
zero -dmin * m), all groups of 32 along the input axis. Other quantizations are dequantized through `gguf`.

llama.cpp stores the q/k projection rows of llama-family models permuted for its interleaved ("GPT-J") RoPE;
tbjax uses the Hugging Face rotate-half RoPE, so those rows are permuted back here (the inverse of the
permutation llama.cpp's converter applies). Qwen2/3 GGUFs are not permuted.
"""
from __future__ import annotations

import os

import numpy as np

from tbjax.model.quant import HostQuant
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


def _blocks(t, block_bytes: int) -> np.ndarray:
    """A quantized tensor's raw bytes as [out rows, blocks per row, block bytes]."""
    rows = int(np.prod([int(x) for x in t.shape[1:]]))
    return np.asarray(t.data, np.uint8).reshape(rows, -1, block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """ggml's nibble order: in each run of group/2 bytes, low nibbles are elements 0..group/2-1, high the rest."""
    lo, hi = qs & 15, qs >> 4
    n = qs.shape[:-1]
    return np.stack([lo.reshape(*n, -1, group // 2), hi.reshape(*n, -1, group // 2)], axis=-2).reshape(*n, -1)


def host_quant(t) -> "HostQuant | None":
    """The tensor's own codes and scales in HF orientation [out, in] (groups along `in`), or None when its type has
    no exact tbjax format."""
    name = t.tensor_type.name
    if name == "Q8_0":
        b = _blocks(t, 34)
        scale, codes = _f16(b[..., :2]), b[..., 2:].view(np.int8)
        return HostQuant(codes.reshape(b.shape[0], -1), scale, None, "int8", (1, 32))
    if name in ("Q4_0", "Q4_1"):
        b = _blocks(t, 18 if name == "Q4_0" else 20)
        d = _f16(b[..., :2])
        zero = (-8 * d).astype(np.float16) if name == "Q4_0" else _f16(b[..., 2:4])
        codes = _nibbles(b[..., 2:] if name == "Q4_0" else b[..., 4:], 32)
        return HostQuant(codes.reshape(b.shape[0], -1), d, zero, "int4", (1, 32))
    if name == "Q4_K":
        import gguf
        b = _blocks(t, 144)
        rows, nb = b.shape[:2]
        d, dmin = _f16(b[..., 0:2]).astype(np.float32), _f16(b[..., 2:4]).astype(np.float32)
        sc, m = gguf.quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        sc, m = sc.reshape(rows, nb, 8).astype(np.float32), m.reshape(rows, nb, 8).astype(np.float32)
        qs = b[..., 16:].reshape(rows, nb, 4, 32)
        codes = np.stack([qs & 15, qs >> 4], axis=-2).reshape(rows, -1)      # sub-block 2j low, 2j+1 high nibbles
        scale = (d[..., None] * sc).reshape(rows, -1)
        zero = -(dmin[..., None] * m).reshape(rows, -1)
        return HostQuant(codes, scale, zero, "int4", (1, 32))
    if name == "Q6_K":
        b = _blocks(t, 210)
        rows, nb = b.shape[:2]
        ql, qh, scales = b[..., :128], b[..., 128:192], b[..., 192:208].view(np.int8)
        d = _f16(b[..., 208:210]).astype(np.float32)
        ql = ql.reshape(rows, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        ql = (ql & 15).reshape(rows, nb, 8, 32)
        qh = qh.reshape(rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
        qh = (qh & 3).reshape(rows, nb, 8, 32)
        codes = ((ql | (qh << 4)).astype(np.int8) - np.int8(32)).reshape(rows, -1)
        scale = (d[..., None] * scales.astype(np.float32)).reshape(rows, -1)
        return HostQuant(codes, scale, None, "int8", (1, 16))
    return None


class GGUFFile:
    """One GGUF file: its metadata and tensor table, parsed by `gguf.GGUFReader` once and then read from the saved
    index (tbjax/weights/gguf_index.py) while the file is unchanged."""

    def __init__(self, path: str | os.PathLike):
        from tbjax.weights import gguf_index

        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise WeightLoadError(f"no GGUF file at {self.path}")
        cached = gguf_index.load(self.path)
        if cached is not None:
            self._meta, tensors = cached
        else:
            self._meta, tensors = self._parse()
        self.tensors = {t.name: t for t in tensors}
        for t in tensors:
            need = int(t.n_bytes)
            if t.data.nbytes != need:
                raise WeightLoadError(f"{self.path}: tensor {t.name} holds {t.data.nbytes} bytes, expected {need} "
                                      "(file truncated or corrupt)")
        if cached is None:
            gguf_index.save(self.path, self._meta, tensors)

    def _parse(self):
        import gguf

        try:
            reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the gguf package raises ValueError/struct errors/IndexError on bad files
            raise WeightLoadError(f"{self.path}: not a readable GGUF file (truncated or corrupt?): "
                                  f"{type(e).__name__}: {e}") from None
        meta = {}
        for k, f in reader.fields.items():
            if k.startswith("GGUF."):
                continue
            try:
                meta[k] = f.contents()
            except Exception as e:
                raise WeightLoadError(f"{self.path}: unreadable metadata field {k!r}: {e}") from None
        return meta, list(reader.tensors)

    def metadata(self) -> dict:
        meta = dict(self._meta)
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

    def quantized(self, name: str):
        """The tensor in its own quantization (HostQuant, [out, in]) when it has an exact tbjax format, else its
        float32 values; None when absent."""
        t = self.tensors.get(name)
        if t is None:
            return None
        h = host_quant(t) if len(t.shape) == 2 else None
        if h is not None:
            shape = tuple(int(x) for x in reversed(t.shape))
            if h.shape != shape:
                raise WeightLoadError(f"{self.path}: {name} decodes to {h.shape}, expected {shape}")
            return h
        return self.tensor(name)

    def load(self, spec: ModelSpec | None = None, dtype=None, progress: bool = True, weight_dtype: str = "bf16"):
        """Returns (spec, params). A given spec is checked against the file's tensors. weight_dtype (tbjax/model/
        quant.py): "auto" keeps each matrix's quantization where it converts exactly (float tensors stay float),
        "bf16"/"float32" dequantizes every tensor, "int8"/"int4"/"fp8" converts every matrix to that format."""
        spec = spec or self.spec()
        permute = spec.arch in _PERMUTED_ARCHS
        keep = weight_dtype not in ("bf16", "float32")

        def get(name, layer):
            key = _GGUF_NAMES.get(name)
            if key is None:
                return None
            t = self.quantized(key.format(i=layer)) if keep else self.tensor(key.format(i=layer))
            if t is not None and permute and name in ("q", "k"):
                n = spec.n_heads if name == "q" else spec.n_kv_heads
                if t.shape[0] % n or (t.shape[0] // n) % 2:
                    raise WeightLoadError(f"{self.path}: {key.format(i=layer)} has {t.shape[0]} rows, "
                                          f"not divisible into {n} heads of even size")
                t = t.take(unpermute_rows(np.arange(t.shape[0]), n)) if isinstance(t, HostQuant) else \
                    unpermute_rows(t, n)
            return t

        return spec, assemble(spec, get, dtype or spec.dtype, self.path, progress, weight_dtype=weight_dtype)
