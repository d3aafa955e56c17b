"""Pipeline-parallel prefill benchmark: prompt tokens/s and model FLOP utilization for pp = 1, 2, ... stages.

Why it exists: tbjax prefills on one DP replica whose layers are split over a `pp` axis by FLOPs
(tbjax/prefill_pipeline.py); this measures whether the stages overlap (pp stages should approach pp x the
single-stage throughput once there are many more chunks than stages) and the FLOP rate against the device's
matmul peak measured in the same run (a large bf16 matmul).

Usage (multi-GPU kind):  python3 benchmarks/bench_prefill_pipeline.py --config llama-3.1-8b --layers 8 \
                             --prompt 8192 --chunk 1024 --pp 1,2 --out $OUT/prefill_pp.json
       (CPU smoke):      python benchmarks/bench_prefill_pipeline.py --smoke
Random weights at the config's shapes (--layers cuts the layer count so one GPU holds a stage). Prints a table and
writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama-3.1-8b", help="JSON in benchmarks/configs/")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--pp", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU: SmolLM2 shapes, 4 layers, 4 fake devices")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4")
        a.config, a.layers, a.prompt, a.chunk, a.pp, a.reps, a.dtype = "smollm2-135m-instruct", 4, 64, 16, "1,2", 1, \
            "float32"

    import jax
    import jax.numpy as jnp
    import numpy as np

    from tbjax.model import init_params
    from tbjax.prefill_pipeline import PipelinePrefill, layer_flops_per_token, split_layers
    from tbjax.spec import ModelSpec

    spec = ModelSpec.from_hf_config(os.path.join(HERE, "configs", a.config + ".json")).replace(n_layers=a.layers)
    devs = jax.devices()
    res = {"config": a.config, "layers": a.layers, "prompt": a.prompt, "chunk": a.chunk, "dtype": a.dtype,
           "devices": [str(d) for d in devs], "date": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": []}

    # ceiling: a large matmul on one device, same run
    n = 8192 if devs[0].platform == "gpu" else 512
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(a.dtype))
    mm = jax.jit(lambda x: x @ x)
    mm(x).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        mm(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    res["matmul_peak_TFLOPs"] = 2 * n ** 3 / statistics.median(ts) / 1e12
    del x

    params = init_params(spec, jax.random.key(1), a.dtype)
    flops_tok = sum(layer_flops_per_token(spec, a.prompt // 2))
    ids = np.random.default_rng(0).integers(0, spec.vocab_size, a.prompt)
    for pp in [int(p) for p in a.pp.split(",")]:
        if pp > len(devs):
            res["runs"].append({"pp": pp, "skipped": f"only {len(devs)} devices"})
            continue
        pipe = PipelinePrefill(spec, params, devs[:pp], chunk_tokens=a.chunk, max_len=a.prompt)
        t = time.perf_counter()
        logits, _ = pipe.prefill(ids)
        np.asarray(logits)
        first = time.perf_counter() - t
        ts = []
        for _ in range(a.reps):
            t = time.perf_counter()
            logits, kv = pipe.prefill(ids)
            np.asarray(logits)
            jax.block_until_ready(kv)
            ts.append(time.perf_counter() - t)
        s = statistics.median(ts)
        r = {"pp": pp, "stages": [[r.start, r.stop] for r in split_layers(spec, pp, a.prompt // 2)],
             "first_call_s": first, "prefill_s": s, "tok_s": a.prompt / s,
             "TFLOPs_total": flops_tok * a.prompt / s / 1e12}
        r["TFLOPs_per_device"] = r["TFLOPs_total"] / pp
        r["util_vs_peak"] = r["TFLOPs_per_device"] / res["matmul_peak_TFLOPs"]
        res["runs"].append(r)
        del pipe
    base = next((r for r in res["runs"] if r.get("pp") == 1 and "tok_s" in r), None)
    print(f"prefill pipeline: {a.config} x {a.layers} layers, prompt {a.prompt}, chunk {a.chunk}, "
          f"matmul peak {res['matmul_peak_TFLOPs']:.0f} TFLOP/s ({devs[0].platform})")
    print("| pp | stages | prefill s | tok/s | x pp=1 | TFLOP/s per device | of peak |")
    print("|---|---|---|---|---|---|---|")
    for r in res["runs"]:
        if "tok_s" not in r:
            print(f"| {r['pp']} | {r['skipped']} |")
            continue
        sp = r["tok_s"] / base["tok_s"] if base else float("nan")
        print(f"| {r['pp']} | {r['stages']} | {r['prefill_s']:.3f} | {r['tok_s']:.0f} | {sp:.2f} | "
              f"{r['TFLOPs_per_device']:.1f} | {100 * r['util_vs_peak']:.0f}% |")
    outs = [a.out] if a.out else []
    if os.environ.get("OUT"):
        outs.append(os.path.join(os.environ["OUT"], "bench_prefill_pipeline.json"))
    for p in outs:
        write_json(p, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
