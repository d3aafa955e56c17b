"""Compile the decode-mesh forward for an 8-GPU target WITHOUT a GPU and report how the per-layer attention-weight
gather is scheduled in the optimized HLO (used by tests/test_sharding_hlo.py; runnable by hand).

Needs the CUDA 12 PJRT plugin importable (it is NOT a dependency of tbjax):
    pip install --no-deps --target /tmp/cuda12plugin jax-cuda12-plugin==0.11.2 jax-cuda12-pjrt==0.11.2
    PYTHONPATH=/tmp/cuda12plugin JAX_PLATFORMS=cpu python scripts/gpu_hlo_overlap.py
It compiles against `jax.experimental.topologies.get_topology_desc(..., "cuda")` with the H100 target config in
tests/data/gpu_targets (a copy of ../shared/gpu_targets; sm_90, the H200 is the same chip), prints one JSON object:
  {"while_bodies": [{"name", "buffer_collectives": [{"kind", "start", "done", "score_dots_between"}]}], ...}
"score dots" are the attention-score matmuls (f32[N, T, T] with N heads and T tokens per device), i.e. the
attention compute of a layer. Overlap means: in the layer loop body, a buffer gather starts before a score dot
and is done after it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TARGET = os.environ.get("TBJAX_GPU_TARGET_CONFIG",
                        os.path.join(ROOT, "tests", "data", "gpu_targets", "h100_sxm.txtpb"))


def split_computations(hlo: str) -> dict[str, list[str]]:
    comps, cur = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps[cur] = []
        elif cur is not None:
            comps[cur].append(line)
    return comps


def analyse(hlo: str, shard_bytes: int, n_heads: int, t_local: int) -> dict:
    comps = split_computations(hlo)
    bodies = set(re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo))
    score = re.compile(rf"= f32\[{n_heads},(?:1,)?{t_local},{t_local}\]\S* fusion\(.*calls=%gemm")
    out = []
    for name in sorted(bodies):
        lines = comps.get(name, [])
        found = []
        for kind in ("all-gather", "collective-permute"):
            starts = {}
            for i, ln in enumerate(lines):
                m = re.match(rf"\s*%([\w.\-]+) = .* {kind}-start\((.*)", ln)
                if m and f"u8[{shard_bytes}]" in ln:
                    starts[m.group(1)] = i
                m = re.match(rf"\s*%[\w.\-]+ = .* {kind}-done\(%([\w.\-]+)\)", ln)
                if m and m.group(1) in starts:
                    s = starts[m.group(1)]
                    found.append({"kind": kind, "start": s, "done": i,
                                  "score_dots_between": sum(1 for x in lines[s:i] if score.search(x))})
        n_sync = sum(1 for x in lines if re.search(r"= u8\[\d+\]\S* all-gather\(", x))
        out.append({"name": name, "buffer_collectives": found, "sync_buffer_all_gathers": n_sync,
                    "score_dots": sum(1 for x in lines if score.search(x))})
    return {"while_bodies": out}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="all_gather:gather,all_gather:all_to_all,ppermute:gather",
                    help="comma-separated <attn gather>:<ep mode> pairs; gather 'replicated' = no sharding")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--tokens-per-device", type=int, default=24)
    ap.add_argument("--dump", default=None, help="write each optimized HLO to <dump>.<variant>.txt")
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec as P

    sys.path.insert(0, ROOT)
    from sharding import rules as sr
    from sharding.mesh import DecodeLayout
    from tbjax.model import mesh_forward as mf
    from tbjax.spec import ModelSpec

    with open(TARGET) as f:
        topo = topologies.get_topology_desc("h100x8", "cuda", target_config=f.read(), topology="1x1x8")
    devs = np.array(topo.devices).reshape(8, 1, 1, 1)
    mesh = jax.sharding.Mesh(devs, ("dp", "ep", "tp", "pp"), axis_types=(jax.sharding.AxisType.Explicit,) * 4)
    # A DeepSeek-V3-shaped model (MLA + group-routed MoE with a shared expert), scaled down.
    with open(os.path.join(ROOT, "tests", "data", "hf_moe", "deepseek_v3", "config.json")) as f:
        cfg = json.load(f)
    D = a.hidden
    cfg.update(hidden_size=D, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=D // 2,
               kv_lora_rank=D // 4, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
               moe_intermediate_size=D // 4, intermediate_size=2 * D, n_routed_experts=32, n_group=4, topk_group=2,
               num_experts_per_tok=4, num_hidden_layers=a.layers, first_k_dense_replace=1, vocab_size=1024)
    spec = ModelSpec.from_hf_config(cfg).replace(dtype="bfloat16")
    T = 8 * a.tokens_per_device
    tok = jax.ShapeDtypeStruct((T,), jnp.int32, sharding=NamedSharding(mesh, P(("dp", "ep"))))
    results = []
    for v in a.variants.split(","):
        gather, ep_mode = v.split(":")
        lay = (DecodeLayout(attn_axes=(), ep_mode=ep_mode) if gather == "replicated"
               else DecodeLayout(attn_gather=gather, ep_mode=ep_mode))
        plan = mf.make_plan(spec, mesh, lay)
        tree = mf.abstract_mesh_params(plan)
        shs = sr.shardings(tree, mf.mesh_rules(plan), mesh)
        atree = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shs)
        fwd = mf.make_forward(plan, mesh, tree)
        compiled = fwd.jitted.trace(atree, tok, tok, tok).lower().compile()
        hlo = compiled.as_text()
        if a.dump:
            with open(f"{a.dump}.{gather}.{ep_mode}.txt", "w") as f:
                f.write(hlo)
        res = analyse(hlo, plan.attn_shard_bytes, spec.n_heads, a.tokens_per_device)
        mem = compiled.memory_analysis()
        res.update(gather=gather, ep_mode=ep_mode, devices=str(topo.devices[0].device_kind),
                   shard_bytes=plan.attn_shard_bytes, layer_bytes=plan.attn_layer_bytes,
                   temp_bytes=int(mem.temp_size_in_bytes), argument_bytes=int(mem.argument_size_in_bytes))
        results.append(res)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
