"""`ServedModel`: what the front end needs from the model it serves, in one place.

The servicer needs the model's name, tokenizer, vocabulary size and context length (to validate requests),
a way to build ``SamplingParams``, and the engine to run. ``from_llm`` takes them from a ``tbjax.LLM``;
tests and the load tool's smoke mode build one around the fake engine instead. A later prefill/decode
router builds one whose ``engine`` forwards to workers: the servicer does not change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ServedModel", "DEFAULT_MODEL_NAME", "model_name_for_path"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def model_name_for_path(path: str | None) -> str:
    """The served name of a model loaded from ``path`` (None: the default model): the file or directory
    name without a .gguf suffix."""
    import os

    if path is None:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


@dataclass
class ServedModel:
    name: str                             # what clients put in GenerateRequest.model
    arch: str
    tokenizer: Any                        # encode(text, add_special_tokens) / decode / apply_chat_template
    vocab_size: int
    max_context: int                      # prompt + output tokens of one request
    eos_token_ids: tuple[int, ...]
    make_params: Callable[..., Any]       # SamplingParams(**kwargs), unset fields from the model's defaults
    engine: Any                           # add_request / abort / step / has_unfinished / stats
    generation_defaults: Any = None       # tbjax.weights.generation_config.GenerationDefaults (what make_params fills)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @classmethod
    def from_llm(cls, llm, name: str | None = None) -> "ServedModel":
        """Wrap a ``tbjax.LLM`` (its engine, tokenizer and spec). ``name`` defaults to the default model's."""
        from tbjax.sampling import SamplingParams

        spec = llm.spec
        engine = llm.engine
        ctx = min(spec.max_position, engine.max_model_len)
        tok = llm.tokenizer
        eos = tuple(getattr(tok, "eos_token_ids", ()) or spec.eos_token_ids)
        defaults = getattr(llm, "generation_defaults", None)
        make = llm.make_params if defaults is not None else SamplingParams
        return cls(name=name or getattr(llm, "model_name", None) or DEFAULT_MODEL_NAME, arch=spec.arch,
                   tokenizer=tok, vocab_size=spec.vocab_size, max_context=ctx, eos_token_ids=eos,
                   make_params=make, engine=engine, generation_defaults=defaults)


def pipeline_served_model(spec, params, tokenizer, devices, *, name: str, page_size: int | None = None,
                          kv_dtype: str | None = None, max_model_len: int | None = None,
                          max_num_batched_tokens: int | None = None, **_ignored) -> ServedModel:
    """A prefill worker's model over a pipeline of `devices` (tbjax.prefill_pipeline.PipelinePrefillEngine):
    layers split over the devices by FLOPs, prompts in chunks of max_num_batched_tokens (default 256)."""
    from tbjax.prefill_pipeline import PipelinePrefillEngine
    from tbjax.sampling import SamplingParams

    eng = PipelinePrefillEngine(spec, params, tokenizer, devices, page_size=page_size or 16,
                                kv_dtype=kv_dtype or "auto", chunk_tokens=max_num_batched_tokens or 256,
                                max_model_len=max_model_len)
    eos = tuple(getattr(tokenizer, "eos_token_ids", ()) or spec.eos_token_ids)
    return ServedModel(name=name, arch=spec.arch, tokenizer=tokenizer, vocab_size=spec.vocab_size,
                       max_context=eng.max_model_len, eos_token_ids=eos, make_params=SamplingParams, engine=eng)
