"""Start-up benchmark: how long until tbjax is ready (every step program compiled), cold and warm, and whether
anything compiles after that.

Why it exists: on a GPU, compiles dominated serving (dozens of programs, 10-47 s each, several of them during the
first loads). The engine now compiles a short fixed list of step programs before it reports ready; this measures
what a user waits for, in separate processes, with an empty persistent compile cache (cold) and with the cache the
cold run left (warm).

Sections (each one process, under its own time limit; results are printed as a table and written as JSON):
  engine    `Engine(...)` + `Engine.warmup()` at a config's shapes (random weights; default Llama-3.1-8B): seconds
            to build, to compile every program, number of programs and of backend compiles.
  serve     `python -m tbjax.serve --model synthetic` (SmolLM2-135M shapes, random weights): seconds from process
            start to the "serving" line (printed after warm-up) and to gRPC health SERVING.
  load      right after a warm serve is ready: benchmarks/load_test.py against it (default 256 requests, 64 in
            flight), twice with new prompts; the server's XLA compile counter (/metrics tbjax_xla_compiles_total)
            before and after each pass (goal: 0), and each pass's throughput (the first must match the second).

Usage (H200):  python3 benchmarks/bench_ready.py --out ready.json
       (CPU):  python benchmarks/bench_ready.py --smoke
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import add_options, git_commit, json_saver  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MARK = "READYRESULT "


def engine_worker(args) -> None:
    t0 = time.perf_counter()
    import jax

    sys.path.insert(0, REPO)
    sys.path.insert(0, HERE)
    from bench_common import compile_timer
    from bench_generate import synthetic_tokenizer
    from tbjax import compile_cache
    from tbjax.engine.engine import Engine, EngineConfig
    from tbjax.model import init_params
    from tbjax.spec import ModelSpec

    compile_cache.enable()
    acc = compile_timer()
    n_compiles = [0]
    jax.monitoring.register_event_duration_secs_listener(
        lambda ev, d, **kw: n_compiles.__setitem__(0, n_compiles[0] + 1)
        if ev == "/jax/core/compile/backend_compile_duration" else None)
    with open(os.path.join(HERE, "configs", args.config + ".json")) as f:
        spec = ModelSpec.from_hf_config(json.load(f))
    if args.layers:
        spec = spec.replace(n_layers=args.layers)
    params = jax.jit(init_params, static_argnums=(0, 2))(spec, jax.random.key(0), "bfloat16")
    jax.block_until_ready(params)
    t_weights = time.perf_counter() - t0
    kw = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, num_pages=args.num_pages)
    if args.layer_buffers:
        kw["layer_buffers"] = args.layer_buffers
    t1 = time.perf_counter()
    eng = Engine(spec, params, synthetic_tokenizer(spec.vocab_size), EngineConfig(**kw))
    t_build = time.perf_counter() - t1
    c0 = n_compiles[0]
    info = eng.warmup(progress=False)
    res = {"config": args.config, "layers": spec.n_layers, "weights_s": t_weights, "engine_build_s": t_build,
           "warmup_s": info["seconds"], "programs": info["programs"], "buckets": list(eng.runner.buckets),
           "backend_compiles": n_compiles[0] - c0, "compile_s": dict(acc),
           "layer_buffers": eng.runner.layer_buffers, "ready_s": time.perf_counter() - t0, **kw}
    print(MARK + json.dumps(res), flush=True)


def _run_engine(args, cache_dir, label) -> dict:
    env = dict(os.environ, TBJAX_COMPILE_CACHE=cache_dir)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "engine", "--config", args.config,
           "--layers", str(args.layers), "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-model-len", str(args.max_model_len),
           "--num-pages", str(args.num_pages), "--layer-buffers", args.layer_buffers]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.t_engine)
    except subprocess.TimeoutExpired:
        return {"label": label, "error": f"timeout after {args.t_engine} s"}
    out = {"label": label, "process_s": time.perf_counter() - t, "rc": p.returncode}
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            out.update(json.loads(line[len(MARK):]))
    if p.returncode:
        out["stderr_tail"] = p.stderr[-2000:]
    return out


def _metric(port: int, name: str) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except Exception:  # noqa: BLE001
        return None
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith(name + "_created"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def _serve(args, cache_dir, label, load: bool) -> dict:
    """Start the server, time it to ready; optionally run the load passes against it; stop it."""
    # the GGUF header index lives beside the compile cache, so "cold" parses the file and "warm" maps it
    env = dict(os.environ, TBJAX_COMPILE_CACHE=cache_dir, TBJAX_GGUF_INDEX=os.path.join(cache_dir, "gguf-index"),
               PYTHONUNBUFFERED="1")
    model = [] if args.serve_model == "default" else ["--model", args.serve_model]
    cmd = [sys.executable, "-m", "tbjax.serve", *model, "--port", "0", "--metrics-port", "0",
           "--max-num-seqs", str(args.serve_max_num_seqs)] + args.serve_args.split()
    res = {"label": label, "cmd": " ".join(cmd[1:])}
    t0 = time.perf_counter()
    err_f = tempfile.TemporaryFile("w+")     # the server's stderr (its start-up lines go into the result)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_f, text=True, env=env, cwd=REPO)
    addr = metrics_port = None
    err_lines: list[str] = []

    def stderr_lines(n: int) -> list[str]:
        err_f.flush()
        err_f.seek(0)
        return err_f.read().splitlines()[-n:]
    try:
        deadline = t0 + args.t_serve
        while time.perf_counter() < deadline:
            line = proc.stdout.readline()
            if not line:
                if proc.poll() is not None:
                    break
                continue
            m = re.search(r"serving .*? on (\S+:\d+)", line)
            if m:
                addr = m.group(1)
                res["ready_line_s"] = time.perf_counter() - t0
                mm = re.search(r"metrics on http://[^:]+:(\d+)", line)
                metrics_port = int(mm.group(1)) if mm else None
                break
        if addr is None:
            proc.kill()
            proc.wait()
            err_lines = stderr_lines(30)
            res["error"] = "no serving line" + (f" (exit {proc.returncode})" if proc.returncode is not None else "")
            res["stderr_tail"] = "\n".join(err_lines)
            return res
        sys.path.insert(0, REPO)
        from serving.client import Client
        c = Client(addr)
        while time.perf_counter() < deadline:
            try:
                if c.health() == "SERVING":
                    res["health_serving_s"] = time.perf_counter() - t0
                    break
            except Exception:  # noqa: BLE001
                pass
            time.sleep(0.05)
        if metrics_port:
            res["compiles_at_ready"] = _metric(metrics_port, "tbjax_xla_compiles_total")
        res["startup_lines"] = [ln for ln in stderr_lines(200) if ln.startswith("tbjax:")][:20]
        # the program cache as this start found and left it: a warm start that compiles again says why here
        progs = os.path.join(cache_dir, "tbjax-programs")
        res["saved_programs"] = len([f for f in os.listdir(progs) if f.endswith(".bin")]) if os.path.isdir(progs) else 0
        res["program_cache_lines"] = [ln for ln in stderr_lines(400)
                                      if "saved step program" in ln or "could not save step program" in ln][:10]
        if load:
            res["passes"] = []
            for i in range(args.load_passes):
                c0 = _metric(metrics_port, "tbjax_xla_compiles_total") if metrics_port else None
                out_json = os.path.join(tempfile.gettempdir(), f"ready_load_{i}.json")
                lcmd = [sys.executable, os.path.join(HERE, "load_test.py"), "--target", addr,
                        "--num-requests", str(args.load_n), "--concurrency", str(args.load_c),
                        "--prompt-len", args.load_prompt, "--output-len", args.load_output, "--seed", str(100 + i),
                        "--warmup", "0", "--out", out_json]
                t = time.perf_counter()
                lp = subprocess.run(lcmd, capture_output=True, text=True, timeout=args.t_load, cwd=REPO)
                p = {"pass": i, "wall_s": time.perf_counter() - t, "rc": lp.returncode}
                if os.path.exists(out_json):
                    with open(out_json) as f:
                        rep = json.load(f)
                    summ = rep.get("summary", rep)
                    for k in ("completed", "failed", "output_token_throughput", "request_throughput"):
                        if k in summ:
                            p[k] = summ[k]
                    for k in ("ttft_s", "e2e_s", "tpot_s"):
                        if k in summ and isinstance(summ[k], dict):
                            p[k] = {q: summ[k].get(q) for q in ("p50", "p99", "mean")}
                else:
                    p["stderr_tail"] = lp.stderr[-1500:]
                if metrics_port:
                    c1 = _metric(metrics_port, "tbjax_xla_compiles_total")
                    p["compiles_during"] = None if c0 is None or c1 is None else c1 - c0
                res["passes"].append(p)
        return res
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        err_f.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["engine"], default=None, help=argparse.SUPPRESS)
    add_options(ap, {"--sections": "engine,serve,load", "--config": "llama-3.1-8b"})
    add_options(ap, {"--layers": 0, "--max-num-seqs": 32, "--max-num-batched-tokens": 512, "--max-model-len": 4096,
                     "--num-pages": 8192}, int)
    ap.add_argument("--layer-buffers", default="", help=argparse.SUPPRESS)
    ap.add_argument("--engine-variants", default="",
                    help="comma-separated EngineConfig.layer_buffers values for the engine section ('' = default)")
    ap.add_argument("--serve-max-num-seqs", type=int, default=64)
    ap.add_argument("--serve-model", default="synthetic",
                    help="model of the serve section: synthetic (SmolLM2 shapes, random weights), default, or a path")
    ap.add_argument("--serve-args", default="", help="extra arguments for python -m tbjax.serve")
    add_options(ap, {"--load-n": 256, "--load-c": 64}, int)
    add_options(ap, {"--load-prompt": "uniform:8:512", "--load-output": "uniform:16:128"})
    ap.add_argument("--load-passes", type=int, default=2)
    add_options(ap, {"--t-engine": 240, "--t-serve": 180, "--t-load": 120}, float)
    ap.add_argument("--smoke", action="store_true", help="CPU: SmolLM2 shapes, 2 layers, a small load")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.config, args.layers, args.num_pages, args.max_model_len = "smollm2-135m-instruct", 2, 512, 1024
        args.max_num_batched_tokens, args.load_n, args.load_c, args.serve_max_num_seqs = 64, 16, 8, 8
        args.load_prompt, args.load_output = "uniform:4:40", "8"
        args.serve_args = (args.serve_args + " --num-pages 512 --max-model-len 1024 --max-num-batched-tokens 64").strip()
    if args.worker == "engine":
        engine_worker(args)
        return 0
    sys.path.insert(0, REPO)
    res = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "results": []}
    save = json_saver(args.out, "bench_ready.json", res)

    sections = args.sections.split(",")
    if "engine" in sections:
        for n, lb in enumerate(args.engine_variants.split(",")):     # the first variant cold and warm, others cold
            cache = tempfile.mkdtemp(prefix="tbjax-ready-engine-")
            for label in (("cold", "warm") if n == 0 else ("cold",)):
                r = _run_engine(argparse.Namespace(**{**vars(args), "layer_buffers": lb}), cache,
                                f"engine {args.config} {lb or 'default'} {label}")
                res["results"].append(r)
                print(json.dumps(r), flush=True)
                save()
            shutil.rmtree(cache, ignore_errors=True)
    if "serve" in sections or "load" in sections:
        cache = tempfile.mkdtemp(prefix="tbjax-ready-serve-")
        labels = (["cold"] if "serve" in sections else []) + ["warm"]
        for label in labels:
            r = _serve(args, cache, f"serve {args.serve_model} {label}", load=("load" in sections and label == "warm"))
            res["results"].append(r)
            print(json.dumps(r), flush=True)
            save()
        shutil.rmtree(cache, ignore_errors=True)
    print(f"\n{'run':<34}{'ready s':>10}{'programs':>10}{'compiles':>10}")
    for r in res["results"]:
        ready = r.get("ready_s", r.get("health_serving_s", r.get("ready_line_s")))
        print(f"{r['label']:<34}{(ready if ready is not None else float('nan')):>10.1f}"
              f"{str(r.get('programs', '-')):>10}{str(r.get('backend_compiles', r.get('compiles_at_ready', '-'))):>10}")
        for p in r.get("passes", []):
            print(f"  load pass {p['pass']}: {p.get('completed')} done, {p.get('output_token_throughput', 0):.0f} "
                  f"out tok/s, compiles during: {p.get('compiles_during')}, ttft {p.get('ttft_s')}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
