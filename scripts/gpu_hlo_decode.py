"""Count the kernels of one decode layer in the engine's step program, compiled for an sm_90 GPU WITHOUT a GPU.

Why: the Llama-3.1-8B decode step at batch 32 x 1k is launch-bound beyond its GEMMs (H200 profile, RESULTS.md:
~12 kernels per layer, the small ones ~0.45 ms/step plus ~0.55 ms of gaps). With no GPU at hand, the optimized HLO
of the real step (`tbjax.engine.runner.ModelRunner._fn(bucket)`, the one ragged shard_map program per token bucket,
here on a one-GPU topology mesh with abstract weights and KV pools) compiled for the H100/H200 target is the
measurable proxy: every top-level instruction of the entry computation that launches work (a fusion, a custom call,
a copy, a scatter, a while loop, ...) is a thunk, i.e. one kernel launch (or one cuBLAS/Mosaic call).
A decode batch of B sequences x ctx tokens is the step of token bucket T = bucket(B) (max_num_seqs =
max_num_batched_tokens = B), so S = min(T, B) sequence slots and block tables ctx // page wide.

Needs the CUDA 12 PJRT plugin importable (it is NOT a dependency of tbjax):
    pip install --no-deps --target /tmp/cuda12plugin jax-cuda12-plugin==0.11.2 jax-cuda12-pjrt==0.11.2
    PYTHONPATH=/tmp/cuda12plugin JAX_PLATFORMS=cpu python scripts/gpu_hlo_decode.py --layers 2
Prints a table and, last, one JSON line (also written to --json):
  {"variants": [{"variant", "layer_buffers", "folded_norms", "bucket", "sequence_slots", "kernels_per_layer",
                 "kinds_per_layer": {kind: n}, "sources_per_layer": {jitted function: n},
                 "layers": [[{"name", "kind", "params", "shape", "src"}, ...], ...], "head", "tail",
                 "total_kernels", "entry_parameters", "temp_bytes", "thunks": {"top_level", "in_command_buffers"}},
                ...],
   "diffs": {"stacked vs split": {...}, ...}}
A layer = the schedule from its first attention launch (the Mosaic GPU custom calls: the step's attention entry
`step_attention` runs the decode kernel AND the ragged kernel in every step, so a layer has two) up to the next
layer's first: attention and its helpers, o-projection, residual add, norm, FFN, residual add, next layer's norm,
QKV, KV write, RoPE. Kernels before the first attention ("head": embedding, first norm/QKV) and from the last
layer's first one on ("tail": last attention, final norm, lm_head, sampling) are reported apart. "src" names the
jitted function a kernel comes from (op_name metadata: paged_attention_gpu, paged_decode_attention_gpu, write_kv,
...; '' = the step's own ops). "folded" compiles with tbjax.model.kinds.fold_norms parameters.
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
from gpu_hlo_overlap import (abstract_runner, compile_bucket, entry_name, gpu_mesh, parse,  # noqa: E402
                             split_computations)

CONFIG = os.path.join(ROOT, "tests", "data", "configs", "llama-3.1-8b.json")     # = ../shared/configs

# Instructions that do not launch anything (views, tuples, parameters, constants, control).
NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
             "replica-id", "opt-barrier", "add-dependency"}


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
            # a floating-point reduction in its own kernel is a norm's (RMSNorm: sum of squares); integer ones are
            # index arithmetic (e.g. searchsorted by compare-and-count)
            if re.search(r"= (?:f32|bf16|f16|f64)\[[^\]]*\]\S* reduce\(", body):
                return "triton block-level fusion (normalization)"
            return "triton block-level fusion" + (" (integer reduce)" if " reduce(" in body else "")
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
        if tgt.startswith("mosaic_gpu"):
            return "attention (Mosaic GPU custom call)"
        return f"custom call ({tgt})"
    return op


def entry_kernels(hlo: str) -> list[dict]:
    """The launches of the entry computation in schedule order (the optimized module is scheduled)."""
    comps = split_computations(hlo)
    out = []
    for ins in parse(comps[entry_name(hlo)]):
        if ins.op in NO_LAUNCH:
            continue
        if ins.op in ("while", "conditional", "call"):
            kind = ins.op        # control flow: its body's kernels are listed separately (sampling, fp8 requant)
        else:
            kind = classify(ins.name, ins.op, ins.attrs, comps)
        out.append({"name": ins.name, "op": ins.op, "kind": kind, "params": len(ins.operands),
                    "shape": ins.shape[:80], "src": source(ins.attrs)})
    return out


def source(attrs: str) -> str:
    """Where a kernel comes from: the first jitted function inside the step named in its op_name metadata
    ('jit(body)/jit(paged_attention_gpu)/jit(searchsorted)/...' -> 'paged_attention_gpu'), '' for the step's own
    ops ('jit(body)/gather')."""
    m = re.search(r'op_name="([^"]*)"', attrs)
    scopes = re.findall(r"jit\(([\w.<>\-]+)\)", m.group(1)) if m else []
    return scopes[1] if len(scopes) > 1 else ""


def is_attention(k: dict) -> bool:
    return k["kind"].startswith("attention") or "mosaic" in k["kind"]


def is_kv_write(k: dict) -> bool:
    return "scatter" in k["kind"]


def per_layer(kernels: list[dict], n_layers: int, anchor) -> tuple[list[list[dict]], list[dict], list[dict]]:
    """Split the schedule at the kernels matched by `anchor` (the same number k >= 1 per layer, in layer order: a
    layer's attention depends on the previous layer's output): a layer starts at its first anchor, so the runs between
    consecutive layers' first anchors are whole layers (n_layers - 1 of them); what comes before the first anchor is
    `head`, from the last layer's first anchor on `tail`."""
    idx = [i for i, k in enumerate(kernels) if anchor(k)]
    if not idx or len(idx) % n_layers:
        raise RuntimeError(f"expected a multiple of {n_layers} anchor kernels (the same number per layer), found "
                           f"{len(idx)}: {[kernels[i]['name'] for i in idx]}")
    first = idx[:: len(idx) // n_layers]
    layers = [kernels[first[i]: first[i + 1]] for i in range(n_layers - 1)]
    return layers, kernels[: first[0]], kernels[first[-1]:]


def build(layers: int, batch: int, ctx: int, page: int, layer_buffers: str, attn_impl: str, config: str | None,
          fold: bool = False, weight_dtype: str = "bf16", program: str = "decode"):
    """The engine's step program (ModelRunner on a one-GPU sm_90 topology mesh, abstract weights and pools) for the
    token bucket of a decode batch of `batch` sequences: T = bucket(batch) tokens, S = min(T, max_num_seqs = batch)
    sequence slots, block tables ctx // page wide. program: "decode" = what a decode-only step of that batch runs
    (the bucket's decode program where it has one, runner.decode_buckets), "mixed" = the bucket's program for steps
    with prompt chunks. Returns (spec, runner, bucket, compiled)."""
    from sharding.mesh import DecodeLayout
    from tbjax.spec import ModelSpec

    with open(config or CONFIG) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers
    spec = ModelSpec.from_hf_config(cfg).replace(dtype="bfloat16")
    runner = abstract_runner(spec, gpu_mesh(1), DecodeLayout(), kv_pages=1 + batch * (ctx // page), page_size=page,
                             max_num_seqs=batch, max_tokens=batch, max_pages_per_seq=ctx // page,
                             attn_impl=attn_impl, matmul_impl="auto", layer_buffers=layer_buffers, fold_norms=fold,
                             weight_dtype=weight_dtype)
    bucket = runner._bucket_for(batch)
    decode_only = program == "decode" and bucket in runner.decode_buckets
    return spec, runner, bucket, compile_bucket(runner, bucket, decode_only=decode_only)


def analyse(hlo: str, n_layers: int) -> dict:
    ks = entry_kernels(hlo)
    # layers start at the attention kernel; with the jnp attention (no custom call) at the KV write
    anchor = is_attention if any(is_attention(k) for k in ks) else is_kv_write
    layers, head, tail = per_layer(ks, n_layers, anchor)
    counts = [len(L) for L in layers]
    kinds = collections.Counter(k["kind"] for k in layers[-1]) if layers else {}
    srcs = collections.Counter(k["src"] or "(step)" for k in layers[-1]) if layers else {}
    return {"kernels_per_layer": counts[-1] if counts else None, "layer_counts": counts,
            "kinds_per_layer": dict(sorted(kinds.items())), "sources_per_layer": dict(sorted(srcs.items())),
            "total_kernels": len(ks),
            # entry-level control flow: XLA:GPU copies a conditional's predicate (and a while loop's condition,
            # unless its trip count is known) to the host and waits, which blocks the step's dispatch
            "control_flow": [{x: k[x] for x in ("name", "op", "src")} for k in ks if k["op"] in ("while", "conditional")],
            "layers": [[{x: k[x] for x in ("name", "kind", "params", "shape", "src")} for k in L] for L in layers],
            "head": [{x: k[x] for x in ("name", "kind", "params", "shape")} for k in head],
            "tail": [{x: k[x] for x in ("name", "kind", "params", "shape")} for k in tail]}


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
        lines.append("   by source (jitted function in the op_name): " + ", ".join(
            f"{k} {n}" for k, n in r["sources_per_layer"].items()))
        lines.append("   schedule of the last whole layer: " + ", ".join(
            f"{k['name']}[{k['kind']}, {k['params']} ops{', ' + k['src'] if k['src'] else ''}]"
            for k in r["layers"][-1]))
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
    files = sorted(f for f in os.listdir(dump_dir) if f.endswith(".thunk_sequence_after_thunk_passes.txt")
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
    ap.add_argument("--program", default="decode", choices=["decode", "mixed"],
                    help="decode: what a decode-only step runs (its bucket's decode program where there is one); "
                         "mixed: the bucket's program for steps with prompt chunks")
    ap.add_argument("--no-thunks", action="store_true", help="skip the thunk-sequence dump (command buffers)")
    ap.add_argument("--dump", default=None, help="write each optimized HLO to <dump>.<variant>.txt")
    ap.add_argument("--json", default=None, help="also write the JSON here")
    ap.add_argument("--quiet", action="store_true", help="only the JSON line")
    ap.add_argument("--weight-dtype", default="bf16", choices=["bf16", "fp8", "fp8-block", "int8", "int4"],
                    help="resident format of the matrices (QuantizedWeights; what the decode projections read)")
    a = ap.parse_args(argv)
    if a.layers < 2:
        raise SystemExit("--layers must be >= 2 (a whole layer lies between two layers' first attention launches)")
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
        spec, runner, bucket, compiled = build(a.layers, a.batch, a.ctx, a.page, lb, a.attn_impl, a.config, fold=fold,
                                               weight_dtype=a.weight_dtype, program=a.program)
        hlo = compiled.as_text()
        if a.dump:
            with open(f"{a.dump}.{name.replace(':', '_')}.txt", "w") as f:
                f.write(hlo)
        r = analyse(hlo, a.layers)
        mem = compiled.memory_analysis()
        entry = re.search(r"^ENTRY [^(]*\((.*)\) ->", hlo, re.M)
        r.update(entry_parameters=len(re.findall(r"\w+: ", entry.group(1))) if entry else None,
                 temp_bytes=int(mem.temp_size_in_bytes), argument_bytes=int(mem.argument_size_in_bytes))
        r.update(variant=name, weight_dtype=a.weight_dtype, layer_buffers=lb, folded_norms=fold,
                 attn_impl=a.attn_impl, batch=a.batch, ctx=a.ctx,
                 n_layers=a.layers, bucket=bucket, sequence_slots=runner.seqs_for(bucket), program=a.program,
                 decode_program=a.program == "decode" and bucket in runner.decode_buckets,
                 pages_per_seq=runner.max_pages)
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
