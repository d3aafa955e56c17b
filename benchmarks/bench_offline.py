"""Offline-batch benchmark: `tbjax.LLM.generate` on a whole batch of requests at once (Llama-3.1-8B shapes by
default: 256 requests, 512-token random prompts, 256 greedy output tokens, eos ignored) against transformers'
`generate` and against a floor from the copy and matmul ceilings, all measured in the same run.

Why it exists: the decode-step benchmarks (bench_engine_decode.py) time one step; a user running a batch job waits
for construction, compiles, chunked prefill, decode and the host loop together. This measures that end to end, in
one device call, so that the ratio to transformers and the fraction of the hardware floor come from the same machine.

Sections (each in its own process under its own time limit; the JSON is rewritten after each one, so a killed
section leaves what was done before it):
  ceiling  jnp device-to-device copy of a 2 GiB buffer (read + write bytes / time) and a bf16 8192^3 jnp.dot
           (TFLOP/s); the same two in torch when it is installed (another process). The highest of each is used.
  tbjax    per engine variant (--variants, each in a fresh process with an empty compile cache): random bf16 weights
           on the device (not timed as part of the cold pass), then the cold pass = `LLM.from_parts` (construct) +
           `engine.warmup()` (every step program compiled) + the first `generate`, then --passes steady passes, each
           on new random prompts (no prefix-cache hits). Per pass: wall s, output tok/s, the engine's steps, the
           prefill and decode tokens the scheduler put in them, the bucket padding and compiles during the pass.
  hf       transformers LlamaForCausalLM from the same config (random bf16 weights on cuda, sdpa), `generate` with
           cache_implementation="static", all requests in one batch, greedy, min_new_tokens = max_new_tokens:
           one warm-up pass (includes transformers' own torch.compile of the decode forward with --hf-compile auto;
           `disable_compile=True` with off), then one timed pass on new prompts. Out of memory at the full batch:
           retried at half the batch, recorded as `batch` and `oom_at_batch`.
Order: ceiling, the first tbjax variant, hf, then the other variants while the --time-budget lasts.

Floor (seconds) = prefill FLOPs / matmul rate + decode steps x (weight bytes + mean KV bytes read per step) / copy
rate. Prefill FLOPs = 2 x layer matmul params x prompt tokens + 2 x lm_head params x requests (one sampled row each)
+ causal attention 2 x heads x head_dim x layers x sum over requests of n(n+1). Decode steps = new_tokens - 1 (the
prefill samples the first token); a step reads every weight except the embedding table (B rows of it) and the KV of
each sequence's context. `floor_fraction` = floor / tbjax steady wall (goal >= 0.70), `vs_transformers` = tbjax
steady tok/s / transformers tok/s (goal >= 3).

Engine settings: --engine-kw sets EngineConfig fields for every variant, --variants one list per variant
(';' between variants, ',' between fields; aliases mnbt = max_num_batched_tokens, mns = max_num_seqs). By default
the script sets max_num_seqs = requests, max_model_len = prompt + new tokens and a KV pool that holds every request.

Usage (H200, ~400 s of a 600 s call):
  python3 benchmarks/bench_offline.py --variants "mnbt=8192;mnbt=2048" --time-budget 420 --out bench_offline.json
       (CPU):  .venv/bin/python benchmarks/bench_offline.py --smoke      (SmolLM2 shapes, 2 layers, 8 requests)
Prints a table; writes the JSON to --out and to $OUT/bench_offline.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_common import git_commit, run_json_worker, write_json  # noqa: E402

CONFIG_DIR = os.path.join(HERE, "configs")
MARK = "OFFLINERESULT "
ALIASES = {"mnbt": "max_num_batched_tokens", "mns": "max_num_seqs", "chunk": "max_prefill_chunk"}


def _emit(res: dict) -> None:
    print(MARK + json.dumps(res, default=str), flush=True)


def _value(s: str):
    low = s.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for t in (int, float):
        try:
            return t(s)
        except ValueError:
            pass
    return s.strip()


def parse_engine_kw(s: str) -> dict:
    """'max_num_batched_tokens=8192,overlap_scheduling=false' -> {field: value}; aliases expanded; unknown fields
    are refused naming the EngineConfig fields (checked where tbjax imports: the worker)."""
    out = {}
    for item in [x for x in (s or "").split(",") if x.strip()]:
        if "=" not in item:
            raise SystemExit(f"bad engine setting {item!r}: expected FIELD=VALUE")
        k, v = item.split("=", 1)
        out[ALIASES.get(k.strip(), k.strip())] = _value(v)
    return out


def parse_variants(s: str) -> list[dict]:
    return [parse_engine_kw(v) for v in (s or "").split(";") if v.strip()] or [{}]


def variant_label(kw: dict) -> str:
    inv = {v: k for k, v in ALIASES.items()}
    return ",".join(f"{inv.get(k, k)}={v}" for k, v in kw.items()) or "defaults"


def load_hf_config(args) -> dict:
    with open(os.path.join(CONFIG_DIR, args.config + ".json")) as f:
        cfg = json.load(f)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    return cfg


def model_dims(hf: dict) -> dict:
    d, L, H = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    K = hf.get("num_key_value_heads", H)
    D = hf.get("head_dim") or d // H
    F, V = hf["intermediate_size"], hf["vocab_size"]
    return {"d": d, "L": L, "H": H, "K": K, "D": D, "F": F, "V": V, "tied": bool(hf.get("tie_word_embeddings"))}


def floor_model(hf: dict, B: int, P: int, N: int, copy_Bps: float, flops_per_s: float, itemsize: int = 2) -> dict:
    """The floor of a B x (P prompt + N new tokens) greedy batch for a dense llama-family config (docstring)."""
    if any(k in hf for k in ("num_local_experts", "n_routed_experts", "num_experts", "kv_lora_rank")):
        return {"note": "the floor is written for dense llama-family configs only"}
    m = model_dims(hf)
    d, L, H, K, D, F, V = (m[k] for k in "dLHKDFV")
    layer_mm = d * (H + 2 * K) * D + H * D * d + 3 * d * F          # qkv, o, gate/up, down
    layer_params = layer_mm + 2 * d                                # + the two norms
    head = V * d
    prefill_flops = 2 * L * layer_mm * B * P + 2 * head * B + 2 * H * D * L * B * P * (P + 1)
    kv_per_token = L * 2 * K * D * itemsize
    steps = max(N - 1, 0)
    w_bytes = (L * layer_params + d + head) * itemsize + (0 if m["tied"] else B * d * itemsize)
    kv_mean = (B * kv_per_token * sum(P + j for j in range(1, steps + 1)) / steps) if steps else 0.0
    ctx_mean = (sum(P + j for j in range(1, steps + 1)) / steps) if steps else 0.0
    decode_flops = 2 * (L * layer_mm + head) * B + 4 * H * D * L * B * ctx_mean
    out = {"requests": B, "prompt_len": P, "new_tokens": N, "decode_steps": steps,
           "layer_matmul_params": L * layer_mm, "lm_head_params": head, "prefill_flops": prefill_flops,
           "weight_bytes_per_step": w_bytes, "kv_bytes_per_token": kv_per_token, "mean_kv_bytes_per_step": kv_mean,
           "decode_flops_per_step": decode_flops}
    if copy_Bps and flops_per_s:
        out["prefill_s"] = prefill_flops / flops_per_s
        out["decode_s"] = steps * (w_bytes + kv_mean) / copy_Bps
        out["decode_compute_s"] = steps * decode_flops / flops_per_s     # below decode_s: decode is memory-bound
        out["floor_s"] = out["prefill_s"] + out["decode_s"]
        out["floor_tok_s"] = B * N / out["floor_s"]
    return out


# ---------------------------------------------------------------------------------------------------------------
# ceiling workers
# ---------------------------------------------------------------------------------------------------------------
def _queued_rate(fn, n: int, rounds: int = 3) -> float:
    """Seconds per call: n calls queued back to back, one wait at the end; the best of `rounds`."""
    best = math.inf
    for _ in range(rounds):
        t = time.perf_counter()
        fn(n)
        best = min(best, (time.perf_counter() - t) / n)
    return best


def ceiling_jax_worker(args) -> None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp

    cpu = jax.default_backend() == "cpu"
    dev = jax.devices()[0]
    res = {"backend": jax.default_backend(), "device": str(dev), "device_kind": getattr(dev, "device_kind", "?"),
           "jax": jax.__version__}
    try:
        nbytes = (64 << 20) if cpu else (2 << 30)
        x = jax.random.bits(jax.random.key(0), (nbytes // 4,), jnp.uint32)
        cp = jax.jit(jnp.copy)
        jax.block_until_ready(cp(x))

        def run(n, x=x):
            y = None
            for _ in range(n):
                y = cp(x)
            jax.block_until_ready(y)
        s = _queued_rate(run, 3 if cpu else 20)
        res["copy_bytes"] = nbytes
        res["copy_TBps"] = 2 * nbytes / s / 1e12
        del x, run
    except Exception as e:  # noqa: BLE001
        res["copy_error"] = repr(e)[:1000]
    _emit(res)
    try:
        n = 1024 if cpu else 8192
        ka, kb = jax.random.split(jax.random.key(1))
        a = jax.random.normal(ka, (n, n), jnp.bfloat16)
        b = jax.random.normal(kb, (n, n), jnp.bfloat16)
        mm = jax.jit(jnp.dot)
        jax.block_until_ready(mm(a, b))

        def run(k):
            y = None
            for _ in range(k):
                y = mm(a, b)
            jax.block_until_ready(y)
        s = _queued_rate(run, 2 if cpu else 20)
        res["matmul_n"] = n
        res["matmul_TFLOPs"] = 2 * n ** 3 / s / 1e12
    except Exception as e:  # noqa: BLE001
        res["matmul_error"] = repr(e)[:1000]
    _emit(res)


def ceiling_torch_worker(args) -> None:
    import torch

    if not torch.cuda.is_available():
        _emit({"skipped": "torch without cuda"})
        return
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}

    def timed(f, iters=20):
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(iters):
            a.record()
            f()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e-3)
        return statistics.median(ts)
    try:
        x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        x.random_(0, 255)
        res["copy_TBps"] = 2 * x.numel() / timed(lambda x=x, y=y: y.copy_(x)) / 1e12
        del x, y
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        res["copy_error"] = repr(e)[:1000]
    _emit(res)
    try:
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        res["matmul_TFLOPs"] = 2 * n ** 3 / timed(lambda: a @ b) / 1e12
    except Exception as e:  # noqa: BLE001
        res["matmul_error"] = repr(e)[:1000]
    _emit(res)


# ---------------------------------------------------------------------------------------------------------------
# tbjax worker
# ---------------------------------------------------------------------------------------------------------------
def tbjax_worker(args) -> None:
    t_proc = time.perf_counter()
    deadline = time.time() + args.deadline_s
    import jax
    import numpy as np

    sys.path.insert(0, REPO)
    from bench_common import compile_timer
    from bench_generate import synthetic_tokenizer
    from tbjax import LLM, SamplingParams
    from tbjax.engine.engine import EngineConfig
    from tbjax.model import init_params
    from tbjax.spec import ModelSpec

    compile_s = compile_timer()
    B, P, N = args.requests, args.prompt_len, args.new_tokens
    dev = jax.devices()[0]
    res: dict = {"backend": jax.default_backend(), "device": str(dev), "jax": jax.__version__,
                 "device_kind": getattr(dev, "device_kind", "?"), "import_s": time.perf_counter() - t_proc,
                 "passes": []}
    kw = json.loads(args.engine_json)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    bad = sorted(set(kw) - fields)
    if bad:
        res["error"] = f"unknown EngineConfig fields {bad}; fields: {sorted(fields)}"
        _emit(res)
        return
    spec = ModelSpec.from_hf_config(load_hf_config(args))
    G = kw.get("page_size", 16)
    defaults = {"max_num_seqs": B, "max_model_len": P + N, "num_pages": 1 + B * (-(-(P + N) // G)) + B}
    cfg = EngineConfig(**{**defaults, **kw})
    res["engine_config"] = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                            for k, v in dataclasses.asdict(cfg).items()}

    t = time.perf_counter()
    params = jax.jit(init_params, static_argnums=(0, 2))(spec, jax.random.key(0), args.dtype)
    jax.block_until_ready(params)
    res["weights_s"] = time.perf_counter() - t
    res["weights_bytes"] = int(sum(a.nbytes for a in jax.tree.leaves(params)))
    t = time.perf_counter()
    tok = synthetic_tokenizer(spec.vocab_size)
    res["tokenizer_s"] = time.perf_counter() - t
    _emit(res)

    rng = np.random.default_rng(args.seed)
    sp = SamplingParams.greedy(N, ignore_eos=True)

    def prompts():
        return [[int(x) for x in rng.integers(0, spec.vocab_size, P)] for _ in range(B)]

    def one_pass(llm, label) -> dict:
        st = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "steps_with_prefill": 0, "bucket_tokens": 0,
              "max_step_tokens": 0, "prefill_steps_s": 0.0, "decode_steps_s": 0.0}
        last = [None, None]              # (time, kind) of the previous scheduled step
        sched = llm.engine.scheduler
        orig = sched.schedule
        buckets = llm.engine.runner.buckets

        def schedule(*a, **k):           # counts what each step carries (the engine's own batches)
            b = orig(*a, **k)
            if b is not None and b.entries:
                n = b.num_tokens
                st["steps"] += 1
                dec = sum(e.num_tokens for e in b.entries if e.is_decode)
                st["decode_tokens"] += dec
                st["prefill_tokens"] += n - dec
                st["steps_with_prefill"] += n > dec
                st["bucket_tokens"] += next((x for x in buckets if x >= n), n)
                st["max_step_tokens"] = max(st["max_step_tokens"], n)
                # wall time from one step's scheduling to the next one's, by the kind of step: with overlapped
                # scheduling that is the step's device time once the pipeline is full
                now = time.perf_counter()
                if last[0] is not None:
                    st[last[1]] += now - last[0]
                last[:] = [now, "prefill_steps_s" if n > dec else "decode_steps_s"]
            return b
        sched.schedule = schedule
        ps = prompts()
        n_prog, c0 = llm.engine.runner.num_compiled, sum(compile_s.values())
        s0 = llm.engine.num_steps
        h0 = dict(llm.engine.host_seconds)
        l0 = dict(llm.engine.runner.launch_seconds)
        t = time.perf_counter()
        try:
            outs = llm.generate(ps, sp)
        finally:
            sched.schedule = orig
        wall = time.perf_counter() - t
        if last[0] is not None:
            st[last[1]] += t + wall - last[0]
        n_out = sum(len(o.token_ids) for o in outs)
        r = {"pass": label, "wall_s": wall, "output_tokens": n_out, "out_tok_s": n_out / wall,
             "total_tok_s": (n_out + B * P) / wall, "engine_steps": llm.engine.num_steps - s0, **st,
             "bucket_padding": (st["bucket_tokens"] / max(st["prefill_tokens"] + st["decode_tokens"], 1)) - 1,
             "new_programs": llm.engine.runner.num_compiled - n_prog,
             "compile_s_during": round(sum(compile_s.values()) - c0, 3),
             "all_full_length": all(len(o.token_ids) == N for o in outs),
             "finish_reasons": sorted({str(o.finish_reason) for o in outs}),
             "tokens_req0": outs[0].token_ids[:8]}
        # the engine's host time per step by phase (ms): what the host spent beside the device
        n_st = max(r["engine_steps"], 1)
        r["host_ms_per_step"] = {k: round(1e3 * (v - h0.get(k, 0.0)) / n_st, 3)
                                 for k, v in llm.engine.host_seconds.items()}
        r["host_ms_per_step"].update({f"launch.{k}": round(1e3 * (v - l0.get(k, 0.0)) / n_st, 3)
                                      for k, v in llm.engine.runner.launch_seconds.items()})
        return r

    t0 = time.perf_counter()
    llm = LLM.from_parts(spec, params, tok, cfg, warmup=False)
    del params
    cold = {"pass": "cold", "construct_s": time.perf_counter() - t0}
    c0 = dict(compile_s)
    t = time.perf_counter()
    info = llm.engine.warmup(progress=False)
    cold["warmup_s"] = time.perf_counter() - t
    cold["programs"] = info["programs"]
    cold["buckets"] = list(llm.engine.runner.buckets)
    cold["warmup_compile_s"] = {k: round(compile_s[k] - c0[k], 2) for k in compile_s}
    res["kv_pages"] = llm.engine.kv_config.num_pages
    _emit(res)
    g = one_pass(llm, "cold")
    cold["generate_s"] = g.pop("wall_s")
    cold.update(g)
    cold["cold_s"] = cold["construct_s"] + cold["warmup_s"] + cold["generate_s"]
    cold["out_tok_s"] = cold["output_tokens"] / cold["cold_s"]
    res["passes"].append(cold)
    _emit(res)
    last = cold["generate_s"]
    for i in range(args.passes):
        left = deadline - time.time()
        if left < 1.3 * last:
            res.setdefault("skipped", []).append(f"steady pass {i + 1}: {left:.0f}s left, ~{last:.0f}s needed")
            break
        r = one_pass(llm, f"steady {i + 1}")
        last = r["wall_s"]
        res["passes"].append(r)
        _emit(res)
    res["engine_stats"] = {k: v for k, v in llm.engine.stats().items() if k not in ("ranks",)}
    res["worker_s"] = time.perf_counter() - t_proc
    _emit(res)


# ---------------------------------------------------------------------------------------------------------------
# transformers worker
# ---------------------------------------------------------------------------------------------------------------
def hf_worker(args) -> None:
    t_proc = time.perf_counter()
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    res: dict = {"torch": torch.__version__, "transformers": transformers.__version__,
                 "device": torch.cuda.get_device_name(0) if cuda else "cpu", "import_s": time.perf_counter() - t_proc,
                 "compile": args.hf_compile, "passes": []}
    _emit(res)
    cfg = LlamaConfig.from_dict(load_hf_config(args))
    cfg.use_cache = True
    torch.manual_seed(0)
    t = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.eval()
    if cuda:
        torch.cuda.synchronize()
    res["build_s"] = time.perf_counter() - t
    res["weights_bytes"] = int(sum(p.numel() * p.element_size() for p in model.parameters()))
    res["attn_implementation"] = getattr(model.config, "_attn_implementation", "?")
    _emit(res)
    P, N = args.prompt_len, args.new_tokens
    gen = torch.Generator(device="cpu").manual_seed(args.seed)

    compile_on = [args.hf_compile != "off"]

    def one_pass(B, label):
        ids = torch.randint(0, cfg.vocab_size, (B, P), generator=gen).to(device)
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N,
                  min_new_tokens=N, cache_implementation="static", pad_token_id=0)
        if not compile_on[0]:
            kw["disable_compile"] = True
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**kw)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        n_new = int(out.shape[1]) - P
        return {"pass": label, "batch": B, "wall_s": wall, "new_tokens_per_request": n_new,
                "output_tokens": B * n_new, "out_tok_s": B * n_new / wall}

    B = args.hf_batch or args.requests
    while True:
        try:
            res["passes"] = []
            res["passes"].append(one_pass(B, "warm-up"))
            _emit(res)
            res["passes"].append(one_pass(B, "timed"))
            res["batch"] = B
            break
        except torch.OutOfMemoryError as e:
            res.setdefault("oom", []).append(f"batch {B}: {e!r}"[:400])
            res["oom_at_batch"] = B
            res["passes"] = []
            if cuda:
                torch.cuda.empty_cache()
            if B <= 1:
                raise
            B //= 2
            _emit(res)
        except Exception as e:  # noqa: BLE001  (e.g. transformers' own torch.compile failing): once more, eager
            if not compile_on[0]:
                raise
            res["compile_error"] = repr(e)[:1500]
            res["compile"] = "off (auto failed)"
            compile_on[0] = False
            res["passes"] = []
            if cuda:
                torch.cuda.empty_cache()
            _emit(res)
    try:
        import torch._dynamo.utils as du
        res["dynamo_frames_compiled"] = int(du.counters["stats"].get("unique_graphs", 0))
    except Exception:  # noqa: BLE001
        pass
    res["worker_s"] = time.perf_counter() - t_proc
    _emit(res)


# ---------------------------------------------------------------------------------------------------------------
# orchestrator
# ---------------------------------------------------------------------------------------------------------------
def run_worker(cmd, timeout: float, env=None) -> dict:
    """Runs one worker; returns the last JSON it printed (a timeout or a crash keeps the partial result)."""
    return run_json_worker(cmd, timeout, MARK, cwd=REPO, env=env)


def _steady(v: dict) -> list[dict]:
    return [p for p in v.get("passes", []) if p["pass"].startswith("steady")]


def finish(res: dict) -> None:
    """Ceilings, floor and ratios from the sections' results."""
    c = res.get("ceiling", {})
    copies = {k: c.get(k, {}).get("copy_TBps") for k in ("jax", "torch")}
    mms = {k: c.get(k, {}).get("matmul_TFLOPs") for k in ("jax", "torch")}
    copy = max([x for x in copies.values() if x] or [0]) or None
    mm = max([x for x in mms.values() if x] or [0]) or None
    res["copy_TBps"], res["matmul_TFLOPs"] = copy, mm
    res["floor"] = floor_model(res["hf_config"], res["requests"], res["prompt_len"], res["new_tokens"],
                               copy and copy * 1e12, mm and mm * 1e12)
    hf_pass = next((p for p in res.get("hf", {}).get("passes", []) if p["pass"] == "timed"), None)
    for v in res.get("tbjax", []):
        st = _steady(v)
        if not st:
            continue
        v["steady_wall_s"] = statistics.mean(p["wall_s"] for p in st)
        v["steady_out_tok_s"] = statistics.mean(p["out_tok_s"] for p in st)
        if res["floor"].get("floor_s"):
            v["floor_fraction"] = res["floor"]["floor_s"] / v["steady_wall_s"]
        if hf_pass:
            v["vs_transformers"] = v["steady_out_tok_s"] / hf_pass["out_tok_s"]


def table(res: dict) -> str:
    f = res.get("floor", {})
    fmt = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"   # noqa: E731
    c = res.get("ceiling", {})
    cj, ct = c.get("jax", {}), c.get("torch", {})
    dev = next((v.get("device") for v in res.get("tbjax", []) if v.get("device")), cj.get("device", "?"))
    lines = [f"bench_offline: {dev}, config={res['config']} (layers {res['hf_config']['num_hidden_layers']}), "
             f"commit={res['commit']}: {res['requests']} requests x {res['prompt_len']} prompt + {res['new_tokens']} "
             "greedy tokens",
             f"ceilings: copy {fmt(res.get('copy_TBps'), 3)} TB/s (jnp {fmt(cj.get('copy_TBps'), 3)}, torch "
             f"{fmt(ct.get('copy_TBps'), 3)}), matmul {fmt(res.get('matmul_TFLOPs'))} TFLOP/s (jnp "
             f"{fmt(cj.get('matmul_TFLOPs'))}, torch {fmt(ct.get('matmul_TFLOPs'))})",
             f"floor {fmt(f.get('floor_s'), 3)} s = prefill {fmt(f.get('prefill_s'), 3)} s + {f.get('decode_steps')} "
             f"decode steps {fmt(f.get('decode_s'), 3)} s ({fmt(f.get('floor_tok_s'), 0)} out tok/s)",
             "| engine | variant | pass | wall s | out tok/s | steps | prefill tok | decode tok | pad | "
             "floor/wall | vs transformers |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    hf = res.get("hf", {})
    hf_t = next((p for p in hf.get("passes", []) if p["pass"] == "timed"), None)
    for v in res.get("tbjax", []):
        lab = v.get("variant", "?")
        if not v.get("passes"):
            why = v.get("error") or " ".join([v.get("worker_status", "")] +
                                             (v.get("stderr_tail") or "").strip().splitlines()[-1:])
            lines.append(f"| tbjax | {lab} | - | error: {why[:160]} |")
        for p in v.get("passes", []):
            wall = p.get("cold_s", p.get("wall_s"))
            name = p["pass"]
            if name == "cold":
                name = (f"cold (construct {p['construct_s']:.1f} + warm-up {p['warmup_s']:.1f}, "
                        f"{p['programs']} programs + generate {p['generate_s']:.1f})")
            ff = f["floor_s"] / wall if f.get("floor_s") and p["pass"] != "cold" else None
            vs = p["out_tok_s"] / hf_t["out_tok_s"] if hf_t and p["pass"] != "cold" else None
            lines.append(f"| tbjax | {lab} | {name} | {wall:.2f} | {p['out_tok_s']:.0f} | {p['steps']} | "
                         f"{p['prefill_tokens']} | {p['decode_tokens']} | {100 * p['bucket_padding']:.0f}% | "
                         f"{fmt(ff, 3)} | {fmt(vs, 2)} |")
        if v.get("passes") and v.get("worker_status", "").startswith("killed"):
            lines.append(f"| tbjax | {lab} | {v['worker_status']} | | | | | | | | |")
    if hf.get("passes"):
        graphs = hf.get("dynamo_frames_compiled")
        lab = f"static cache, compile={hf.get('compile')}" + (f" ({graphs} graphs)" if graphs is not None else "") + \
            f", batch {hf['passes'][0]['batch']}" + (
            f" (OOM at {hf['oom_at_batch']})" if hf.get("oom_at_batch") else "")
        for p in hf["passes"]:
            ff = f["floor_s"] / p["wall_s"] if f.get("floor_s") and p["batch"] == res["requests"] else None
            lines.append(f"| transformers {hf.get('transformers', '')} | {lab} | {p['pass']} | {p['wall_s']:.2f} | "
                         f"{p['out_tok_s']:.0f} | - | - | - | - | {fmt(ff, 3)} | 1 |")
    elif hf:
        lines.append(f"| transformers | - | - | {(hf.get('skipped') or hf.get('worker_status', ''))[:60]} "
                     f"{hf.get('stderr_tail', '')[-200:]!r} |")
    for v in res.get("tbjax", []):
        if v.get("steady_out_tok_s"):
            lines.append(f"tbjax {v['variant']}: steady {v['steady_out_tok_s']:.0f} out tok/s, floor/wall "
                         f"{fmt(v.get('floor_fraction'), 3)} (goal >= 0.70), vs transformers "
                         f"{fmt(v.get('vs_transformers'), 2)} (goal >= 3)")
            p = _steady(v)[-1]
            if "prefill_steps_s" in p:
                lines.append(f"  last steady pass: steps with prefill {p['prefill_steps_s']:.2f} s (floor's prefill "
                             f"{fmt(f.get('prefill_s'), 2)} s), decode-only steps {p['decode_steps_s']:.2f} s "
                             f"(floor's decode {fmt(f.get('decode_s'), 2)} s)")
            if p.get("host_ms_per_step"):
                lines.append("  host ms/step: " + ", ".join(f"{k} {x:.2f}" for k, x in p["host_ms_per_step"].items()))
    for s in res.get("skipped", []):
        lines.append(f"skipped: {s}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="ceiling,tbjax,hf", help="any of ceiling,tbjax,hf")
    ap.add_argument("--config", default="llama-3.1-8b", help="name of a JSON file in benchmarks/configs/")
    ap.add_argument("--layers", type=int, default=0, help="override the config's layer count (0 = as configured)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--passes", type=int, default=2, help="steady tbjax passes after the cold one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-kw", default="", help="EngineConfig fields for every variant: FIELD=VALUE,...")
    ap.add_argument("--variants", default="", help="engine variants, ';' between them: 'mnbt=8192;mnbt=2048'")
    ap.add_argument("--compile-cache", default="fresh", choices=["fresh", "default"],
                    help="fresh: an empty persistent compile cache per variant (a cold start); default: the user's")
    ap.add_argument("--hf-compile", default="auto", choices=["auto", "off"],
                    help="auto: transformers' own torch.compile of the static-cache decode; off: disable_compile")
    ap.add_argument("--hf-batch", type=int, default=0, help="transformers batch (0 = --requests)")
    ap.add_argument("--hf-python", default=sys.executable, help="python for the torch/transformers processes")
    ap.add_argument("--time-budget", type=float, default=420.0, help="seconds for the whole run")
    ap.add_argument("--t-ceiling", type=float, default=60.0, help="time limit of each ceiling process")
    ap.add_argument("--t-tbjax", type=float, default=200.0, help="time limit of each tbjax variant's process")
    ap.add_argument("--t-hf", type=float, default=160.0, help="time limit of the transformers process")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: SmolLM2 shapes, 2 layers, 8 requests x 32 prompt + 8 new tokens, variants mnbt=16 and 8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", choices=["ceiling-jax", "ceiling-torch", "tbjax", "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--engine-json", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--deadline-s", type=float, default=1e9, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.config, args.layers, args.requests, args.prompt_len, args.new_tokens = "smollm2-135m-instruct", 2, 8, 32, 8
        args.variants = args.variants or "mnbt=16;mnbt=8"
        args.time_budget = min(args.time_budget, 170.0)
        args.t_ceiling, args.t_tbjax, args.t_hf = min(args.t_ceiling, 30), min(args.t_tbjax, 110), min(args.t_hf, 40)
    if not os.path.isfile(os.path.join(CONFIG_DIR, args.config + ".json")):
        ap.error(f"no config {args.config}.json in {CONFIG_DIR}")

    if args.worker:
        {"ceiling-jax": ceiling_jax_worker, "ceiling-torch": ceiling_torch_worker, "tbjax": tbjax_worker,
         "hf": hf_worker}[args.worker](args)
        return 0

    t_start = time.time()
    end = t_start + args.time_budget
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - {"ceiling", "tbjax", "hf"}
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")
    common = parse_engine_kw(args.engine_kw)
    variants = [{**common, **v} for v in parse_variants(args.variants)]
    res = {"config": args.config, "hf_config": load_hf_config(args), "dtype": args.dtype, "requests": args.requests,
           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "commit": git_commit(),
           "argv": sys.argv[1:], "smoke": args.smoke, "sections": sections, "skipped": [],
           "xla_flags": os.environ.get("XLA_FLAGS", "")}
    outs = [args.out] if args.out else []
    if os.environ.get("OUT"):
        outs.append(os.path.join(os.environ["OUT"], "bench_offline.json"))

    def save():
        finish(res)
        for p in outs:
            write_json(p, res)

    base = [os.path.abspath(__file__), "--config", args.config, "--layers", str(args.layers), "--dtype", args.dtype,
            "--requests", str(args.requests), "--prompt-len", str(args.prompt_len), "--new-tokens",
            str(args.new_tokens), "--seed", str(args.seed), "--passes", str(args.passes)]
    import importlib.util
    if args.hf_python == sys.executable:
        has_torch = importlib.util.find_spec("torch") is not None
        has_hf = has_torch and importlib.util.find_spec("transformers") is not None
    else:
        probe = subprocess.run([args.hf_python, "-c", "import importlib.util as u; print(u.find_spec('torch') is not "
                                "None, u.find_spec('transformers') is not None)"], capture_output=True, text=True)
        has_torch, has_hf = (x == "True" for x in (probe.stdout.split() or ["False", "False"]))
    left = lambda: end - time.time()   # noqa: E731

    if "ceiling" in sections:
        res["ceiling"] = {"jax": run_worker([sys.executable] + base + ["--worker", "ceiling-jax"],
                                            min(args.t_ceiling, left()))}
        save()
        if has_torch and not args.smoke:
            res["ceiling"]["torch"] = run_worker([args.hf_python] + base + ["--worker", "ceiling-torch"],
                                                 min(args.t_ceiling, left()))
            save()
    res["tbjax"] = []

    def run_variant(i, kw, reserve):
        limit = min(args.t_tbjax, left() - reserve)
        if limit < 30:
            res["skipped"].append(f"tbjax {variant_label(kw)}: {left():.0f}s left (reserve {reserve:.0f}s)")
            save()
            return
        env = dict(os.environ)
        cache = None
        if args.compile_cache == "fresh":
            cache = tempfile.mkdtemp(prefix="tbjax-offline-cache-")
            env["TBJAX_COMPILE_CACHE"] = cache
        cmd = [sys.executable] + base + ["--worker", "tbjax", "--engine-json", json.dumps(kw),
                                         "--deadline-s", str(limit - 10)]
        v = run_worker(cmd, limit, env)
        v["variant"] = variant_label(kw)
        v["engine_kw"] = kw
        res["tbjax"].append(v)
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
        save()
        print(f"[tbjax {v['variant']}] {v['worker_status']}, {v['worker_wall_s']:.0f}s", file=sys.stderr, flush=True)

    run_hf = "hf" in sections and has_hf
    if "hf" in sections and not has_hf:
        res["hf"] = {"skipped": "torch / transformers not installed" if not has_torch else "transformers missing"}
    if "tbjax" in sections:
        run_variant(0, variants[0], args.t_hf if run_hf else 0)
    if run_hf:
        limit = min(args.t_hf, left())
        cmd = [args.hf_python] + base + ["--worker", "hf", "--hf-compile", args.hf_compile,
                                         "--hf-batch", str(args.hf_batch)]
        res["hf"] = run_worker(cmd, limit) if limit >= 30 else {"skipped": f"time ({left():.0f}s left)"}
        save()
        print(f"[hf] {res['hf'].get('worker_status', res['hf'].get('skipped'))}", file=sys.stderr, flush=True)
    if "tbjax" in sections:
        for i, kw in enumerate(variants[1:], 1):
            run_variant(i, kw, 0)
    res["total_s"] = time.time() - t_start
    save()
    print(table(res))
    ok = "tbjax" not in sections or (res["tbjax"] and all(_steady(v) for v in res["tbjax"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
