"""Probe: the engine's decode step under several process-wide XLA flag sets, one process per set.

Why it exists: XLA flags are read once per process (pallas_kernels/matmul/flags.py), so choosing the library's
defaults needs a measurement per flag set. Each set runs `bench_engine_decode.py` (no transformers) on a
Llama-3.1-8B-shaped model with fewer layers (shorter compiles; per-layer cost is what differs) and reports the
step time, MBU against the copy ceiling measured in the same process, and compile time.

Usage (H200): python3 benchmarks/probe_decode_flags.py --layers 8 --shapes 32:1024,8:1024 --out $OUT/flags.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

VARIANTS = {
    "default": "",
    "cublas": "--xla_gpu_enable_triton_gemm=false",
    "pdl": "--xla_gpu_enable_pdl=true",
    "cublas+pdl": "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_pdl=true",
    "no_cmdbuf": "--xla_gpu_enable_command_buffer=",
    # RMSNorm became a Triton block-level fusion (kind kCustom) that the residual add before it cannot join. (The
    # softmax-fusion flags session 3 also passed do not exist in jax 0.11.2's XLA: "Unknown flag in XLA_FLAGS"
    # aborts the process, which is why that probe returned nothing. This one exists; in the sm_90 HLO compiled on
    # CPU it leaves the kernel count at 12 per layer: scripts/gpu_hlo_decode.py.)
    "no_triton_norm": "--xla_gpu_experimental_enable_fusion_block_level_rewriter=false",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="default,cublas,pdl,cublas+pdl")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shapes", default="32:1024,8:1024")
    ap.add_argument("--matmul-impl", default="auto")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per variant")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-first", default="", help="SHAPE profiled (and its HLO dumped) in the first variant")
    ap.add_argument("--hlo-dir", default="/tmp")
    args = ap.parse_args(argv)
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "layers": args.layers, "shapes": args.shapes, "variants": {}}
    for i, name in enumerate(args.variants.split(",")):
        flags = VARIANTS[name]
        env = dict(os.environ, XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""), flags]).strip())
        tmp = f"/tmp/probe_flags_{name.replace('+', '_')}.json"
        cmd = [sys.executable, os.path.join(HERE, "bench_engine_decode.py"), "--layers", str(args.layers),
               "--shapes", args.shapes, "--no-hf", "--e2e", "", "--ref-shape", "", "--compare-matmul", "",
               "--profile", "", "--matmul-impl", args.matmul_impl, "--steps", str(args.steps),
               "--time-budget", str(args.timeout - 20), "--out", tmp]
        if i == 0 and args.profile_first:
            cmd[cmd.index("--profile") + 1] = args.profile_first
            cmd += ["--dump-hlo", os.path.join(args.hlo_dir, f"decode_step_{name}.hlo.txt")]
        t = time.time()
        try:
            subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
            with open(tmp) as f:
                r = json.load(f)
        except Exception as e:  # noqa: BLE001
            res["variants"][name] = {"flags": flags, "error": repr(e)[:500]}
            continue
        rows = []
        for v in r.get("jax", {}).get("variants", []):
            if "error" in v:
                rows.append({"shape": f"{v.get('batch')}x{v.get('context')}", "error": v["error"][:300]})
                continue
            rows.append({"shape": f"{v['batch']}x{v['context']}", "sync_ms": v["sync_ms"], "pipe_ms": v["pipe_ms"],
                         "sync_MBU": v.get("sync_MBU"), "pipe_MBU": v.get("pipe_MBU"),
                         "first_call_s": v["first_call_s"], "profile": v.get("profile")})
        res["variants"][name] = {"flags": flags, "ceiling_TBps": r.get("ceiling_TBps"), "rows": rows,
                                 "wall_s": time.time() - t, "jax_error": r.get("jax", {}).get("error")}
        print(f"== {name} ({flags or 'no flags'}): ceiling {r.get('ceiling_TBps')}", flush=True)
        for row in rows:
            print("   ", json.dumps({k: x for k, x in row.items() if k != "profile"}), flush=True)
    if args.out:
        write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
