"""Converted checkpoints with orbax: convert a model once (GGUF/safetensors -> tbjax tree), restore it straight
into a target sharding (each device reads only its shards), with the spec and tokenizer stored beside it.

Quantized weights (tbjax/model/quant.py) are saved as they are resident (codes, scales, zeros as separate arrays);
`tbjax_quant.json` records each one's format, blocks and shapes so that restore can rebuild the tree."""
from __future__ import annotations

import dataclasses
import json
import os

import jax

from tbjax.spec import LayerGroup, MLASpec, ModelSpec, MoESpec, RopeSpec
from tbjax.weights.assemble import WeightLoadError

SPEC_FILE = "tbjax_spec.json"
TOKENIZER_FILE = "tokenizer_meta.json"
QUANT_FILE = "tbjax_quant.json"


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
    from sharding.rules import path_str
    from tbjax.model.quant import QuantizedWeight, describe, params_dtype

    # quantized weights are saved as plain {q, scale, zero} dicts (orbax sees only dicts and arrays)
    plain = jax.tree.map(lambda w: {k: v for k, v in (("q", w.q), ("scale", w.scale), ("zero", w.zero))
                                    if v is not None} if isinstance(w, QuantizedWeight) else w, params,
                         is_leaf=lambda x: isinstance(x, QuantizedWeight))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, "params"), plain, force=True)
    quant = {path_str(kp): describe(w) for kp, w in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, QuantizedWeight))[0] if isinstance(w, QuantizedWeight)}
    qfile = os.path.join(path, QUANT_FILE)
    if quant:
        with open(qfile, "w") as f:
            json.dump(quant, f, indent=1)
    elif os.path.exists(qfile):
        os.remove(qfile)
    dtypes = {str(a.dtype) for a in jax.tree.leaves(params)} if not quant else {params_dtype(params)}
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


def abstract_params(path: str, dtype=None):
    """(spec, ShapeDtypeStructs of the saved tree, quantized weights included) of a checkpoint."""
    from sharding.rules import path_str
    from tbjax.model.params import param_shapes
    from tbjax.model.quant import from_description

    path = os.path.abspath(path)
    spec, saved_dtype = _read_spec(path)
    abstract = param_shapes(spec, dtype or saved_dtype)
    qfile = os.path.join(path, QUANT_FILE)
    if os.path.isfile(qfile):
        with open(qfile) as f:
            quant = json.load(f)
        abstract = jax.tree_util.tree_map_with_path(
            lambda kp, a: from_description(quant[path_str(kp)], dtype) if path_str(kp) in quant else a, abstract)
    return spec, abstract


def restore(path: str, shardings=None, dtype=None, weight_dtype: str = "auto"):
    """Returns (spec, params). `shardings`: a pytree of jax.sharding.Sharding matching the params (or a single
    Sharding for every leaf); None => default device placement. Quantized weights come back in their saved format
    (weight_dtype "auto"); "bf16"/"float32" dequantizes them, "int8"/"int4"/"fp8" converts every matrix."""
    import orbax.checkpoint as ocp

    from tbjax.model.quant import FORMATS, QuantizedWeight, check_weight_dtype, dequantize, quantize_tree

    path = os.path.abspath(path)
    weight_dtype = check_weight_dtype(weight_dtype)
    spec, abstract = abstract_params(path, dtype)
    if shardings is not None:
        if isinstance(shardings, jax.sharding.Sharding):
            shardings = jax.tree.map(lambda _: shardings, abstract)
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    isq = lambda x: isinstance(x, QuantizedWeight)   # noqa: E731
    plain = jax.tree.map(lambda w: {k: v for k, v in (("q", w.q), ("scale", w.scale), ("zero", w.zero))
                                    if v is not None} if isq(w) else w, abstract, is_leaf=isq)
    try:
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(os.path.join(path, "params"), plain)
    except Exception as e:
        raise WeightLoadError(f"{path}: cannot restore params: {type(e).__name__}: {e}") from None
    leaves, treedef = jax.tree_util.tree_flatten(abstract, is_leaf=isq)
    rleaves = jax.tree_util.tree_flatten(restored, is_leaf=lambda x: isinstance(x, dict) and "q" in x)[0]
    params = jax.tree_util.tree_unflatten(treedef, [
        QuantizedWeight(r["q"], r["scale"], r.get("zero"), fmt=a.fmt, block=a.block, shape=a.shape, dtype=a.dtype)
        if isq(a) else r for a, r in zip(leaves, rleaves)])
    if weight_dtype in FORMATS:
        params = quantize_tree(params, weight_dtype)
    elif weight_dtype in ("bf16", "float32"):
        dt = dtype or ("bfloat16" if weight_dtype == "bf16" else "float32")
        params = jax.tree.map(lambda w: dequantize(w, dt) if isinstance(w, QuantizedWeight) else w, params,
                              is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return spec, params


def load_tokenizer_meta(path: str) -> dict | None:
    p = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        return json.load(f)


__all__ = ["save", "restore", "is_checkpoint", "spec_to_dict", "spec_from_dict", "LayerGroup"]
