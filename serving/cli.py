"""`python -m tbjax.serve`: load a model, serve it over gRPC and OpenAI-compatible HTTP, drain and stop on SIGINT/SIGTERM.

With no arguments it serves the default model (SmolLM2-135M-Instruct) over gRPC on 127.0.0.1:50051, the OpenAI API on
http://127.0.0.1:8000/v1 (``--http-port``; 0 turns it off) with metrics on 127.0.0.1:9464; any other address only
through an explicit ``--host`` (binds both) / ``--metrics-host``. Sampling defaults come from the model
(``--generation-config``); a request's explicit values win. Start-up: it loads
the model, listens (gRPC health NOT_SERVING, Generate refused with UNAVAILABLE "warming up ..."), compiles every
program the engine can run (``--no-warmup`` skips that), then turns health SERVING and prints one line on stdout
saying where it serves; after that no request should compile anything (``tbjax_xla_compiles_total``). The first
SIGINT/SIGTERM drains (health turns NOT_SERVING, new RPCs are refused, running ones get ``--drain-timeout``
seconds), a second one stops at once.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from typing import Sequence

from .limits import Limits
from .model import ServedModel, model_name_for_path
from .server import Server

__all__ = ["main", "build_parser", "load_served_model"]

log = logging.getLogger("tbjax.serve")

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9464
DEFAULT_HTTP_PORT = 8000
HTTP_ROLES = ("colocated", "router", "split")   # the public API; prefill / decode workers serve none


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tbjax.serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="GGUF file, HF safetensors dir or tbjax checkpoint dir (default: SmolLM2-135M-Instruct); "
                         "'synthetic': SmolLM2-135M's shapes with random weights (benchmarks without the file)")
    ap.add_argument("--served-model-name", default=None, help="name clients use (default: from the model path)")
    ap.add_argument("--generation-config", default="auto",
                    help="sampling defaults: auto (the model's generation_config.json, GGUF sampling metadata, or for "
                         "the default model its card's temperature 0.2 / top_p 0.9), none (temperature 1, no filters) "
                         "or a generation_config.json path; a request's explicit values always win")
    ap.add_argument("--role", default="colocated", choices=["colocated", "prefill", "decode", "router", "split"],
                    help="colocated: one engine does prefill and decode; prefill / decode: a worker of disaggregated "
                         "serving; router: the public API in front of --prefill-workers and --decode-workers; split: "
                         "router + prefill worker + decode worker in this one process, the two engines on disjoint "
                         "device sets (first half / second half of jax.devices())")
    pd = ap.add_argument_group("prefill/decode disaggregation")
    pd.add_argument("--prefill-workers", default="", help="router: comma-separated host:port of prefill workers")
    pd.add_argument("--decode-workers", default="", help="router: comma-separated host:port of decode workers")
    pd.add_argument("--kv-timeout", type=float, default=10.0,
                    help="decode: seconds a KV reservation (or landed KV) lives without progress")
    pd.add_argument("--kv-chunk-pages", type=int, default=8, help="prefill: KV pages per transfer chunk")
    pd.add_argument("--pp", type=int, default=1,
                    help="prefill / split: pipeline-parallel prefill over this many devices (layers split by FLOPs, "
                         "prompts in chunks of --max-num-batched-tokens); split: decode on the next device")
    pd.add_argument("--kv-shm-mb", type=int, default=256,
                    help="decode: shared-memory arena (MiB) for KV from prefill workers on this host (0: gRPC only); "
                         "prefill: 0 never offers shared memory")
    pd.add_argument("--kv-ipc-mb", type=int, default=256,
                    help="decode on a GPU: device staging buffer (MiB) shared by CUDA IPC with GPU prefill workers on "
                         "this host (device-to-device KV; 0: none)")
    pd.add_argument("--kv-copier", default="auto", choices=["auto", "cupy", "jax-pinned", "numpy"],
                    help="how KV pages move between the device and shared memory")
    pd.add_argument("--worker-timeout", type=float, default=60.0,
                    help="router / prefill: seconds to wait for a worker's next message")
    net = ap.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1",
                     help="gRPC and HTTP listen address (loopback unless you say otherwise)")
    net.add_argument("--port", type=int, default=DEFAULT_PORT, help="gRPC port (0: any free port)")
    net.add_argument("--http-port", type=int, default=None,
                     help=f"OpenAI-compatible HTTP port (/v1/completions, /v1/chat/completions, /v1/models, /health, "
                          f"/metrics); 0 turns it off; default {DEFAULT_HTTP_PORT}, or any free port when --port is 0; "
                          f"roles {', '.join(HTTP_ROLES)} only")
    net.add_argument("--metrics-host", default="127.0.0.1", help="Prometheus /metrics listen address")
    net.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                     help="Prometheus port (0: any free port, -1: no metrics endpoint)")
    net.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get on shutdown")
    sec = ap.add_argument_group("security")
    sec.add_argument("--tls-cert", default=None,
                     help="PEM certificate (chain): serve gRPC and the HTTP API over TLS (with --tls-key)")
    sec.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    sec.add_argument("--api-key", default=None,
                     help="require 'authorization: Bearer <key>' on every gRPC call (else UNAUTHENTICATED; gRPC health "
                          "checks stay open) and HTTP request (else 401; GET /health stays open); default: the "
                          "environment variable TBJAX_API_KEY, if set")
    sec.add_argument("--reflection", action=argparse.BooleanOptionalAction, default=True,
                     help="gRPC server reflection (grpcurl can list the services); --no-reflection turns it off")
    d = Limits()
    lim = ap.add_argument_group("limits")
    lim.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the model's context - 1")
    lim.add_argument("--max-tokens-limit", type=int, default=d.max_tokens, help="largest max_tokens accepted")
    lim.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    lim.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
                     help="requests running at once (handed to the engine, not finished); more wait in the queue")
    lim.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                     help="requests waiting in the server's queue for a running place; beyond: "
                          "RESOURCE_EXHAUSTED / 429")
    lim.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes)
    lim.add_argument("--max-prompt-bytes", type=int, default=None,
                     help="UTF-8 bytes of prompt text (a chat's contents) checked before tokenizing; default: 32 x the "
                          "prompt token limit, at least 64 KiB")
    eng = ap.add_argument_group("engine")
    eng.add_argument("--max-num-seqs", type=int, default=None)
    eng.add_argument("--max-num-batched-tokens", type=int, default=None)
    eng.add_argument("--num-pages", type=int, default=None, help="KV pages (default: sized from free memory)")
    eng.add_argument("--page-size", type=int, default=None)
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--kv-dtype", default=None)
    eng.add_argument("--weight-dtype", default=None, choices=["auto", "bf16", "float32", "fp8", "int8", "int4"],
                     help="resident weight format: auto = the checkpoint's own quantization (GGUF Q4/Q8 as int4/int8, "
                          "fp8 block-scaled safetensors as fp8; the default), bf16/float32 = dequantized at load, "
                          "int8/int4/fp8 = converted at load")
    eng.add_argument("--layer-buffers", default=None, choices=["stacked", "split", "auto"],
                     help="engine weight layout: split = per-layer buffers (XLA compiles a step several times faster)")
    eng.add_argument("--overlap-scheduling", action=argparse.BooleanOptionalAction, default=None,
                     help="launch engine step N+1 before waiting for step N (default: on with an accelerator, off on "
                          "CPU); --no-overlap-scheduling runs one step at a time")
    eng.add_argument("--speculative", default=None, metavar="SETTINGS",
                     help="speculative decoding with a sliding-window draft (off by default): key=value list "
                          "draft=self|PATH,num_tokens=K,window=W (e.g. draft=self,num_tokens=4,window=128; "
                          "omitted keys take those defaults) or the same as a JSON object; draft=PATH is a small model "
                          "with the target's tokenizer. Runs without overlapped scheduling (docs/speculative.md)")
    eng.add_argument("--mesh", default=None,
                     help="decode mesh as axis=size list, e.g. dp=4,ep=2 (axes dp, ep, tp, pp; default: one device): "
                          "requests, KV pools, attention-weight shards and routed experts spread over its devices")
    eng.add_argument("--attn-gather", default=None, choices=["all_gather", "ppermute"],
                     help="how each layer's 1/N attention-weight shards are gathered on a mesh (default all_gather)")
    eng.add_argument("--attn-wire", default=None, choices=["native", "fp8"],
                     help="attention weights on the wire: the weights' dtype, or fp8 with block scales")
    eng.add_argument("--ep-mode", default=None, choices=["gather", "all_to_all"],
                     help="how tokens reach the devices of their routed experts (default gather)")
    eng.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=_default_warmup(),
                     help="compile every program the engine can run before reporting ready (health SERVING); "
                          "--no-warmup serves at once and compiles on first use")
    eng.add_argument("--engine-process", action="store_true",
                     help="colocated: run the engine in a child process, off the server's GIL (streams keep up with "
                          "big batches; the child loads the weights, this process only the tokenizer)")
    eng.add_argument("--fake-engine", action="store_true",
                     help="serve serving.fake_engine (a test double, no model) - for testing the front end only")
    eng.add_argument("--fake-step-time", type=float, default=0.0, help="seconds per fake engine step")
    eng.add_argument("--fake-warmup-time", type=float, default=0.0, help="seconds the fake engine's warm-up takes")
    ap.add_argument("--log-level", default="WARNING")
    return ap


def _default_warmup() -> bool:
    from tbjax.llm import default_warmup      # on unless TBJAX_WARMUP=0
    return default_warmup()


def _engine_kw(a: argparse.Namespace) -> dict:
    kw = {k: v for k, v in (("max_num_seqs", a.max_num_seqs), ("max_num_batched_tokens", a.max_num_batched_tokens),
                            ("num_pages", a.num_pages), ("page_size", a.page_size),
                            ("max_model_len", a.max_model_len), ("kv_dtype", a.kv_dtype),
                            ("layer_buffers", a.layer_buffers), ("overlap_scheduling", a.overlap_scheduling),
                            ("mesh", a.mesh), ("weight_dtype", a.weight_dtype))
          if v is not None}
    lay = {k: v for k, v in (("attn_gather", a.attn_gather), ("attn_wire", a.attn_wire), ("ep_mode", a.ep_mode))
           if v is not None}
    if lay:
        from sharding.mesh import DecodeLayout
        kw["decode_layout"] = DecodeLayout(**lay)
    if a.speculative is not None and a.role not in ("router", "prefill"):   # those never decode
        from tbjax.engine.speculative import SpeculativeConfig, SpeculativeConfigError
        try:
            kw["speculative"] = SpeculativeConfig.parse(a.speculative)
        except SpeculativeConfigError as e:
            raise SystemExit(f"tbjax: --speculative: {e}") from None
    return kw


def _child_engine(path, engine_kw: dict, warmup: bool = False, generation_config="auto"):
    """Runs in the engine process (serving/engine_proc.py): load the model, build its engine (the child's loop warms
    it up next, reporting its progress to the server; ``warmup`` is kept for old pickles and ignored). The
    generation config's eos ids end generations there too (the server process fills the sampling defaults)."""
    import tbjax
    llm = tbjax.LLM(path, progress=False, warmup=False, generation_config=generation_config, **engine_kw)
    return llm.engine


def engine_process_model(a: argparse.Namespace):
    """--engine-process: (the ServedModel the server validates requests with, engine=None; the picklable factory
    that builds the engine in the child). This process reads only the model's spec and tokenizer."""
    import functools

    from tbjax.weights import load_model_info

    if a.fake_engine:
        from .fake_engine import FakeEngine, fake_served_model
        kw = {k: v for k, v in (("max_num_seqs", a.max_num_seqs), ("num_pages", a.num_pages),
                                ("max_num_batched_tokens", a.max_num_batched_tokens),
                                ("max_model_len", a.max_model_len), ("page_size", a.page_size)) if v is not None}
        model = fake_served_model(**kw)
        model.engine = None
        return model, functools.partial(FakeEngine, step_time_s=a.fake_step_time, warmup_s=a.fake_warmup_time, **kw)
    spec, tok = load_model_info(a.model)
    defaults = _generation_defaults(a)
    tok.add_eos_token_ids(defaults.eos_token_ids)
    kw = _engine_kw(a)
    ctx = min(kw.get("max_model_len") or spec.max_position, spec.max_position)
    model = ServedModel(name=a.served_model_name or model_name_for_path(a.model), arch=spec.arch, tokenizer=tok,
                        vocab_size=spec.vocab_size, max_context=ctx,
                        eos_token_ids=tuple(getattr(tok, "eos_token_ids", ()) or spec.eos_token_ids),
                        make_params=defaults.make_params, engine=None, generation_defaults=defaults)
    return model, functools.partial(_child_engine, a.model, kw, generation_config=defaults)


def _generation_defaults(a: argparse.Namespace):
    """The served model's sampling defaults (--generation-config); GenerationConfigError (a ValueError) when the file
    is bad."""
    from tbjax.weights import load_generation_defaults
    return load_generation_defaults(None if a.model in (None, "synthetic") else a.model, a.generation_config)


def load_served_model(a: argparse.Namespace) -> ServedModel:
    if a.fake_engine:
        from .fake_engine import fake_served_model
        kw = {k: v for k, v in (("max_num_seqs", a.max_num_seqs), ("num_pages", a.num_pages),
                                ("max_num_batched_tokens", a.max_num_batched_tokens),
                                ("max_model_len", a.max_model_len), ("page_size", a.page_size)) if v is not None}
        return fake_served_model(step_time_s=a.fake_step_time, warmup_s=a.fake_warmup_time, **kw)
    import tbjax

    engine_kw = _engine_kw(a)
    if a.role == "router":   # the router only tokenizes and validates: its engine never runs
        engine_kw.update(num_pages=2, max_num_seqs=1, max_num_batched_tokens=16)
    if a.pp > 1:
        return _pipeline_models(a, engine_kw)
    if a.model == "synthetic":    # SmolLM2-135M shapes, random weights (benchmarks where the model file is absent)
        from .synthetic import synthetic_served_model
        engine_kw = {k: v for k, v in engine_kw.items() if k != "weight_dtype"}
        if a.role == "split":
            return tuple(synthetic_served_model(device=dev, **engine_kw) for dev in split_devices())
        return synthetic_served_model(**engine_kw)
    name = a.served_model_name or model_name_for_path(a.model)
    engine_kw["generation_config"] = _generation_defaults(a)
    if a.role == "split":
        return tuple(ServedModel.from_llm(_llm_on(tbjax, a.model, dev, engine_kw), name=name)
                     for dev in split_devices())
    llm = tbjax.LLM(a.model, progress=False, warmup=False, **engine_kw)   # the server warms it up, listening
    return ServedModel.from_llm(llm, name=name)


def _pipeline_models(a: argparse.Namespace, engine_kw: dict):
    """--pp N: the prefill model is a pipeline over the first N devices; with --role split the decode engine gets
    device N."""
    import jax
    devs = jax.devices()
    need = a.pp + (1 if a.role == "split" else 0)
    if len(devs) < need:
        raise SystemExit(f"tbjax: --pp {a.pp} with --role {a.role} needs {need} devices, this process has {len(devs)}")
    pipe_devs = devs[:a.pp]
    try:
        return _pipeline_models_on(a, engine_kw, devs, pipe_devs)
    except (NotImplementedError, ValueError) as e:
        raise SystemExit(f"tbjax: --pp {a.pp}: {e}") from None


def _pipeline_models_on(a, engine_kw, devs, pipe_devs):
    if a.model == "synthetic":
        from .synthetic import synthetic_served_model
        engine_kw = {k: v for k, v in engine_kw.items() if k != "weight_dtype"}    # random bf16 weights
        pre = synthetic_served_model(pipeline_devices=pipe_devs, **engine_kw)
        if a.role != "split":
            return pre
        return pre, synthetic_served_model(device=devs[a.pp], **engine_kw)
    import tbjax
    from tbjax.weights import load_model
    from .model import pipeline_served_model
    name = a.served_model_name or model_name_for_path(a.model)
    wd = engine_kw.get("weight_dtype")
    spec, params, tok = load_model(a.model, progress=False, weight_dtype=wd)
    pre = pipeline_served_model(spec, params, tok, pipe_devs, name=name,
                                **{k: v for k, v in engine_kw.items() if k != "weight_dtype"})
    if a.role != "split":
        return pre
    defaults = _generation_defaults(a)
    pre.make_params, pre.generation_defaults = defaults.make_params, defaults   # the router validates with it
    return pre, ServedModel.from_llm(_llm_on(tbjax, a.model, devs[a.pp], {**engine_kw, "generation_config": defaults}),
                                     name=name)


def split_devices():
    """--role split: the prefill engine on the first half of this process's devices, decode on the second half."""
    import jax
    devs = jax.devices()
    if len(devs) < 2:
        raise SystemExit(f"tbjax: --role split needs at least 2 devices, this process has {len(devs)}")
    return devs[0], devs[len(devs) // 2]


def _llm_on(tbjax, path, device, engine_kw):
    import jax
    with jax.default_device(device):   # weights and KV pools of this engine live on `device`
        return tbjax.LLM(path, progress=False, warmup=False, **engine_kw)


def http_port(a: argparse.Namespace) -> int | None:
    """The HTTP port to listen on (0: any free port), or None for no HTTP API: --http-port 0 turns it off; unset, it is
    DEFAULT_HTTP_PORT, or any free port when the gRPC port is (--port 0); prefill / decode workers serve none."""
    if a.role not in HTTP_ROLES:
        return None
    if a.http_port is None:
        return 0 if a.port == 0 else DEFAULT_HTTP_PORT
    return None if a.http_port == 0 else a.http_port


def _warmup(model: ServedModel, progress: bool = False) -> float:
    """Warm ``model``'s engine up on this thread (``engine_loop.warm_up``: ``Engine.warmup``, else one short
    request); the server does this itself (``Server(warmup=True)``). Returns the seconds it took."""
    from .engine_loop import warm_up
    t0 = time.perf_counter()
    warm_up(model.engine, progress=progress)
    return time.perf_counter() - t0


def _warmup_line(name: str, info: dict | None) -> str:
    info = info or {}
    if info.get("how") == "already ready":
        return f"tbjax: {name}: the engine was already warmed up"
    what = f"{info['programs']} programs" if isinstance(info.get("programs"), int) else "programs"
    how = " (one short request: this engine has no warmup())" if info.get("how") == "one request" else ""
    return (f"tbjax: {name}: warm-up compiled {what} in {info.get('seconds', 0.0):.1f} s{how}; "
            f"{info.get('xla_compiles', 0)} XLA compiles, {info.get('xla_compile_seconds', 0.0):.1f} s")


async def _serve_split(a: argparse.Namespace, models) -> int:
    """Prefill and decode workers on disjoint device sets of this process, behind the public router. KV moves
    between them over the same transfer service (loopback gRPC, SplitZip, per-chunk checksums) as across hosts."""
    pre_model, dec_model = models
    workers = [Server(m, host="127.0.0.1", port=0, limits=Limits(), metrics_port=None, role=r,
                      kv_timeout_s=a.kv_timeout, kv_chunk_pages=a.kv_chunk_pages, worker_timeout_s=a.worker_timeout,
                      kv_shm_bytes=a.kv_shm_mb << 20, kv_copier=a.kv_copier,
                      kv_ipc_bytes=a.kv_ipc_mb << 20, warmup=a.warmup, warmup_progress=a.warmup)
               for m, r in ((pre_model, "prefill"), (dec_model, "decode"))]
    for w in workers:
        await w.listen()

    async def workers_ready():   # the public router turns SERVING only once both engines are warm
        for w, what in zip(workers, ("prefill", "decode")):
            info = await w.wait_ready()
            if a.warmup:
                print(_warmup_line(f"{what} worker", info), file=sys.stderr, flush=True)

    try:
        a = argparse.Namespace(**{**vars(a), "role": "router", "prefill_workers": workers[0].address,
                                  "decode_workers": workers[1].address})
        return await _serve(a, pre_model, label="split: router + prefill + decode workers in one process",
                            before_ready=workers_ready)
    finally:
        for w in reversed(workers):
            await w.stop(0)


async def _serve(a: argparse.Namespace, model: ServedModel, label: str | None = None, engine_factory=None,
                 before_ready=None) -> int:
    limits = Limits(max_prompt_tokens=a.max_prompt_tokens, max_tokens=a.max_tokens_limit,
                    default_max_tokens=a.default_max_tokens, max_concurrent_requests=a.max_concurrent_requests,
                    max_queued_requests=a.max_queued_requests, max_message_bytes=a.max_message_bytes,
               max_prompt_bytes=a.max_prompt_bytes)
    server = Server(model, host=a.host, port=a.port, limits=limits, metrics_host=a.metrics_host,
                    metrics_port=None if a.metrics_port < 0 else a.metrics_port, role=a.role,
                    prefill_workers=[w for w in a.prefill_workers.split(",") if w],
                    decode_workers=[w for w in a.decode_workers.split(",") if w],
                    kv_timeout_s=a.kv_timeout, kv_chunk_pages=a.kv_chunk_pages, worker_timeout_s=a.worker_timeout,
                    kv_shm_bytes=a.kv_shm_mb << 20, kv_copier=a.kv_copier, kv_ipc_bytes=a.kv_ipc_mb << 20,
                    engine_factory=engine_factory, warmup=a.warmup and a.role != "router", warmup_progress=True,
                    http_port=http_port(a), http_host=a.host, tls_cert=a.tls_cert, tls_key=a.tls_key,
                    api_key=a.api_key, reflection=a.reflection)
    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signame: str) -> None:
        if not stop.is_set():
            print(f"tbjax: {signame}: draining (up to {a.drain_timeout:g} s); send it again to stop now",
                  file=sys.stderr, flush=True)
            stop.set()
        else:
            print(f"tbjax: {signame} again: stopping now", file=sys.stderr, flush=True)
            force.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)
    await server.listen()
    warming = a.warmup and a.role != "router"
    metrics = (f", metrics on http://{a.metrics_host}:{server.bound_metrics_port}/metrics"
               if server.bound_metrics_port is not None else "")
    if server.http_url is not None:
        metrics += f", OpenAI HTTP on {server.http_url}/v1"
    print(f"tbjax: listening on {server.address}{metrics}; health NOT_SERVING until "
          f"{'the engine is warmed up' if warming else 'the engine is ready'}", file=sys.stderr, flush=True)

    async def become_ready():
        if before_ready is not None:
            await before_ready()
        return await server.wait_ready()

    ready = asyncio.ensure_future(become_ready())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done():
        err = ready.exception()
        if err is not None:
            print(f"tbjax: cannot serve: {err}", file=sys.stderr, flush=True)
            stopped.cancel()
            await server.stop(0)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            return 1
        if warming:
            print(_warmup_line(model.name, ready.result()), file=sys.stderr, flush=True)
        print(f"tbjax: serving {model.name} ({label or a.role}) on {server.address} (gRPC tbjax.v1){metrics}",
              flush=True)
    else:   # a signal during the warm-up: nothing runs yet, stop (the loop below drains nothing)
        print("tbjax: stopped before the warm-up finished", file=sys.stderr, flush=True)
    await stop.wait()
    drain = asyncio.create_task(server.stop(a.drain_timeout))
    forced = asyncio.create_task(force.wait())
    await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
    if not drain.done():
        await server.stop(0)   # cancels what still runs (each handler aborts its request in the engine)
        await drain
    forced.cancel()
    if not ready.done():
        await asyncio.wait({ready}, timeout=5)
    if ready.done() and not ready.cancelled():
        ready.exception()   # retrieved: the stop came first
    else:
        ready.cancel()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
    print("tbjax: stopped", file=sys.stderr, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.role == "router" and not (a.prefill_workers and a.decode_workers):
        ap.error("--role router needs --prefill-workers and --decode-workers")
    if a.role == "split" and a.fake_engine:
        ap.error("--role split serves the real model; --fake-engine is for colocated front-end tests")
    if a.pp < 1 or (a.pp > 1 and a.role not in ("prefill", "split")):
        ap.error(f"--pp must be >= 1, and > 1 only with --role prefill or split (got --pp {a.pp}, --role {a.role})")
    if a.pp > 1 and a.fake_engine:
        ap.error("--pp pipelines the real model; --fake-engine has none")
    if a.role != "router" and (a.prefill_workers or a.decode_workers):
        ap.error(f"--prefill-workers / --decode-workers are for --role router, not {a.role}")
    if a.mesh is not None:
        from sharding.mesh import MeshMismatch, parse_mesh_arg
        try:
            parse_mesh_arg(a.mesh)
        except MeshMismatch as e:
            ap.error(f"--mesh {a.mesh!r}: {e}")
        if a.role not in ("colocated", "decode") or a.fake_engine:
            ap.error(f"--mesh is for the colocated or decode role of a real model (got --role {a.role}"
                     f"{', --fake-engine' if a.fake_engine else ''})")
    if (a.tls_cert is None) != (a.tls_key is None):
        ap.error("--tls-cert and --tls-key go together")
    for flag, path in (("--tls-cert", a.tls_cert), ("--tls-key", a.tls_key)):
        if path is not None and not os.path.isfile(path):
            ap.error(f"{flag} {path}: no such file")
    if a.api_key == "":
        ap.error("--api-key must not be empty")
    if a.api_key is None and a.role not in ("prefill", "decode"):
        a.api_key = os.environ.get("TBJAX_API_KEY") or None
    if (a.api_key or a.tls_cert) and a.role in ("prefill", "decode"):
        ap.error(f"--api-key / --tls-cert are for the public server (roles colocated, router, split), not the "
                 f"{a.role} worker (its router talks to it in plaintext without a key: keep workers on a private "
                 "network)")
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        Limits(max_prompt_tokens=a.max_prompt_tokens, max_tokens=a.max_tokens_limit,
               default_max_tokens=a.default_max_tokens, max_concurrent_requests=a.max_concurrent_requests,
               max_queued_requests=a.max_queued_requests, max_message_bytes=a.max_message_bytes,
               max_prompt_bytes=a.max_prompt_bytes)
    except ValueError as e:
        print(f"tbjax: bad limits: {e}", file=sys.stderr)
        return 2
    if a.http_port is not None and not 0 <= a.http_port <= 65535:
        ap.error(f"--http-port must be in 0..65535 (0: no HTTP API), got {a.http_port}")
    if a.http_port and a.role not in HTTP_ROLES:
        ap.error(f"--http-port: --role {a.role} serves no HTTP API (only {', '.join(HTTP_ROLES)})")
    if a.generation_config not in ("auto", "none") and not a.fake_engine:
        from tbjax.weights.generation_config import GenerationConfigError, read_generation_config
        try:
            read_generation_config(a.generation_config)
        except GenerationConfigError as e:
            print(f"tbjax: --generation-config: {e}", file=sys.stderr)
            return 2
    if a.engine_process and (a.role != "colocated" or a.pp > 1):
        ap.error(f"--engine-process is for the colocated role (got --role {a.role}"
                 f"{', --pp ' + str(a.pp) if a.pp > 1 else ''})")
    if a.engine_process and a.model == "synthetic":
        ap.error("--engine-process serves a model file (or --fake-engine); the synthetic model is for benchmarks/"
                 "load_test.py --engine-process")
    t0 = time.perf_counter()
    from tbjax import compile_monitor
    compile_monitor.install()   # count every compile of this process, loading included
    if a.engine_process:
        model, factory = engine_process_model(a)
        print(f"tbjax: {model.name}: the engine starts in a child process", file=sys.stderr, flush=True)
        try:
            return asyncio.run(_serve(a, model, engine_factory=factory))
        except OSError as e:
            print(f"tbjax: cannot serve: {e}", file=sys.stderr)
            return 1
    from sharding.mesh import MeshMismatch
    try:
        model = load_served_model(a)
    except MeshMismatch as e:          # the mesh does not fit the model or the machine: one clear line
        print(f"tbjax: --mesh {a.mesh}: {e}", file=sys.stderr)
        return 2
    print(f"tbjax: loaded {(model[0] if isinstance(model, tuple) else model).name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    try:
        if a.role == "split":
            return asyncio.run(_serve_split(a, model))
        return asyncio.run(_serve(a, model))
    except OSError as e:
        print(f"tbjax: cannot serve: {e}", file=sys.stderr)
        return 1
