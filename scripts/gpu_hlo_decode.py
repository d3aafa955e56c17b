"""Count the kernels of one decode layer in the engine's decode step, compiled for an sm_90 GPU WITHOUT a GPU.

Why: the Llama-3.1-8B decode step at batch 32 x 1k is launch-bound beyond its GEMMs (H200 profile, RESULTS.md:
~12 kernels per layer, the small ones ~0.45 ms/step plus ~0.55 ms of gaps). With no GPU at hand, the optimized HLO
of the real step (`tbjax.engine.runner._step` through a ModelRunner's jitted function) compiled for the H100/H200
target is the measurable proxy: every top-level instruction of the entry computation that launches work (a fusion,
a custom call, a copy, a scatter, ...) is a thunk, i.e. one kernel launch (or one cuBLAS/Mosaic call).

Needs the CUDA 12 PJRT plugin importable (it is NOT a dependency of tbjax):
    pip install --no-deps --target /tmp/cuda12plugin jax-cuda12-plugin==0.11.2 jax-cuda12-pjrt==0.11.2
    PYTHONPATH=/tmp/cuda12plugin JAX_PLATFORMS=cpu python scripts/gpu_hlo_decode.py --layers 2
Prints a table and, last, one JSON line (also written to --json):
  {"variants": [{"variant", "layer_buffers", "folded_norms", "kernels_per_layer", "kinds_per_layer": {kind: n},
                 "layers": [[{"name", "kind", "params", "shape"}, ...], ...], "head", "tail", "total_kernels",
                 "entry_parameters", "temp_bytes", "thunks": {"top_level", "in_command_buffers"}}, ...],
   "diffs": {"stacked vs split": {...}, ...}}
A layer = the schedule from one attention launch (the Mosaic GPU custom call; every layer has exactly one) up to
the next: attention, o-projection, residual add, norm, FFN, residual add, next layer's norm, QKV, KV write, RoPE.
Kernels before the first attention ("head": embedding, first norm/QKV) and from the last one on ("tail": final
norm, lm_head, sampling) are reported apart. "folded" compiles with tbjax.model.kinds.fold_norms parameters.
Deviceless compiles skip autotuning: GEMM tile configs here are defaults, not the H200's; fusion decisions (made
before autotuning, with the target's cost model) are what this measures.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
from gpu_hlo_overlap import TARGET, split_computations  # noqa: E402

CONFIG = os.path.join(ROOT, "tests", "data", "configs", "llama-3.1-8b.json")     # = ../shared/configs

# Instructions that do not launch anything (views, tuples, parameters, constants, control).
NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
             "replica-id", "opt-barrier", "add-dependency"}
INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+) = (\S+|\([^=]*?\)) ([\w\-]+)\((.*)$")


def _callee(rest: str) -> str | None:
    m = re.search(r"calls=%?([\w.\-]+)", rest)
    return m.group(1) if m else None


def _stem(name: str) -> str:
    """XLA's fusion name without its numeric suffix: 'loop_add_fusion.3' -> 'loop_add_fusion'."""
    return re.sub(r"(?:[._]\d+)+$", "", name)


def classify(name: str, op: str, rest: str, comps: dict[str, list[str]]) -> str:
    """A kernel's kind from its opcode, fusion kind, backend config and callee (what runs in it)."""
    if op == "fusion":
        callee = _callee(rest) or ""
        kind = re.search(r"kind=(k\w+)", rest)
        kind = kind.group(1) if kind else "?"
        cfg = re.search(r'"kind":"(\w+)"', rest)
        cfg = cfg.group(1) if cfg else ""
        body = "\n".join(comps.get(callee, []))
        if 'custom_call_target="mosaic_gpu' in body:
            return "attention (Mosaic GPU custom call)"
        if cfg == "__cublas" or 'custom_call_target="__cublas' in body:
            return "gemm (cublas)" + (" in a dynamic-slice fusion" if "dynamic-slice" in callee else "")
        if "custom-call(" in body:
            return "custom call in a fusion"
        if cfg in ("__triton_gemm", "__triton_nested_gemm_fusion") or callee.startswith("gemm_fusion"):
            return "gemm fusion (triton)"
        if cfg == "__triton" and "block_level_fusion_config" in rest:
            red = " reduce(" in body
            return "triton block-level fusion" + (" (normalization)" if red else "")
        if kind == "kInput":
            return f"input fusion ({_stem(name)})"
        if kind == "kLoop":
            return f"loop fusion ({_stem(name)})"
        return f"fusion {kind} {cfg} ({_stem(name)})"
    if op == "custom-call":
        tgt = re.search(r'custom_call_target="([^"]+)"', rest)
        tgt = tgt.group(1) if tgt else "?"
        if "cublas" in tgt.lower():
            return "gemm (cublas)"
        return f"custom call ({tgt})"
    return op


def _n_operands(rest: str) -> int:
    """Operands of the instruction (the text up to the closing parenthesis of its operand list)."""
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    args = rest[: i - 1]
    return len(re.findall(r"%[\w.\-]+", args))


def entry_kernels(hlo: str) -> list[dict]:
    """The launches of the entry computation in schedule order (the optimized module is scheduled)."""
    comps = split_computations(hlo)
    entry = re.search(r"^ENTRY %?([\w.\-]+)", hlo, re.M).group(1)
    out = []
    for ln in comps[entry]:
        m = INSTR.match(ln)
        if not m:
            continue
        name, shape, op, rest = m.group(2), m.group(3), m.group(4), m.group(5)
        if op in NO_LAUNCH:
            continue
        if op in ("while", "conditional", "call"):
            kind = op            # control flow: its body's kernels are listed separately (sampling, fp8 requant)
        else:
            kind = classify(name, op, rest, comps)
        out.append({"name": name, "op": op, "kind": kind, "params": _n_operands(rest), "shape": shape[:80]})
    return out


def is_attention(k: dict) -> bool:
    return k["kind"].startswith("attention") or "mosaic" in k["kind"]


def is_kv_write(k: dict) -> bool:
    return "scatter" in k["kind"]


def per_layer(kernels: list[dict], n_layers: int, anchor) -> tuple[list[list[dict]], list[dict], list[dict]]:
    """Split the schedule at the kernels matched by `anchor` (exactly one per layer): the runs between consecutive
    anchors are whole layers (n_layers - 1 of them); what comes before the first anchor is `head`, from the last
    one on `tail`."""
    idx = [i for i, k in enumerate(kernels) if anchor(k)]
    if len(idx) != n_layers:
        raise RuntimeError(f"expected {n_layers} anchor kernels (one per layer), found {len(idx)}: "
                           f"{[kernels[i]['name'] for i in idx]}")
    layers = [kernels[idx[i]: idx[i + 1]] for i in range(n_layers - 1)]
    return layers, kernels[: idx[0]], kernels[idx[-1]:]


def build(layers: int, batch: int, ctx: int, page: int, layer_buffers: str, attn_impl: str, config: str | None,
          fold: bool = False):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec as P

    from tbjax.engine.kv_cache import KVCacheConfig, cache_heads
    from tbjax.engine.runner import ModelRunner
    from tbjax.model.kinds import fold_norms
    from tbjax.model.params import param_shapes
    from tbjax.spec import ModelSpec

    with open(TARGET) as f:
        topo = topologies.get_topology_desc("h100x1", "cuda", target_config=f.read(), topology="1x1x1")
    mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
    rep = NamedSharding(mesh, P())
    path = config or CONFIG
    with open(path) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers
    spec = ModelSpec.from_hf_config(cfg).replace(dtype="bfloat16")
    sds = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep)  # noqa: E731
    params = param_shapes(spec, "bfloat16")
    if fold:            # norms folded into the next projection (tbjax/model/kinds.py fold_norms), abstractly
        params = jax.eval_shape(lambda p: fold_norms(spec, p), params)
    params = jax.tree.map(sds, params)
    K, H = cache_heads(spec)
    num_pages = 1 + batch * (ctx // page)
    caches = [(jax.ShapeDtypeStruct((num_pages, page, 2 * K, H), jnp.bfloat16, sharding=rep), None)
              for _ in range(spec.n_layers)]
    runner = ModelRunner(spec, params, caches, page_size=page, max_num_seqs=batch, max_num_batched_tokens=batch,
                         max_pages_per_seq=ctx // page, attn_impl=attn_impl, matmul_impl="auto",
                         layer_buffers="stacked")
    if layer_buffers == "split":      # split_layer_buffers' tree, abstract (it slices concrete arrays)
        runner.params = {**params, "groups": {g: {k: [jax.ShapeDtypeStruct(v.shape[1:], v.dtype, sharding=rep)
                                                      for _ in range(v.shape[0])] for k, v in gp.items()}
                                              for g, gp in params["groups"].items()}}
    P_ = ctx // page
    entries = [([1], ctx - 1, list(range(1 + s * P_, 1 + (s + 1) * P_))) for s in range(batch)]
    inp = runner.build_inputs(entries, [(0.0, 0, 1.0, 0.0, s) for s in range(batch)])
    ints, floats, layout = inp.pack()
    a_ints = jax.ShapeDtypeStruct(ints.shape, ints.dtype, sharding=rep)
    a_floats = jax.ShapeDtypeStruct(floats.shape, floats.dtype, sharding=rep)
    lowered = runner._fn.trace(runner.params, runner.caches, a_ints, a_floats,
                               **runner._static(inp, False, layout)).lower()
    return spec, lowered.compile()


def analyse(hlo: str, n_layers: int) -> dict:
    ks = entry_kernels(hlo)
    # layers start at the attention kernel; with the jnp attention (no custom call) at the KV write
    anchor = is_attention if any(is_attention(k) for k in ks) else is_kv_write
    layers, head, tail = per_layer(ks, n_layers, anchor)
    counts = [len(L) for L in layers]
    kinds = collections.Counter(k["kind"] for k in layers[-1]) if layers else {}
    return {"kernels_per_layer": counts[-1] if counts else None, "layer_counts": counts,
            "kinds_per_layer": dict(sorted(kinds.items())), "total_kernels": len(ks),
            "layers": [[{x: k[x] for x in ("name", "kind", "params", "shape")} for k in L] for L in layers],
            "head": [{x: k[x] for x in ("name", "kind", "params")} for k in head],
            "tail": [{x: k[x] for x in ("name", "kind", "params")} for k in tail]}


def diff(a: dict, b: dict) -> dict:
    """What differs between two variants' per-layer kernel lists (kinds, parameter counts)."""
    la, lb = a["layers"][-1], b["layers"][-1]
    ka, kb = collections.Counter(k["kind"] for k in la), collections.Counter(k["kind"] for k in lb)
    kinds = {k: (ka.get(k, 0), kb.get(k, 0)) for k in sorted(set(ka) | set(kb)) if ka.get(k, 0) != kb.get(k, 0)}
    pa, pb = sum(k["params"] for k in la), sum(k["params"] for k in lb)
    seq = [(x["kind"], x["params"], y["kind"], y["params"]) for x, y in zip(la, lb)
           if (x["kind"], x["params"]) != (y["kind"], y["params"])]
    return {"kind_counts_differ": kinds, "operands_per_layer": (pa, pb), "positions_differ": seq,
            "total_kernels": (a["total_kernels"], b["total_kernels"])}


def table(results: list[dict]) -> str:
    lines = []
    for r in results:
        lines.append(f"== {r['variant']} (attn {r['attn_impl']}): {r['kernels_per_layer']} kernels per layer, "
                     f"{r['total_kernels']} in the step of {r['n_layers']} layers")
        if r.get("thunks"):
            lines.append(f"   entry parameters {r['entry_parameters']}, temp {r['temp_bytes'] / 2**20:.1f} MiB; "
                         f"thunk sequence: top level {r['thunks']['top_level']}, "
                         f"{r['thunks']['in_command_buffers']} kernels inside command buffers")
        for k, n in r["kinds_per_layer"].items():
            lines.append(f"   {n:3d}  {k}")
        lines.append("   schedule of the last whole layer: " + ", ".join(
            f"{k['name']}[{k['kind']}, {k['params']} ops]" for k in r["layers"][-1]))
    return "\n".join(lines)


def thunk_summary(text: str) -> dict:
    """Top-level entries of XLA's thunk sequence (after its thunk passes): command buffers (one CUDA-graph launch
    each, holding many kernels) and the thunks launched outside them (custom calls, conditionals, ...)."""
    top, inside, parent = collections.Counter(), 0, None
    for ln in text.splitlines():
        m = re.match(r"^\d+: (k\w+)", ln)
        if m:
            parent = m.group(1)
            top[parent] += 1
        elif parent == "kCommandBuffer" and re.match(r"^ {4}\d+: k\w+", ln):
            inside += 1
    return {"top_level": dict(sorted(top.items())), "in_command_buffers": inside}


def _newest_thunks(dump_dir: str, seen: set) -> str | None:
    files = sorted(f for f in os.listdir(dump_dir) if f.endswith("jit__step.thunk_sequence_after_thunk_passes.txt")
                   and f not in seen)
    if not files:
        return None
    seen.add(files[-1])
    with open(os.path.join(dump_dir, files[-1])) as f:
        return f.read()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--variants", default="stacked,split,stacked:folded,split:folded",
                    help="comma-separated <layer buffers>[:folded]; folded = tbjax.model.kinds.fold_norms params")
    ap.add_argument("--attn-impl", default="gpu", help="gpu (the Mosaic GPU kernel) or reference (jnp)")
    ap.add_argument("--config", default=None, help="HF config.json (default: Llama-3.1-8B)")
    ap.add_argument("--no-thunks", action="store_true", help="skip the thunk-sequence dump (command buffers)")
    ap.add_argument("--dump", default=None, help="write each optimized HLO to <dump>.<variant>.txt")
    ap.add_argument("--json", default=None, help="also write the JSON here")
    ap.add_argument("--quiet", action="store_true", help="only the JSON line")
    a = ap.parse_args(argv)
    if a.layers < 2:
        raise SystemExit("--layers must be >= 2 (a whole layer lies between two attention launches)")
    variants = []
    for v in a.variants.split(","):
        lb, _, mod = v.partition(":")
        if lb not in ("stacked", "split") or mod not in ("", "folded"):
            raise SystemExit(f"--variants: unknown {v!r} (<stacked|split>[:folded])")
        variants.append((v, lb, mod == "folded"))
    dump_dir, seen = None, set()
    if not a.no_thunks:          # XLA writes the thunk sequence only to a dump directory; set before jax starts
        import tempfile
        dump_dir = tempfile.mkdtemp(prefix="gpu_hlo_decode_")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir}"
                                   " --xla_dump_hlo_pass_re=^$").strip()
    results = []
    for name, lb, fold in variants:
        spec, compiled = build(a.layers, a.batch, a.ctx, a.page, lb, a.attn_impl, a.config, fold=fold)
        hlo = compiled.as_text()
        if a.dump:
            with open(f"{a.dump}.{name.replace(':', '_')}.txt", "w") as f:
                f.write(hlo)
        r = analyse(hlo, a.layers)
        mem = compiled.memory_analysis()
        entry = re.search(r"^ENTRY [^(]*\((.*)\) ->", hlo, re.M)
        r.update(entry_parameters=len(re.findall(r"\w+: ", entry.group(1))) if entry else None,
                 temp_bytes=int(mem.temp_size_in_bytes), argument_bytes=int(mem.argument_size_in_bytes))
        r.update(variant=name, layer_buffers=lb, folded_norms=fold, attn_impl=a.attn_impl, batch=a.batch, ctx=a.ctx,
                 n_layers=a.layers)
        if dump_dir:
            text = _newest_thunks(dump_dir, seen)
            r["thunks"] = thunk_summary(text) if text else None
        results.append(r)
    if dump_dir:
        import shutil
        shutil.rmtree(dump_dir, ignore_errors=True)
    out = {"variants": results}
    by = {r["variant"]: r for r in results}
    for x, y in (("stacked", "split"), ("stacked:folded", "split:folded"), ("stacked", "stacked:folded")):
        if x in by and y in by:
            out.setdefault("diffs", {})[f"{x} vs {y}"] = diff(by[x], by[y])
    if not a.quiet:
        print(table(results))
        for k, d in out.get("diffs", {}).items():
            print(f"{k}:", json.dumps(d))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
