"""Compile the sampler (tbjax.sampling.sample, branchless, as the GPU engine runs it) for an sm_90 GPU WITHOUT a GPU
and report what its optimized HLO writes to memory: per entry instruction the bytes of its outputs, the largest ones
first. A sampler over [B, V] logits should write nothing much larger than [B, V]; a [B, D, V] output means a mask
XLA chose to write out instead of fusing it into its reductions (the kept-set search's count and sum once shared one
mask, and the sampler then cost 8.4 ms at B = 256 on an H100 instead of about a millisecond).

    PYTHONPATH=/tmp/cuda12plugin JAX_PLATFORMS=cpu python scripts/gpu_hlo_sampler.py --batch 256 [--what keep-shared]

Prints a table, then one JSON line: {"batch", "vocab", "what", "fusions", "written_bytes", "largest_array_elements",
"largest": [{name, op, bytes, max_elements, shape}, ...]} (used by tests/engine/test_sampling.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from gpu_hlo_overlap import gpu_mesh  # noqa: E402  (also strips the test suite's fast-compile XLA flags)

_BYTES = {"f32": 4, "s32": 4, "u32": 4, "pred": 1, "bf16": 2, "f16": 2, "u8": 1, "s8": 1, "s64": 8, "u64": 8}
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][\w-]*)\(")
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")


def written(entry_lines: list[str]) -> list[dict]:
    """Per entry instruction that writes memory (fusions, custom calls, copies, reductions...): bytes of its outputs."""
    out = []
    for line in entry_lines:
        m = _INSTR.match(line)
        if not m or m.group(3) in ("parameter", "get-tuple-element", "bitcast", "tuple", "constant"):
            continue
        arrays = _ARRAY.findall(m.group(2))
        n, most = 0, 0
        for dt, dims in arrays:
            size = 1
            for d in filter(None, dims.split(",")):
                size *= int(d)
            n += _BYTES[dt] * size
            most = max(most, size)
        out.append({"name": m.group(1), "op": m.group(3), "bytes": n, "max_elements": most,
                    "shape": ", ".join(f"{dt}[{dims}]" for dt, dims in arrays)})
    return sorted(out, key=lambda r: -r["bytes"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--what", choices=("sample", "keep", "keep-shared"), default="sample",
                    help="the whole sampler, or its kept-set search alone (keep-shared: one mask for count and sum)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from tbjax import sampling
    sh = SingleDeviceSharding(gpu_mesh(1).devices.flat[0])
    B, V = a.batch, a.vocab

    def arg(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    args = (arg((B, V), jnp.float32), arg((B,), jnp.float32), arg((B,), jnp.int32), arg((B,), jnp.float32),
            arg((B,), jnp.float32), arg((B,), jnp.int32), arg((B,), jnp.int32))
    def f(lg, t, k, p, m, seed, pos):
        if a.what == "sample":
            return sampling.sample(lg, t, k, p, m, seed, pos, branchless=True)[0]
        x = lg / jnp.where(t > 0, t, 1.0)[:, None]        # the kept-set search alone, as sample calls it
        lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)
        return sampling._keep_by_threshold(x, lse, k, p, m, shared_mask=a.what == "keep-shared")
    hlo = jax.jit(f).trace(*args).lower().compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):].splitlines()[2:]
    rows = written(entry)
    res = {"batch": B, "vocab": V, "what": a.what,
           "fusions": sum(r["op"] == "fusion" for r in rows), "written_bytes": sum(r["bytes"] for r in rows),
           "largest_array_elements": max((r["max_elements"] for r in rows), default=0),
           "largest": rows[:12]}
    if not a.quiet:
        print("| MB written | op | instruction | outputs |\n|---|---|---|---|")
        for r in rows[:12]:
            print(f"| {r['bytes'] / 1e6:.1f} | {r['op']} | {r['name']} | {r['shape'][:100]} |")
        print(f"{res['fusions']} fusions, {res['written_bytes'] / 1e6:.1f} MB written in all")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
