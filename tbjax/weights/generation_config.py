"""A model's sampling defaults: one set for ``tbjax.LLM``, ``python -m tbjax.generate``, gRPC and HTTP.

Where they come from (``load_generation_defaults(model_path, source)``):

- ``source="auto"`` (the default):
  * a Hugging Face directory or a tbjax checkpoint with a ``generation_config.json``: its sampling fields
    (``temperature``, ``top_p``, ``top_k``, ``min_p``) and its ``eos_token_id`` (an int or a list); ``do_sample: false``
    given explicitly means greedy (temperature 0). Fields tbjax does not apply (``repetition_penalty`` != 1, ...) are
    listed in ``GenerationDefaults.ignored``;
  * a GGUF file with llama.cpp's ``general.sampling.*`` metadata (``temp``, ``top_p``, ``top_k``, ``min_p``): those;
  * the default model (SmolLM2-135M-Instruct, a GGUF without either): the settings its model card recommends,
    temperature 0.2 and top_p 0.9 (``SMOLLM2_CARD``);
  * anything else: none (the library's own: temperature 1, top_p 1, top_k off, min_p 0).
- ``source="none"``: no model defaults at all.
- ``source=PATH``: that ``generation_config.json`` (or a directory holding one), whatever the model.

A request's explicit values always win: ``GenerationDefaults.make_params(**explicit)`` fills only the fields the
request left unset (``None`` in ``tbjax.SamplingParams``).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from pallas_kernels.utils import is_int, is_number

__all__ = ["GenerationDefaults", "load_generation_defaults", "from_generation_config", "SMOLLM2_CARD",
           "GENERATION_CONFIG_FILE", "GenerationConfigError"]

GENERATION_CONFIG_FILE = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p")

# SmolLM2-135M-Instruct's model card: "temperature=0.2, top_p=0.9" in its generate() example.
SMOLLM2_CARD = {"temperature": 0.2, "top_p": 0.9}

# generation_config.json fields that are about sampling but that tbjax does not implement: reported, not applied.
# (Values equal to the neutral one are not reported.)
_UNSUPPORTED_NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                        "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "num_beams": 1,
                        "no_repeat_ngram_size": 0, "length_penalty": 1.0}

_GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p"}


class GenerationConfigError(ValueError):
    """An unreadable or invalid generation config; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults of a model (None: not set, the library's own applies) and its extra end-of-sequence ids."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    source: str = "none"                  # where they came from, for logs and /v1/models
    ignored: tuple[str, ...] = ()         # fields of the source that tbjax does not apply

    def sampling(self) -> dict[str, Any]:
        """The sampling fields that are set."""
        return {k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) is not None}

    def make_params(self, **kwargs):
        """``tbjax.SamplingParams(**kwargs)`` with the fields it leaves unset (None) taken from these defaults."""
        from tbjax.sampling import SamplingParams
        return SamplingParams(**kwargs).with_defaults(self.sampling())

    def apply(self, params):
        """A copy of ``params`` (a SamplingParams) with its unset fields from these defaults."""
        return params.with_defaults(self.sampling())

    def describe(self) -> str:
        s = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.sampling().items())
        return f"{s or 'library defaults'} ({self.source})"


def _num(path: str, key: str, v, kind):
    if not is_number(v):
        raise GenerationConfigError(f"{path}: {key} must be a number, got {v!r}")
    return int(v) if kind is int else float(v)


def from_generation_config(cfg: Mapping[str, Any], where: str = "generation_config.json") -> GenerationDefaults:
    """Defaults from the fields of a Hugging Face ``generation_config.json`` (a dict)."""
    if not isinstance(cfg, Mapping):
        raise GenerationConfigError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    kw: dict[str, Any] = {}
    for key, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float)):
        v = cfg.get(key)
        if v is not None:
            kw[key] = _num(where, key, v, kind)
    if cfg.get("do_sample") is False:   # said explicitly: the authors want greedy decoding
        kw["temperature"] = 0.0
    eos = cfg.get("eos_token_id")
    ids: tuple[int, ...] = ()
    if eos is not None:
        seq = eos if isinstance(eos, (list, tuple)) else [eos]
        if any(not is_int(e) or e < 0 for e in seq):
            raise GenerationConfigError(f"{where}: eos_token_id must be an int >= 0 or a list of them, got {eos!r}")
        ids = tuple(int(e) for e in seq)
    ignored = tuple(k for k, neutral in _UNSUPPORTED_NEUTRAL.items()
                    if cfg.get(k) is not None and cfg.get(k) != neutral)
    d = GenerationDefaults(**kw, eos_token_ids=ids, source=where, ignored=ignored)
    _check(d, where)
    return d


def _check(d: GenerationDefaults, where: str) -> None:
    from tbjax.sampling import SamplingParams, SamplingParamsError
    try:
        SamplingParams(**d.sampling()).validate()
    except SamplingParamsError as e:
        raise GenerationConfigError(f"{where}: {e}") from None


def read_generation_config(path: str) -> GenerationDefaults:
    """Defaults from a ``generation_config.json`` file, or from the one in directory ``path``."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, GENERATION_CONFIG_FILE)
    if not os.path.isfile(p):
        raise GenerationConfigError(f"no generation config at {path} (a generation_config.json file or a directory "
                                    "with one)")
    try:
        with open(p) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise GenerationConfigError(f"{p}: cannot read it as JSON: {e}") from None
    return from_generation_config(cfg, where=p)


def from_gguf_metadata(meta: Mapping[str, Any], where: str) -> GenerationDefaults | None:
    """Defaults from llama.cpp's ``general.sampling.*`` GGUF metadata, or None when the file has none."""
    kw = {}
    for key, field in _GGUF_SAMPLING.items():
        v = meta.get(key)
        if v is not None:
            kw[field] = _num(where, key, v, int if field == "top_k" else float)
    if not kw:
        return None
    d = GenerationDefaults(**kw, source=f"GGUF general.sampling metadata of {where}")
    _check(d, where)
    return d


def _is_default_model(path: str | None) -> bool:
    if path is None:
        return True
    from tbjax.default_model import DefaultModelMissing, default_model_path
    try:
        return os.path.realpath(path) == os.path.realpath(default_model_path())
    except DefaultModelMissing:
        return False


def load_generation_defaults(model: str | None = None, source: str | os.PathLike | None = "auto",
                             *, gguf_metadata: Mapping[str, Any] | None = None) -> GenerationDefaults:
    """The sampling defaults of the model at ``model`` (None: the default model); see the module docstring for
    ``source`` ("auto", "none" or a path). ``gguf_metadata``: a GGUF's metadata already read (saves a re-read)."""
    if source is None or source == "none":
        return GenerationDefaults(source="none")
    if source != "auto":
        return read_generation_config(os.fspath(source))
    if _is_default_model(model):
        return GenerationDefaults(**SMOLLM2_CARD, source="SmolLM2-135M-Instruct model card")
    path = os.fspath(model)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, GENERATION_CONFIG_FILE)):
            return read_generation_config(path)
        from tbjax.weights import checkpoint
        meta = checkpoint.load_tokenizer_meta(path) if checkpoint.is_checkpoint(path) else None
        if meta:
            d = from_gguf_metadata(meta, path)
            if d is not None:
                return d
        return GenerationDefaults(source=f"none found in {path}")
    if gguf_metadata is None and os.path.isfile(path):
        from tbjax.weights.gguf_file import GGUFFile
        gguf_metadata = GGUFFile(path).metadata()
    d = from_gguf_metadata(gguf_metadata or {}, path)
    return d if d is not None else GenerationDefaults(source=f"none in {path}")
