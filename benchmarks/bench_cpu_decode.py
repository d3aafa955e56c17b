"""CPU batch-1 greedy decode of the default model per resident weight format (issues 16 and 20), against a
memory-copy floor and llama.cpp on the same GGUF, measured in the same run.

Why: `tbjax.LLM()` on a CPU is the first thing a new user runs; decode at batch 1 streams every weight byte once per
token, so the floor is (resident weight bytes) / (copy bandwidth), measured here with numpy on a buffer of those bytes.

For each format (--formats, default bf16,int8,auto; auto = the GGUF's Q4_1/Q8_0 as int4/int8) one process-local
`tbjax.LLM(weight_dtype=...)` generates --new-tokens greedy tokens (ignore_eos) from a short prompt, --reps times;
tokens/s = new tokens / wall seconds of a whole `generate` call (prefill of the short prompt included), best and
median reported; the CPU seconds of the process per token are reported too (a busy shared box inflates wall time).
llama.cpp: `llama_cpp.Llama(path, n_threads=os.cpu_count())` with the same prompt and token count, if importable.
The load average is printed before and after (noise).

Usage: python benchmarks/bench_cpu_decode.py [--formats bf16,int8,auto] [--new-tokens 64] [--reps 3] [--out f.json]
Writes the JSON (with a `commit` field) to --out and, when $OUT is set, to $OUT/bench_cpu_decode.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

os.environ.setdefault("TBJAX_WARMUP", "0")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Once upon a time there was"


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return "unknown"


def copy_floor(nbytes: int, reps: int = 7) -> float:
    """Best read bandwidth (bytes/s) of np.copyto over a buffer of nbytes (counting the bytes read once)."""
    import numpy as np
    a = np.ones(max(nbytes // 8, 1)); b = np.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best


def bench_tbjax(fmt: str, new_tokens: int, reps: int) -> dict:
    import numpy as np

    import tbjax
    from tbjax.model import quant as qz
    from tbjax.sampling import SamplingParams
    llm = tbjax.LLM(None, weight_dtype=fmt, progress=False, warmup=False, num_pages=256, max_num_seqs=2,
                    max_num_batched_tokens=64)
    nbytes = qz.resident_bytes(llm.params)["total"]
    p = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPT, p)                                   # compiles the prefill and decode buckets
    rates, cpu = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        o = llm.generate(PROMPT, p)[0]
        dt, dc = time.perf_counter() - t, time.process_time() - c
        rates.append(len(o.token_ids) / dt)
        cpu.append(dc / len(o.token_ids) * 1e3)
    floor = copy_floor(nbytes)
    return {"format": fmt, "resident_mb": nbytes / 1e6, "tok_s_best": max(rates), "tok_s_median": float(np.median(rates)),
            "cpu_ms_per_token": min(cpu), "floor_read_gb_s": floor / 1e9, "floor_tok_s": floor / nbytes,
            "text": o.text[:80]}


def bench_llama_cpp(new_tokens: int, reps: int) -> dict | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    from tbjax.default_model import default_model_path
    llm = llama_cpp.Llama(default_model_path(), n_threads=os.cpu_count(), verbose=False, n_ctx=512)
    llm(PROMPT, max_tokens=4, temperature=0.0)
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        out = llm(PROMPT, max_tokens=new_tokens, temperature=0.0)
        rates.append(out["usage"]["completion_tokens"] / (time.perf_counter() - t))
    return {"format": "llama.cpp Q4_1", "tok_s_best": max(rates), "version": llama_cpp.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--formats", default="bf16,int8,auto")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    load0 = os.getloadavg()
    rows = [bench_tbjax(f, a.new_tokens, a.reps) for f in a.formats.split(",")]
    ll = bench_llama_cpp(a.new_tokens, a.reps)
    res = {"commit": commit(), "hardware": f"{os.cpu_count()}-core CPU dev box", "new_tokens": a.new_tokens,
           "reps": a.reps, "load_avg_before": load0, "load_avg_after": os.getloadavg(), "tbjax": rows,
           "llama_cpp": ll}
    print(f"{'format':8s} {'MB':>7s} {'tok/s best':>10s} {'median':>7s} {'cpu ms/tok':>10s} {'floor tok/s':>11s}")
    for r in rows:
        print(f"{r['format']:8s} {r['resident_mb']:7.1f} {r['tok_s_best']:10.1f} {r['tok_s_median']:7.1f} "
              f"{r['cpu_ms_per_token']:10.1f} {r['floor_tok_s']:11.1f}")
    print("llama.cpp:", "not installed" if ll is None else f"{ll['tok_s_best']:.1f} tok/s ({ll['version']})")
    print(f"load average before {load0}, after {res['load_avg_after']}")
    for path in [a.out, os.path.join(os.environ["OUT"], "bench_cpu_decode.json") if os.environ.get("OUT") else None]:
        if path:
            with open(path, "w") as f:
                json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
