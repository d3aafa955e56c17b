"""Engine decode benchmark (issue 3): time per decode step, tokens/s and model-bandwidth utilization (MBU) of the
engine's jitted decode step at Llama-3.1-8B shapes (random bf16 weights, bf16 paged KV, page 16), against the HBM
copy bandwidth and against transformers (static cache + torch.compile) measured in the same run.

Why it exists: decode is memory-bound, so MBU = (weight bytes + KV bytes read per step) / step time / HBM bandwidth
says how far the engine is from the hardware, and the transformers number says how far it is from the usual baseline.

Sections (one process each, so one failing section still leaves the others; JSON is written as results arrive):
  ceiling   torch device-to-device copy of 2 GiB (read + write bytes) in its own process, before anything else
            holds GPU memory; the JAX worker adds a jnp copy and an elementwise op. Ceiling = the highest.
  jax       the engine (tbjax.engine.Engine with its ModelRunner) at batch x context. The runner is driven directly
            with synthetic block tables (every sequence has ctx tokens of random KV in its own pages; the step
            decodes the token at position ctx-1, so kv_len = ctx): no scheduler in these timings. Three timings:
              run    ModelRunner.run(inputs): host->device inputs, the jitted step, device->host tokens (median);
              sync   the jitted step on device-resident inputs, block_until_ready after each (median) -> MBU;
              pipe   N steps queued back to back, one block at the end (mean): device time, dispatch hidden.
            Then one end-to-end Engine.step() figure (default batch 32, context 1k: 32 random prompts prefilled in
            one step, then greedy decode steps; median of the decode steps) so host overhead is visible, and,
            if time is left, the same step with impl="reference" attention (token agreement with the kernel).
  hf        transformers LlamaForCausalLM from the same config, random bf16 weights on cuda, StaticCache,
            model.forward compiled with torch.compile(mode="reduce-overhead", fullgraph=True) (falls back to
            mode="default", then eager; the mode used is recorded); decode step (forward + argmax) at the
            requested batch x context (default 32x1k, then 32x8k if time allows); median of CUDA-event timings.
Bytes per step: all weights except the embedding table (only B rows of it are read) + B * ctx * L * 2K * H * 2
(the KV of the context). The new token's KV write and activations are not counted.

The config comes from benchmarks/configs/ (copies of ../shared/configs/: the device tool sends only the repo).

Usage (H200):  python3 benchmarks/bench_engine_decode.py --out engine_decode.json
       (CPU):  python benchmarks/bench_engine_decode.py --smoke        (SmolLM2 shapes, tiny batch/context)
Prints a table and the JSON; writes the JSON to --out and to $OUT/bench_engine_decode.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import forward_argv, git_commit, json_saver, run_json_worker, torch_copy_script  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG_DIR = os.path.join(HERE, "configs")
MARK = "ENGRESULT "

TORCH_COPY = torch_copy_script(20, prefix=MARK, fill_random=True)


def _parse_shapes(s: str) -> list[tuple[int, int]]:
    out = []
    for item in [x for x in s.split(",") if x]:
        try:
            b, c = item.split(":")
            out.append((int(b), int(c)))
        except ValueError:
            raise SystemExit(f"bad shape {item!r}: expected BATCH:CONTEXT, e.g. 32:1024") from None
    return out


def _median(xs):
    return statistics.median(xs) if xs else None


def profile_steps(step_fn, n: int, top: int = 30, planes: str = "/device:") -> dict:
    """Breakdown of n steps from a jax.profiler trace: per line of the planes whose name starts with `planes`
    ("/device:": CUDA streams and XLA op/module lines, the kernels; "/host:": the host threads, whose TraceMe events
    nest, so a parent's time includes its children's), the total time per step and the top events by time per
    step."""
    import glob
    import tempfile

    import jax
    from jax.profiler import ProfileData
    d = tempfile.mkdtemp(prefix="tbjax_prof_")
    jax.block_until_ready(step_fn())
    with jax.profiler.trace(d):
        o = None
        for _ in range(n):
            o = step_fn()
        jax.block_until_ready(o)
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return {"error": "no xplane file written"}
    pdata = ProfileData.from_file(files[0])
    out = {"steps": n, "lines": []}
    for plane in pdata.planes:
        if not plane.name.startswith(planes):
            continue
        for line in plane.lines:
            agg: dict = {}
            span = [None, None]
            for e in line.events:
                a = agg.setdefault(e.name, [0.0, 0])
                a[0] += e.duration_ns
                a[1] += 1
                st = e.start_ns
                span[0] = st if span[0] is None else min(span[0], st)
                span[1] = st + e.duration_ns if span[1] is None else max(span[1], st + e.duration_ns)
            if not agg:
                continue
            busy = sum(a[0] for a in agg.values())
            rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]
            # idle time between consecutive kernels, summed by the (kernel before, kernel after) pair: where the
            # stream waits on the host (graph breaks, host syncs, launch-bound stretches)
            evs = sorted(((e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events))
            gaps: dict = {}
            for (s0, e0, n0), (s1, e1, n1) in zip(evs, evs[1:]):
                g = s1 - e0
                if g > 0:
                    a = gaps.setdefault((n0[:60], n1[:60]), [0.0, 0])
                    a[0] += g
                    a[1] += 1
            gap_rows = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:15]
            out["lines"].append({"plane": plane.name, "line": line.name, "busy_us_per_step": busy / n / 1e3,
                                 "span_us_per_step": (span[1] - span[0]) / n / 1e3 if span[0] is not None else None,
                                 "events_per_step": sum(a[1] for a in agg.values()) / n,
                                 "top": [{"name": k[:160], "us_per_step": a[0] / n / 1e3, "calls_per_step": a[1] / n}
                                         for k, a in rows],
                                 "idle_us_per_step": sum(a[0] for a in gaps.values()) / n / 1e3,
                                 "gaps": [{"before": k[0], "after": k[1], "us_per_step": a[0] / n / 1e3,
                                           "per_step": a[1] / n} for k, a in gap_rows]})
    out["lines"].sort(key=lambda l: -l["busy_us_per_step"])
    return out


# ---------------------------------------------------------------------------------------------------------------
# JAX worker
# ---------------------------------------------------------------------------------------------------------------
def jax_worker(args) -> dict:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
    t_begin = time.time()
    deadline = t_begin + args.deadline_s
    res: dict = {"sections": [], "skipped": [], "variants": []}

    def emit():
        print(MARK + json.dumps(res, default=str), flush=True)


    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, HERE)
    from bench_generate import synthetic_tokenizer
    from pallas_kernels.paged_attention import resolve_impl
    from tbjax.engine.engine import Engine, EngineConfig
    from tbjax.engine.runner import ModelRunner
    from tbjax.model import init_params
    from tbjax.sampling import SamplingParams
    from tbjax.spec import ModelSpec

    fallbacks: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, record):
            fallbacks.append(record.getMessage()[:300])
    logging.getLogger("pallas_kernels.paged_attention").addHandler(_Catch(level=logging.WARNING))

    from bench_common import compile_timer
    compile_s = compile_timer()

    dev = jax.devices()[0]
    res["meta"] = {"jax": jax.__version__, "backend": jax.default_backend(), "device": str(dev),
                   "device_kind": getattr(dev, "device_kind", "?"), "attn_impl_requested": args.attn_impl,
                   "attn_impl_resolved": resolve_impl(args.attn_impl), "config": args.config}

    # ---- ceiling: JAX copies ------------------------------------------------------------------------------
    def bench_copy(f, x, iters=10):
        y = f(x)
        y.block_until_ready()
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            y = f(x)
            y.block_until_ready()
            ts.append(time.perf_counter() - t)
        return 2 * x.nbytes / statistics.median(ts) / 1e12

    try:
        n = (2 << 30) if res["meta"]["backend"] != "cpu" else (64 << 20)
        x = jax.random.bits(jax.random.key(7), (n // 4,), jnp.uint32)
        res["jax_copy_TBps"] = bench_copy(jax.jit(jnp.copy), x)
        res["jax_elementwise_TBps"] = bench_copy(jax.jit(lambda a: a ^ jnp.uint32(0x5A5A5A5A)), x)
        del x
    except Exception as e:  # noqa: BLE001
        res["jax_copy_error"] = repr(e)
    res["sections"].append("ceiling")
    emit()

    # ---- model, engine, KV --------------------------------------------------------------------------------
    with open(os.path.join(CONFIG_DIR, args.config + ".json")) as f:
        hf_config = json.load(f)
    if args.layers:                      # probes (e.g. of XLA flags) on fewer layers: shorter compiles, same shapes
        hf_config["num_hidden_layers"] = args.layers
    spec = ModelSpec.from_hf_config(hf_config)
    G = args.page_size
    shapes = _parse_shapes(args.shapes)
    for b, c in shapes:
        if c % G or c < G:
            raise SystemExit(f"context {c} must be a positive multiple of the page size {G}")
    max_b = max(b for b, _ in shapes)
    max_ctx = max(c for _, c in shapes)
    e2e = _parse_shapes(args.e2e)[0] if args.e2e else None
    if e2e:
        max_b = max(max_b, e2e[0])
        max_ctx = max(max_ctx, e2e[1])
    num_pages = 1 + max(max_b * (max_ctx // G), (e2e[0] * (e2e[1] // G) if e2e else 0))
    e2e_prompt = (e2e[1] - args.e2e_new_tokens) if e2e else 0
    max_tokens = max(max_b, e2e[0] * e2e_prompt if e2e else 0, 16)

    t0 = time.perf_counter()
    params = jax.jit(init_params, static_argnums=(0, 2))(spec, jax.random.key(0), args.dtype)
    if args.weight_dtype != "bf16":      # matrices resident in fp8 / int8 / int4 (quantized where they live)
        from tbjax.model import quant
        fmt, group = ("fp8", 128) if args.weight_dtype == "fp8-block" else (args.weight_dtype, None)
        params = quant.quantize_tree(params, fmt, on_device=True, group=group)
    jax.block_until_ready(params)
    res["init_weights_s"] = time.perf_counter() - t0
    itemsize = jnp.dtype(args.dtype).itemsize
    w_total = int(sum(a.nbytes for a in jax.tree.leaves(params)))
    embed_bytes = int(params["embed"].nbytes)
    kv_per_token = spec.n_layers * 2 * spec.n_kv_heads * spec.head_dim * itemsize
    res["model"] = {"weights_bytes": w_total, "embed_bytes": embed_bytes, "kv_bytes_per_token": kv_per_token,
                    "layers": spec.n_layers, "d_model": spec.d_model, "heads": spec.n_heads,
                    "kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim, "vocab": spec.vocab_size,
                    "dtype": args.dtype, "weight_dtype": args.weight_dtype, "num_pages": num_pages, "page_size": G}

    tok = synthetic_tokenizer(spec.vocab_size)
    cfg = EngineConfig(page_size=G, num_pages=num_pages, kv_dtype=args.dtype, max_num_seqs=max_b,
                       max_num_batched_tokens=max_tokens, max_model_len=max_ctx, attn_impl=args.attn_impl,
                       matmul_impl=args.matmul_impl, layer_buffers=args.layer_buffers, fold_norms=args.fold_norms,
                       command_buffers=args.command_buffers)
    t0 = time.perf_counter()
    engine = Engine(spec, params, tok, cfg)
    runner = engine.runner

    # Random KV written over the engine's zero pool in place. keep_unused=True matters: `pages` is only used for its
    # shape, and jit would otherwise prune it, silently skip the donation and hold two pools (an OOM at 8B x 64 x 8k).
    fill = jax.jit(lambda pages, key: jax.random.uniform(key, pages.shape, pages.dtype, -1.0, 1.0),
                   donate_argnums=0, keep_unused=True)
    keys = jax.random.split(jax.random.key(1), spec.n_layers)
    new_caches = []
    for (p, s), k in zip(runner.caches, keys):
        q = fill(p, k)
        q.block_until_ready()
        if not p.is_deleted():
            raise RuntimeError("KV fill did not donate the zero pool (two pools would not fit)")
        new_caches.append((q, s))
    runner.caches = new_caches
    del new_caches, p, q
    res["kv_pool_s"] = time.perf_counter() - t0
    res["kv_pool_bytes"] = int(sum(p.nbytes for p, _ in runner.caches))
    res["sections"].append("setup")
    emit()

    rng = np.random.default_rng(0)

    def make_inputs(B, ctx):
        P = ctx // G
        entries = [([int(rng.integers(0, spec.vocab_size))], ctx - 1, list(range(1 + s * P, 1 + (s + 1) * P)))
                   for s in range(B)]
        sampling = [(0.0, 0, 1.0, 0.0, s) for s in range(B)]
        inp = runner.build_inputs(entries, sampling)
        if int(inp.kv_lens_S[0, :B].min()) != ctx or inp.cu_q_lens_S1[0, B] != B:
            raise RuntimeError(f"unexpected step inputs for B={B} ctx={ctx}")
        return inp

    def measure(r: ModelRunner, B, ctx, label):
        v = {"batch": B, "context": ctx, "label": label, "attn_impl": r.attn_impl, "matmul_impl": r.matmul_impl}
        inp = make_inputs(B, ctx)
        n0 = r.num_compiled
        fb0 = len(fallbacks)
        c0 = dict(compile_s)
        t = time.perf_counter()
        out = r.run(inp)
        v["first_call_s"] = time.perf_counter() - t
        v["compile_s"] = {k: round(compile_s[k] - c0[k], 3) for k in compile_s}
        v["bucket_T"] = inp.num_tokens
        v["bucket_RSP"] = list(inp.block_tables_SP.shape)
        v["new_programs"] = r.num_compiled - n0
        v["fallback_warnings"] = fallbacks[fb0:]
        toks = np.asarray(out["tokens"])[:B]
        if toks.min() < 0 or toks.max() >= spec.vocab_size:
            raise RuntimeError(f"sampled tokens out of range: {toks.min()}..{toks.max()}")
        for _ in range(args.warmup):
            r.run(inp)
        ts = []
        for _ in range(args.steps):
            t = time.perf_counter()
            r.run(inp)
            ts.append(time.perf_counter() - t)
        v["run_ms"] = 1e3 * _median(ts)
        ints, floats, layout = inp.pack()
        packed = (*jax.device_put((ints, floats), r._rank_sharding), layout)   # inputs on device: the step alone

        def dstep():
            return r.launch(inp, packed)
        jax.block_until_ready(dstep())
        ts = []
        for _ in range(args.steps):
            t = time.perf_counter()
            o = dstep()
            jax.block_until_ready((o, r.caches))
            ts.append(time.perf_counter() - t)
        v["sync_ms"] = 1e3 * _median(ts)
        v["sync_min_ms"] = 1e3 * min(ts)
        t = time.perf_counter()
        for _ in range(args.steps):
            o = dstep()
        jax.block_until_ready((o, r.caches))
        v["pipe_ms"] = 1e3 * (time.perf_counter() - t) / args.steps
        # device-resident inputs add a jit fast-path cache entry but must not compile again: check it
        v["compile_during_timing_s"] = round(sum(compile_s.values()) - sum(c0.values())
                                             - sum(v["compile_s"].values()), 3)
        wbytes = w_total - embed_bytes + B * spec.d_model * itemsize
        kvbytes = B * ctx * kv_per_token
        v["weight_bytes"], v["kv_bytes"] = wbytes, kvbytes
        for k in ("run", "sync", "pipe"):
            v[f"{k}_tok_s"] = B / (v[f"{k}_ms"] * 1e-3)
            v[f"{k}_TBps"] = (wbytes + kvbytes) / (v[f"{k}_ms"] * 1e-3) / 1e12
        v["tokens"] = [int(x) for x in toks[:8]]
        if args.dump_hlo and not os.path.exists(args.dump_hlo):      # optimized HLO of the first shape's step
            try:
                with open(args.dump_hlo, "w") as f:
                    b = inp.num_tokens
                    f.write(r._fn(b).lower(*r._abstract_args(b)).compile().as_text())
            except Exception as e:  # noqa: BLE001
                v["dump_hlo_error"] = repr(e)[:500]
        if args.profile and (B, ctx) in _parse_shapes(args.profile):
            try:
                v["profile"] = profile_steps(dstep, args.profile_steps)
            except Exception as e:  # noqa: BLE001
                v["profile"] = {"error": repr(e)[:1000]}
        if args.host_profile and (B, ctx) in _parse_shapes(args.host_profile):
            try:                         # the host's share of one step at a time: where the dispatch goes
                v["host_profile"] = profile_steps(lambda: jax.block_until_ready((dstep(), r.caches)),
                                                  args.profile_steps, top=40, planes="/host:")
            except Exception as e:  # noqa: BLE001
                v["host_profile"] = {"error": repr(e)[:1000]}
        return v, inp, toks

    def other_runner(impl):
        """A runner with another matmul impl over the same KV pools (moved, not copied)."""
        o = ModelRunner(spec, runner.params, page_size=G, max_num_seqs=max_b,
                        max_num_batched_tokens=max_tokens, max_pages_per_seq=max_ctx // G,
                        attn_impl=args.attn_impl, matmul_impl=impl, layer_buffers="stacked")
        o.caches, o.pages_per_rank, runner.caches = runner.caches, runner.pages_per_rank, None
        return o

    if args.precompile_workers > 0:      # all grid buckets compiled up front, several at once (start-up figure)
        try:
            pre = [make_inputs(B, ctx) for B, ctx in shapes]
            wall = runner.precompile([i.num_tokens for i in pre], workers=args.precompile_workers)
            res["precompile"] = {"programs": len(runner._compiled), "workers": args.precompile_workers,
                                 "wall_s": round(wall, 2), "compile_s": dict(compile_s)}
        except Exception as e:  # noqa: BLE001
            res["precompile"] = {"error": repr(e)[:1000]}
        print(f"[jax] precompile: {res['precompile']}", file=sys.stderr, flush=True)
        emit()

    est = None   # seconds a new variant costs (compile + timing), from the last one

    def time_left():
        return deadline - time.time()

    for B, ctx in shapes:
        if est is not None and time_left() < 1.2 * est:
            res["skipped"].append(f"jax {B}x{ctx}: time ({time_left():.0f}s left, ~{est:.0f}s needed)")
            emit()
            continue
        t = time.time()
        try:
            v, _, _ = measure(runner, B, ctx, "runner")
        except Exception as e:  # noqa: BLE001
            v = {"batch": B, "context": ctx, "label": "runner", "error": repr(e)[:2000]}
        res["variants"].append(v)
        est = time.time() - t
        print(f"[jax] {B}x{ctx}: " + (f"sync {v['sync_ms']:.2f} ms, first call {v['first_call_s']:.1f}s"
                                     if "error" not in v else v["error"][:300]), file=sys.stderr, flush=True)
        emit()
        if (B, ctx) in _parse_shapes(args.compare_matmul) and time_left() > 1.2 * est:
            for impl in [m for m in ("auto", "xla") if m != args.matmul_impl]:
                try:
                    o = other_runner(impl)
                    v2, _, toks2 = measure(o, B, ctx, f"matmul={impl}")
                    runner.caches, o.caches = o.caches, None
                    v2["token_agreement_with_default"] = float(np.mean(np.asarray(v.get("tokens", [])) ==
                                                                       np.asarray(v2["tokens"][:len(v.get("tokens", []))])))
                except Exception as e:  # noqa: BLE001
                    v2 = {"batch": B, "context": ctx, "label": f"matmul={impl}", "error": repr(e)[:2000]}
                    if runner.caches is None and "o" in dir():
                        runner.caches = o.caches
                res["variants"].append(v2)
                print(f"[jax] {B}x{ctx} matmul={impl}: " + (f"sync {v2['sync_ms']:.2f} ms" if "error" not in v2
                      else v2["error"][:300]), file=sys.stderr, flush=True)
                emit()
    res["sections"].append("grid")

    # ---- end-to-end Engine.step() --------------------------------------------------------------------------
    if e2e and time_left() < 1.5 * (est or 0):
        res["skipped"].append(f"e2e: time ({time_left():.0f}s left)")
    elif e2e:
        B, ctx = e2e
        r = {"batch": B, "context": ctx, "prompt_len": e2e_prompt, "new_tokens": args.e2e_new_tokens}
        try:
            import dataclasses as _dc
            sp = SamplingParams.greedy(args.e2e_new_tokens, ignore_eos=True)
            n0 = runner.num_compiled
            c0 = dict(compile_s)
            # one step at a time, then overlapped scheduling (the default: step N+1 launched before waiting for N)
            for mode, overlap in (("sync", False), ("overlap", True)):
                engine.config = _dc.replace(engine.config, overlap_scheduling=overlap)
                engine.overlap = overlap
                for i in range(B):
                    ids = [int(x) for x in rng.integers(0, spec.vocab_size, e2e_prompt)]
                    engine.add_request(f"e2e-{mode}-{i}", ids, sp)
                def host():              # Engine.step's phases, and launch's parts (ModelRunner.launch_seconds)
                    return {**engine.host_seconds, **{f"launch.{k}": v for k, v in runner.launch_seconds.items()}}
                steps, hs = [], [host()]
                while engine.has_unfinished():
                    t = time.perf_counter()
                    outs = engine.step()
                    steps.append((time.perf_counter() - t, len(outs)))
                    hs.append(host())
                    if len(steps) > args.e2e_new_tokens + 8:
                        raise RuntimeError("engine did not finish in the expected number of steps")
                m = {"step_s": [round(x, 5) for x, _ in steps]}
                # sync: step 0 is the prefill; overlap: step 0 launches it and step 1 waits for it
                m["prefill_step_s"] = steps[0][0] + (steps[1][0] if overlap else 0.0)
                dec = [x for x, _ in steps[2:]] or [x for x, _ in steps[1:]]
                m["decode_step_ms"] = 1e3 * _median(dec)
                # host ms by phase of Engine.step (Engine.host_seconds), median over the same decode steps
                first = 2 if len(steps) > 2 else 1
                m["host_ms_per_step"] = {k: round(1e3 * _median([hs[i + 1][k] - hs[i][k]
                                                                 for i in range(first, len(steps))]), 3)
                                         for k in hs[0]}
                m["decode_tok_s"] = B / (m["decode_step_ms"] * 1e-3)
                r[mode] = m
            r.update({k: r["overlap"][k] for k in ("prefill_step_s", "decode_step_ms", "decode_tok_s")})
            r["overlap_over_sync_tok_s"] = r["overlap"]["decode_tok_s"] / r["sync"]["decode_tok_s"]
            r["new_programs"] = runner.num_compiled - n0
            r["compile_s"] = {k: round(compile_s[k] - c0[k], 3) for k in compile_s}
        except Exception as e:  # noqa: BLE001
            r["error"] = repr(e)[:2000]
        res["e2e"] = r
        print(f"[jax] e2e: {r.get('decode_step_ms', r.get('error'))}", file=sys.stderr, flush=True)
        res["sections"].append("e2e")
        emit()

    # ---- the same step with reference attention --------------------------------------------------------------
    if args.ref_shape:
        for B, ctx in _parse_shapes(args.ref_shape):
            if est is not None and time_left() < 1.5 * est:
                res["skipped"].append(f"reference attention {B}x{ctx}: time ({time_left():.0f}s left)")
                continue
            try:
                inp = make_inputs(B, ctx)
                auto_toks = np.asarray(runner.run(inp)["tokens"])[:B]
                ref = ModelRunner(spec, runner.params, page_size=G, max_num_seqs=max_b,
                                  max_num_batched_tokens=max_tokens, max_pages_per_seq=max_ctx // G,
                                  attn_impl="blocked", layer_buffers="stacked")
                ref.caches, ref.pages_per_rank, runner.caches = runner.caches, runner.pages_per_rank, None
                ref_toks = np.asarray(ref.run(inp)["tokens"])[:B]   # same inputs, same KV: greedy tokens
                v, _, _ = measure(ref, B, ctx, "reference-attention")
                v["token_agreement_with_auto"] = float(np.mean(auto_toks == ref_toks))
                runner.caches, ref.caches = ref.caches, None
            except Exception as e:  # noqa: BLE001
                v = {"batch": B, "context": ctx, "label": "reference-attention", "error": repr(e)[:2000]}
            res["variants"].append(v)
            emit()
    res["fallback_warnings_total"] = len(fallbacks)
    res["elapsed_s"] = time.time() - t_begin
    emit()
    return res


def _fill_cache_tensors(torch, obj, min_numel: int, depth: int = 0, seen=None) -> int:
    """Fills every large tensor reachable from a transformers cache object with uniform(-1, 1) noise (the cache
    classes' attribute layout changes between versions, so they are found by walking the object)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.numel() >= min_numel and obj.is_floating_point():
            obj.uniform_(-1, 1)
            return 1
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(_fill_cache_tensors(torch, x, min_numel, depth + 1, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(_fill_cache_tensors(torch, x, min_numel, depth + 1, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("transformers"):
        return sum(_fill_cache_tensors(torch, x, min_numel, depth + 1, seen) for x in vars(obj).values())
    return 0


# ---------------------------------------------------------------------------------------------------------------
# transformers worker
# ---------------------------------------------------------------------------------------------------------------
def hf_worker(args) -> dict:
    t_begin = time.time()
    deadline = t_begin + args.deadline_s
    res: dict = {"shapes": [], "skipped": []}

    def emit():
        print(MARK + json.dumps(res, default=str), flush=True)

    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    res["meta"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                   "device": torch.cuda.get_device_name(0)}
    with open(os.path.join(CONFIG_DIR, args.config + ".json")) as f:
        hf_config = json.load(f)
    if args.layers:
        hf_config["num_hidden_layers"] = args.layers
    cfg = LlamaConfig.from_dict(hf_config)
    cfg.use_cache = True
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.eval()
    torch.cuda.synchronize()
    res["build_s"] = time.perf_counter() - t0
    res["weights_bytes"] = int(sum(p.numel() * p.element_size() for p in model.parameters()))
    res["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    res["attn_implementation"] = getattr(model.config, "_attn_implementation", "?")
    emit()
    eager_forward = model.forward
    est = None
    for B, ctx in _parse_shapes(args.shapes):
        if est is not None and deadline - time.time() < 1.2 * est:
            res["skipped"].append(f"hf {B}x{ctx}: time")
            continue
        t_shape = time.time()
        r = {"batch": B, "context": ctx}
        try:
            from transformers import StaticCache
            try:
                cache = StaticCache(config=cfg, max_cache_len=ctx)
            except TypeError:
                cache = StaticCache(config=cfg, max_batch_size=B, max_cache_len=ctx, device="cuda",
                                    dtype=torch.bfloat16)
            ids = torch.randint(0, cfg.vocab_size, (B, 1), device="cuda")
            pos = torch.full((B, 1), ctx - 1, dtype=torch.long, device="cuda")
            cpos = torch.tensor([ctx - 1], dtype=torch.long, device="cuda")
            model.forward = eager_forward
            torch._dynamo.reset()

            def step(fwd):
                out = fwd(input_ids=ids, position_ids=pos, cache_position=cpos, past_key_values=cache,
                          use_cache=True)
                return out.logits[:, -1, :].argmax(-1)

            with torch.no_grad():
                step(model.forward)                       # eager: allocates the static cache
                r["kv_tensors_filled"] = _fill_cache_tensors(torch, cache, B * ctx)   # random KV, not zeros
                fwd, mode = None, None
                for m, full in (("reduce-overhead", True), ("reduce-overhead", False), ("default", False),
                                (None, False)):
                    try:
                        torch._dynamo.reset()
                        f = torch.compile(eager_forward, mode=m, fullgraph=full) if m else eager_forward
                        t0 = time.perf_counter()
                        for _ in range(3):                # compile + cudagraph warm-up
                            step(f)
                        torch.cuda.synchronize()
                        r["compile_s"] = time.perf_counter() - t0
                        fwd, mode = f, (f"{m}, fullgraph={full}" if m else "eager")
                        break
                    except Exception as e:  # noqa: BLE001
                        r.setdefault("compile_errors", []).append(f"{m}/{full}: {e!r}"[:500])
                r["mode"] = mode
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(args.steps)]
                for a, b in ev:
                    a.record()
                    step(fwd)
                    b.record()
                    torch.cuda.synchronize()
                r["step_ms"] = statistics.median(a.elapsed_time(b) for a, b in ev)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(fwd)
                torch.cuda.synchronize()
                r["pipe_ms"] = 1e3 * (time.perf_counter() - t0) / args.steps
            r["tok_s"] = B / (r["step_ms"] * 1e-3)
            kv = B * ctx * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (
                cfg.hidden_size // cfg.num_attention_heads) * 2
            emb = cfg.vocab_size * cfg.hidden_size * 2
            r["bytes"] = res["weights_bytes"] - emb + kv
            r["TBps"] = r["bytes"] / (r["step_ms"] * 1e-3) / 1e12
            del cache
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            r["error"] = repr(e)[:2000]
        res["shapes"].append(r)
        est = time.time() - t_shape
        print(f"[hf] {B}x{ctx}: {r.get('step_ms', r.get('error'))}", file=sys.stderr, flush=True)
        emit()
    return res


# ---------------------------------------------------------------------------------------------------------------
# orchestrator
# ---------------------------------------------------------------------------------------------------------------
def _subprocess_json(cmd, timeout, env=None) -> dict:
    """Runs a worker; returns the last JSON it printed (partial results survive a timeout or a crash)."""
    return run_json_worker(cmd, timeout, MARK, cwd=REPO, env=env, stderr_on_success=True)


def summarize(res: dict) -> str:
    jx = res.get("jax", {})
    ceil = res.get("ceiling_TBps")
    lines = [f"bench_engine_decode: {jx.get('meta', {}).get('device', '?')} config={res['config']} "
             f"commit={res['commit']} attention={jx.get('meta', {}).get('attn_impl_resolved', '?')}",
             f"ceiling {ceil and round(ceil, 3)} TB/s (torch copy {res.get('torch_copy', {}).get('torch_copy_TBps')}, "
             f"jnp copy {jx.get('jax_copy_TBps')}, jnp elementwise {jx.get('jax_elementwise_TBps')})",
             "| B | ctx | attention | sync ms | pipe ms | run ms | tok/s (sync) | GB/step | TB/s (sync) | MBU sync | "
             "MBU pipe | first call s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in jx.get("variants", []):
        if "error" in v:
            lines.append(f"| {v['batch']} | {v['context']} | {v.get('label')} | error: {v['error'][:120]} |")
            continue
        gb = (v["weight_bytes"] + v["kv_bytes"]) / 1e9
        mbu = lambda k: f"{100 * v[k + '_TBps'] / ceil:.1f}%" if ceil else "?"  # noqa: E731
        lines.append(f"| {v['batch']} | {v['context']} | {v['attn_impl']}, mm={v.get('matmul_impl', '?')} | "
                     f"{v['sync_ms']:.2f} | {v['pipe_ms']:.2f} | "
                     f"{v['run_ms']:.2f} | {v['sync_tok_s']:.0f} | {gb:.2f} | {v['sync_TBps']:.2f} | {mbu('sync')} | "
                     f"{mbu('pipe')} | {v['first_call_s']:.1f} |")
    for v in jx.get("variants", []):
        prof = v.get("profile")
        if not prof:
            continue
        if "error" in prof:
            lines.append(f"profile {v['batch']}x{v['context']} mm={v.get('matmul_impl')}: {prof['error'][:200]}")
            continue
        for ln in prof["lines"][:3]:
            lines.append(f"profile {v['batch']}x{v['context']} mm={v.get('matmul_impl')} [{ln['line'][:40]}]: busy "
                         f"{ln['busy_us_per_step']:.0f} us/step, span {ln['span_us_per_step'] or 0:.0f}, "
                         f"{ln['events_per_step']:.0f} events/step")
        if prof["lines"]:
            for t in prof["lines"][0]["top"][:15]:
                lines.append(f"    {t['us_per_step']:8.1f} us  x{t['calls_per_step']:.0f}  {t['name'][:100]}")
    e = jx.get("e2e")
    if e:
        lines.append(f"e2e Engine.step() {e['batch']}x{e['context']}: " +
                     (f"decode step {e['decode_step_ms']:.2f} ms ({e['decode_tok_s']:.0f} tok/s) overlapped, "
                      f"{e['sync']['decode_step_ms']:.2f} ms one step at a time (overlap/sync "
                      f"{e['overlap_over_sync_tok_s']:.2f}x), prefill step {e['prefill_step_s']:.1f}s (incl. compile); "
                      f"host ms/step sync {e['sync'].get('host_ms_per_step')}, overlapped "
                      f"{e['overlap'].get('host_ms_per_step')}"
                      if "error" not in e else e["error"][:300]))
    for s in res.get("hf", {}).get("shapes", []):
        if "error" in s:
            lines.append(f"transformers {s['batch']}x{s['context']}: error {s['error'][:300]}")
            continue
        ours = next((v for v in jx.get("variants", []) if v.get("batch") == s["batch"]
                     and v.get("context") == s["context"] and v.get("label") == "runner" and "error" not in v), None)
        ratio = f", tbjax/transformers = {ours['sync_tok_s'] / s['tok_s']:.2f}x (sync), " \
                f"{ours['run_tok_s'] / s['tok_s']:.2f}x (run)" if ours else ""
        lines.append(f"transformers {s['batch']}x{s['context']} ({s['mode']}): {s['step_ms']:.2f} ms/step, "
                     f"{s['tok_s']:.0f} tok/s, {s['TBps']:.2f} TB/s, compile {s.get('compile_s', 0):.0f}s{ratio}")
    for k in ("skipped",):
        for part in ("jax", "hf"):
            for s in res.get(part, {}).get(k, []):
                lines.append(f"skipped: {s}")
    return "\n".join(lines)


# options the orchestrating process uses itself and does not pass to its workers
_ORCHESTRATOR_ONLY = ("time_budget", "hf_reserve", "smoke", "no_hf", "out", "worker", "deadline_s", "hf_shapes")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama-3.1-8b", help="name of a JSON file in benchmarks/configs/")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weight-dtype", default="bf16", choices=["bf16", "fp8", "fp8-block", "int8", "int4"],
                    help="resident format of the matrices (issue 20: fp8 decode vs bf16): fp8 per output channel, "
                         "fp8-block DeepSeek's 128 x 128 blocks; the compute dtype is --dtype")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=0, help="override the config's layer count (0 = as configured)")
    ap.add_argument("--dump-hlo", default="", help="write the first shape's optimized decode-step HLO here")
    ap.add_argument("--layer-buffers", default="stacked", help="stacked | split | auto (EngineConfig.layer_buffers)")
    ap.add_argument("--command-buffers", default="auto", help="auto | on | off (EngineConfig.command_buffers)")
    ap.add_argument("--fold-norms", action="store_true",
                    help="EngineConfig.fold_norms: RMSNorm weights folded into w_qkv / w_gate_up (2 kernels less/layer)")
    ap.add_argument("--precompile-workers", type=int, default=0,
                    help="compile every grid bucket up front with this many concurrent XLA compiles (0 = lazily)")
    ap.add_argument("--shapes", default="32:1024,64:8192,1:1024,8:1024,64:1024,1:8192,8:8192,32:8192",
                    help="BATCH:CONTEXT list, in priority order (later ones are skipped when time runs out)")
    ap.add_argument("--e2e", default="32:1024", help="BATCH:CONTEXT of the Engine.step() run ('' = none)")
    ap.add_argument("--e2e-new-tokens", type=int, default=16)
    ap.add_argument("--ref-shape", default="32:1024", help="shapes to re-run with impl='reference' ('' = none)")
    ap.add_argument("--hf-shapes", default="32:1024,32:8192")
    ap.add_argument("--attn-impl", default="auto")
    ap.add_argument("--matmul-impl", default="auto", help="decode projections: auto (kernel on GPU) | xla | kernel")
    ap.add_argument("--compare-matmul", default="32:1024", help="shapes also run with the other matmul impl")
    ap.add_argument("--profile", default="32:1024", help="shapes whose decode step is profiled (kernel breakdown)")
    ap.add_argument("--host-profile", default="", help="shapes whose sync decode step's host threads are profiled")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--time-budget", type=float, default=330.0, help="seconds for the whole benchmark")
    ap.add_argument("--hf-reserve", type=float, default=150.0, help="seconds kept for the transformers part")
    ap.add_argument("--smoke", action="store_true", help="CPU: SmolLM2 shapes, tiny batch/context, no torch")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", choices=["jax", "hf"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline-s", type=float, default=1e9, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.smoke:
        args.config, args.shapes, args.e2e, args.ref_shape = "smollm2-135m-instruct", "2:64,1:128", "2:64", "2:64"
        args.e2e_new_tokens, args.steps, args.warmup, args.no_hf = 4, 3, 1, True
        args.compare_matmul, args.profile = "2:64", "2:64"
    if not os.path.isfile(os.path.join(CONFIG_DIR, args.config + ".json")):
        ap.error(f"no config {args.config}.json in {CONFIG_DIR}")
    sys.path.insert(0, REPO)

    if args.worker == "jax":
        jax_worker(args)
        return 0
    if args.worker == "hf":
        hf_worker(args)
        return 0

    t_start = time.time()
    res = {"config": args.config, "dtype": args.dtype, "page_size": args.page_size, "commit": git_commit(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": args.steps, "warmup": args.warmup,
           "layers": args.layers or "config", "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "layer_buffers": args.layer_buffers, "fold_norms": args.fold_norms, "command_buffers": args.command_buffers}
    save = json_saver(args.out, "bench_engine_decode.json", res)

    try:
        import importlib.util
        has_torch = importlib.util.find_spec("torch") is not None
    except Exception:  # noqa: BLE001
        has_torch = False
    if has_torch and not args.smoke:
        r = _subprocess_json([sys.executable, "-c", TORCH_COPY], 120)
        res["torch_copy"] = r
        save()
    # the worker gets every option (only the orchestrator's own left out), the HF worker its shapes on top
    base = [sys.executable, os.path.abspath(__file__)] + forward_argv(ap, args, skip=_ORCHESTRATOR_ONLY)
    run_hf = has_torch and not args.no_hf and args.hf_shapes
    jax_budget = args.time_budget - (time.time() - t_start) - (args.hf_reserve if run_hf else 0)
    cmd = base + ["--worker", "jax", "--deadline-s", str(jax_budget)]
    res["jax"] = _subprocess_json(cmd, jax_budget + 90)   # the deadline is checked between variants
    save()
    if run_hf:
        hf_budget = max(args.time_budget - (time.time() - t_start), 60)
        res["hf"] = _subprocess_json(base + ["--worker", "hf", "--deadline-s", str(hf_budget - 20),
                                             "--shapes", args.hf_shapes], hf_budget)
    else:
        res["hf"] = {"skipped": ["transformers: " + ("torch not installed" if not has_torch else "disabled")]}
    cands = [res.get("torch_copy", {}).get("torch_copy_TBps"), res["jax"].get("jax_copy_TBps"),
             res["jax"].get("jax_elementwise_TBps")]
    cands = [c for c in cands if c]
    res["ceiling_TBps"] = max(cands) if cands else None
    for v in res["jax"].get("variants", []):
        if "error" not in v and res["ceiling_TBps"]:
            for k in ("run", "sync", "pipe"):
                v[f"{k}_MBU"] = v[f"{k}_TBps"] / res["ceiling_TBps"]
    res["total_s"] = time.time() - t_start
    save()
    print(summarize(res))
    print(json.dumps(res, indent=1, default=str))
    bad = [v for v in res["jax"].get("variants", []) if "error" in v] or "variants" not in res["jax"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
