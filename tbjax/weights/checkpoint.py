"""Converted checkpoints with orbax: convert a model once (GGUF/safetensors -> tbjax tree), restore it straight
into a target sharding (each device reads only its shards), with the spec and tokenizer stored beside it."""
from __future__ import annotations

import dataclasses
import json
import os

import jax

from tbjax.spec import LayerGroup, MLASpec, ModelSpec, MoESpec, RopeSpec
from tbjax.weights.assemble import WeightLoadError

SPEC_FILE = "tbjax_spec.json"
TOKENIZER_FILE = "tokenizer_meta.json"


def spec_to_dict(spec: ModelSpec) -> dict:
    return dataclasses.asdict(spec)


def spec_from_dict(d: dict) -> ModelSpec:
    d = dict(d)
    d["rope"] = RopeSpec(**d["rope"])
    d["moe"] = MoESpec(**d["moe"]) if d.get("moe") else None
    d["mla"] = MLASpec(**d["mla"]) if d.get("mla") else None
    for k in ("eos_token_ids", "sliding_window_layers"):
        d[k] = tuple(d.get(k) or ())
    return ModelSpec(**d).validate()


def save(path: str, spec: ModelSpec, params, tokenizer_meta: dict | None = None):
    """Write params (orbax), the spec and optional tokenizer metadata to directory `path`."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, "params"), params, force=True)
    dtypes = {str(a.dtype) for a in jax.tree.leaves(params)}
    with open(os.path.join(path, SPEC_FILE), "w") as f:
        json.dump({**spec_to_dict(spec), "_params_dtype": dtypes.pop() if len(dtypes) == 1 else None}, f, indent=1)
    if tokenizer_meta is not None:
        with open(os.path.join(path, TOKENIZER_FILE), "w") as f:
            json.dump(tokenizer_meta, f)


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, SPEC_FILE)) and os.path.isdir(os.path.join(path, "params"))


def _read_spec(path: str):
    path = os.path.abspath(path)
    if not is_checkpoint(path):
        raise WeightLoadError(f"{path} is not a tbjax checkpoint (missing {SPEC_FILE} or params/)")
    with open(os.path.join(path, SPEC_FILE)) as f:
        d = json.load(f)
    saved_dtype = d.pop("_params_dtype", None)
    return spec_from_dict(d), saved_dtype


def read_spec(path: str) -> ModelSpec:
    """The ModelSpec of a checkpoint, without its weights."""
    return _read_spec(path)[0]


def restore(path: str, shardings=None, dtype=None):
    """Returns (spec, params). `shardings`: a pytree of jax.sharding.Sharding matching the params (or a single
    Sharding for every leaf); None => default device placement."""
    import orbax.checkpoint as ocp

    from tbjax.model.params import param_shapes

    path = os.path.abspath(path)
    spec, saved_dtype = _read_spec(path)
    abstract = param_shapes(spec, dtype or saved_dtype)
    if shardings is not None:
        if isinstance(shardings, jax.sharding.Sharding):
            shardings = jax.tree.map(lambda _: shardings, abstract)
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    try:
        with ocp.StandardCheckpointer() as ckpt:
            params = ckpt.restore(os.path.join(path, "params"), abstract)
    except Exception as e:
        raise WeightLoadError(f"{path}: cannot restore params: {type(e).__name__}: {e}") from None
    return spec, params


def load_tokenizer_meta(path: str) -> dict | None:
    p = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        return json.load(f)


__all__ = ["save", "restore", "is_checkpoint", "spec_to_dict", "spec_from_dict", "LayerGroup"]
