"""ModelSpec: the one description of a model, parsed from a Hugging Face config.json or GGUF metadata.

Models are assembled from the spec, never hard-coded per checkpoint. A new architecture is a new layer kind
plus a mapping in this file. The spec is hashable (frozen dataclasses) so it can be a static jit argument.

Layer kinds
  attention: "gqa" (llama/mistral/qwen2/qwen3; covers MHA and MQA) or "mla" (DeepSeek latent attention)
  ffn:       "dense" (SwiGLU) or "moe" (routed experts, optional shared experts)
Layers of one (attention, ffn) kind are stacked; `layer_groups` says which layer index lives where.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

from pallas_kernels.utils import is_int


class SpecError(ValueError):
    """A config cannot be turned into a ModelSpec (unknown architecture, missing or contradictory field)."""


class UnsupportedArchitecture(SpecError):
    pass


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    theta: float
    rotary_dim: int                      # dims of each head that are rotated (rotate-half convention)
    scaling: str | None = None           # None | "llama3" | "linear" | "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # yarn (DeepSeek-V3)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class MoESpec:
    n_experts: int
    top_k: int
    expert_ffn_dim: int
    n_shared_experts: int = 0
    shared_ffn_dim: int = 0
    router: str = "softmax"              # "softmax" | "sigmoid"
    norm_topk_prob: bool = True
    n_group: int = 1                     # DeepSeek group-limited routing
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False        # DeepSeek's e_score_correction_bias (noaux_tc)


@dataclasses.dataclass(frozen=True)
class MLASpec:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers sharing one kind; their weights are stacked on a leading axis of len(layers)."""
    name: str
    attention: str                       # "gqa" | "mla"
    ffn: str                             # "dense" | "moe"
    layers: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope: RopeSpec
    max_position: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()   # layers that use the window (all layers when it is set, by default)
    activation: str = "silu"
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    first_dense_layers: int = 0
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quant: str | None = None             # e.g. "fp8_block128" for DeepSeek-style checkpoints

    # ---- derived -------------------------------------------------------------------------------------------
    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    def layer_kind(self, i: int) -> tuple[str, str]:
        attn = "mla" if self.mla is not None else "gqa"
        ffn = "moe" if (self.moe is not None and i >= self.first_dense_layers) else "dense"
        return attn, ffn

    @property
    def layer_groups(self) -> tuple[LayerGroup, ...]:
        groups: dict[tuple[str, str], list[int]] = {}
        for i in range(self.n_layers):
            groups.setdefault(self.layer_kind(i), []).append(i)
        return tuple(LayerGroup(f"{a}_{f}", a, f, tuple(ls)) for (a, f), ls in groups.items())

    def layer_window(self, i: int) -> int | None:
        if self.sliding_window is None:
            return None
        return self.sliding_window if i in self.sliding_window_layers else None

    @property
    def kv_heads_cached(self) -> int:
        return 1 if self.mla is not None else self.n_kv_heads

    def validate(self) -> "ModelSpec":
        pos = dict(vocab_size=self.vocab_size, d_model=self.d_model, n_layers=self.n_layers,
                   n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                   ffn_dim=self.ffn_dim, max_position=self.max_position)
        for k, v in pos.items():
            if not is_int(v) or v <= 0:
                raise SpecError(f"{self.arch}: {k} must be a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise SpecError(f"{self.arch}: num_attention_heads={self.n_heads} is not a multiple of "
                            f"num_key_value_heads={self.n_kv_heads}")
        if self.rope.rotary_dim > self.head_dim or self.rope.rotary_dim % 2:
            raise SpecError(f"{self.arch}: rotary dim {self.rope.rotary_dim} must be even and <= head_dim {self.head_dim}")
        if self.moe is not None and not (0 < self.moe.top_k <= self.moe.n_experts):
            raise SpecError(f"{self.arch}: num_experts_per_tok={self.moe.top_k} must be in 1..{self.moe.n_experts}")
        if self.moe is not None and self.moe.n_experts % self.moe.n_group:
            raise SpecError(f"{self.arch}: n_routed_experts={self.moe.n_experts} not divisible by n_group={self.moe.n_group}")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise SpecError(f"{self.arch}: unsupported dtype {self.dtype!r}")
        return self

    def replace(self, **kw) -> "ModelSpec":
        return dataclasses.replace(self, **kw).validate()

    # ---- constructors --------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike) -> "ModelSpec":
        if not isinstance(config, Mapping):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            try:
                with open(path) as f:
                    config = json.load(f)
            except FileNotFoundError:
                raise SpecError(f"no config.json at {path}") from None
            except json.JSONDecodeError as e:
                raise SpecError(f"{path} is not valid JSON: {e}") from None
        return _from_hf(dict(config))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "ModelSpec":
        return _from_gguf(meta)


# ------------------------------------------------------------------------------------------------------------
# Hugging Face config.json
# ------------------------------------------------------------------------------------------------------------
_HF_DENSE = {"llama", "mistral", "qwen2", "qwen3", "smollm3"}
_HF_MOE = {"mixtral", "qwen3_moe", "deepseek_v3", "kimi_k2"}
SUPPORTED_HF = tuple(sorted(_HF_DENSE | _HF_MOE))


def _req(cfg: Mapping[str, Any], key: str, arch: str):
    if key not in cfg or cfg[key] is None:
        raise SpecError(f"{arch} config is missing required field {key!r}")
    return cfg[key]


def _rope_from_hf(cfg, arch, rotary_dim) -> RopeSpec:
    theta = float(cfg.get("rope_theta", 10000.0))
    rs = cfg.get("rope_scaling") or None
    if rs is None and isinstance(cfg.get("rope_parameters"), Mapping):
        rs = dict(cfg["rope_parameters"])
        theta = float(rs.get("rope_theta", theta))
        if rs.get("rope_type", "default") == "default":
            rs = None
    if rs is None:
        return RopeSpec(theta=theta, rotary_dim=rotary_dim)
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return RopeSpec(theta=theta, rotary_dim=rotary_dim)
    if kind == "llama3":
        return RopeSpec(theta=theta, rotary_dim=rotary_dim, scaling="llama3", factor=float(_req(rs, "factor", arch)),
                        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                        original_max_position=int(_req(rs, "original_max_position_embeddings", arch)))
    if kind == "linear":
        return RopeSpec(theta=theta, rotary_dim=rotary_dim, scaling="linear", factor=float(_req(rs, "factor", arch)))
    if kind == "yarn":
        return RopeSpec(theta=theta, rotary_dim=rotary_dim, scaling="yarn", factor=float(_req(rs, "factor", arch)),
                        original_max_position=int(_req(rs, "original_max_position_embeddings", arch)),
                        beta_fast=float(rs.get("beta_fast", 32)), beta_slow=float(rs.get("beta_slow", 1)),
                        mscale=float(rs.get("mscale", 1)), mscale_all_dim=float(rs.get("mscale_all_dim", 0)))
    raise SpecError(f"{arch}: unsupported rope_scaling type {kind!r}")


def _eos(cfg) -> tuple[int, ...]:
    e = cfg.get("eos_token_id")
    if e is None:
        return ()
    return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)


def _from_hf(cfg: dict) -> ModelSpec:
    arch = cfg.get("model_type")
    if arch is None:
        archs = cfg.get("architectures") or []
        raise SpecError(f"config has no 'model_type' (architectures={archs}); cannot tell which model this is")
    if arch not in _HF_DENSE | _HF_MOE:
        raise UnsupportedArchitecture(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_HF)}")
    d = int(_req(cfg, "hidden_size", arch))
    n_heads = int(_req(cfg, "num_attention_heads", arch))
    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    head_dim = int(cfg.get("head_dim") or (d // n_heads))
    n_layers = int(_req(cfg, "num_hidden_layers", arch))
    kw: dict[str, Any] = {}
    moe = mla = None
    rotary_dim = head_dim
    if arch in ("deepseek_v3", "kimi_k2"):
        mla = MLASpec(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=int(_req(cfg, "kv_lora_rank", arch)),
                      qk_nope_head_dim=int(_req(cfg, "qk_nope_head_dim", arch)),
                      qk_rope_head_dim=int(_req(cfg, "qk_rope_head_dim", arch)),
                      v_head_dim=int(_req(cfg, "v_head_dim", arch)))
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        rotary_dim = mla.qk_rope_head_dim
        n_routed = cfg.get("n_routed_experts")
        if n_routed:
            moe = MoESpec(n_experts=int(n_routed), top_k=int(_req(cfg, "num_experts_per_tok", arch)),
                          expert_ffn_dim=int(_req(cfg, "moe_intermediate_size", arch)),
                          n_shared_experts=int(cfg.get("n_shared_experts") or 0),
                          shared_ffn_dim=int(cfg.get("moe_intermediate_size")) * int(cfg.get("n_shared_experts") or 0),
                          router=cfg.get("scoring_func") or "sigmoid", norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                          n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
                          routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                          correction_bias=cfg.get("topk_method", "noaux_tc") == "noaux_tc")
            kw["first_dense_layers"] = int(cfg.get("first_k_dense_replace", 0))
        q = cfg.get("quantization_config") or {}
        if q.get("quant_method") == "fp8":
            kw["quant"] = "fp8_block128"
    elif arch == "mixtral":
        moe = MoESpec(n_experts=int(_req(cfg, "num_local_experts", arch)), top_k=int(_req(cfg, "num_experts_per_tok", arch)),
                      expert_ffn_dim=int(_req(cfg, "intermediate_size", arch)), router="softmax", norm_topk_prob=True)
    elif arch == "qwen3_moe":
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
            raise SpecError(f"{arch}: mlp_only_layers / decoder_sparse_step != 1 are not supported")
        n_exp = cfg.get("num_experts") or cfg.get("num_local_experts")   # transformers v5 writes the latter
        if n_exp is None:
            raise SpecError(f"{arch} config is missing required field 'num_experts'")
        moe = MoESpec(n_experts=int(n_exp), top_k=int(_req(cfg, "num_experts_per_tok", arch)),
                      expert_ffn_dim=int(_req(cfg, "moe_intermediate_size", arch)), router="softmax",
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    window = None
    window_layers: tuple[int, ...] = ()
    if arch in ("mistral", "mixtral") and cfg.get("sliding_window"):
        window = int(cfg["sliding_window"])
        window_layers = tuple(range(n_layers))
    elif arch in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        window = int(cfg["sliding_window"])
        start = int(cfg.get("max_window_layers", n_layers))
        window_layers = tuple(range(start, n_layers))
        if not window_layers:
            window = None
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise SpecError(f"{arch}: unsupported hidden_act {act!r} (only SwiGLU/silu models are supported)")
    ffn = int(_req(cfg, "intermediate_size", arch))
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dtype not in ("bfloat16", "float32", "float16"):
        dtype = "bfloat16"
    spec = ModelSpec(
        arch=arch, vocab_size=int(_req(cfg, "vocab_size", arch)), d_model=d, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=ffn,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope=_rope_from_hf(cfg, arch, rotary_dim),
        max_position=int(_req(cfg, "max_position_embeddings", arch)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"), sliding_window=window, sliding_window_layers=window_layers,
        moe=moe, mla=mla, dtype=dtype, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos(cfg), **kw)
    return spec.validate()


# ------------------------------------------------------------------------------------------------------------
# GGUF metadata (llama.cpp key names: "<arch>.block_count", ...)
# ------------------------------------------------------------------------------------------------------------
_GGUF_ARCH = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def _from_gguf(meta: Mapping[str, Any]) -> ModelSpec:
    a = meta.get("general.architecture")
    if a is None:
        raise SpecError("GGUF metadata has no 'general.architecture'")
    if a not in _GGUF_ARCH:
        raise UnsupportedArchitecture(f"unsupported GGUF architecture {a!r}; supported: {', '.join(sorted(_GGUF_ARCH))}")

    def req(key):
        k = f"{a}.{key}"
        if k not in meta:
            raise SpecError(f"GGUF metadata is missing required field {k!r}")
        return meta[k]

    d = int(req("embedding_length"))
    n_heads = int(req("attention.head_count"))
    n_kv = int(meta.get(f"{a}.attention.head_count_kv", n_heads))
    head_dim = int(meta.get(f"{a}.attention.key_length", d // n_heads))
    n_layers = int(req("block_count"))
    vocab = meta.get(f"{a}.vocab_size")
    if vocab is None:
        toks = meta.get("tokenizer.ggml.tokens")
        if toks is None:
            raise SpecError(f"GGUF metadata has neither '{a}.vocab_size' nor 'tokenizer.ggml.tokens'")
        vocab = len(toks)
    rotary = int(meta.get(f"{a}.rope.dimension_count", head_dim))
    theta = float(meta.get(f"{a}.rope.freq_base", 10000.0))
    st = meta.get(f"{a}.rope.scaling.type")
    if st in (None, "none"):
        rope = RopeSpec(theta=theta, rotary_dim=rotary)
    elif st == "linear":
        rope = RopeSpec(theta=theta, rotary_dim=rotary, scaling="linear", factor=float(meta[f"{a}.rope.scaling.factor"]))
    else:
        raise SpecError(f"GGUF: unsupported rope scaling type {st!r}")
    window = meta.get(f"{a}.attention.sliding_window")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    spec = ModelSpec(
        arch=_GGUF_ARCH[a], vocab_size=int(vocab), d_model=d, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=head_dim, ffn_dim=int(req("feed_forward_length")),
        norm_eps=float(meta.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)), rope=rope,
        max_position=int(meta.get(f"{a}.context_length", 4096)),
        tie_embeddings=bool(meta.get("_tbjax.tied_embeddings", False)),
        qkv_bias=a == "qwen2", qk_norm=a == "qwen3",
        sliding_window=int(window) if window else None,
        sliding_window_layers=tuple(range(n_layers)) if window else (),
        dtype="bfloat16", bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else ())
    return spec.validate()


def rope_attention_scale(spec: ModelSpec) -> float:
    """Softmax scale: 1/sqrt(qk head dim), times yarn's mscale^2 for DeepSeek-style yarn rope."""
    s = 1.0 / math.sqrt(spec.head_dim)
    r = spec.rope
    if r.scaling == "yarn" and r.mscale_all_dim:
        m = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0 if r.factor > 1 else 1.0
        s *= m * m
    return s
