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

The settings, their flags and which value wins over which (flag > environment > derived from other settings or the
model > default) are one dataclass, serving/serve_config.py's ServeConfig; this module turns a validated ServeConfig
into running servers.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
import time
from typing import Sequence

from .limits import Limits
from .model import ServedModel, model_name_for_path
from .serve_config import (DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT, DEFAULT_PORT, HTTP_ROLES, ConfigError,  # noqa: F401
                           ServeConfig)
from .serve_config import build_parser as _build_parser
from .server import Server

__all__ = ["main", "build_parser", "load_served_model"]

log = logging.getLogger("tbjax.serve")


def build_parser():
    """The command line, generated from serving.serve_config.ServeConfig (parse_args returns a ServeConfig)."""
    return _build_parser(__doc__.split("\n\n")[0])


def _child_engine(path, engine_kw: dict, generation_config="auto"):
    """Runs in the engine process (serving/engine_proc.py): load the model, build its engine (the child's loop warms
    it up next, reporting its progress to the server). The generation config's eos ids end generations there too
    (the server process fills the sampling defaults)."""
    import tbjax
    llm = tbjax.LLM(path, progress=False, warmup=False, generation_config=generation_config, **engine_kw)
    return llm.engine


def engine_process_model(a: ServeConfig):
    """--engine-process: (the ServedModel the server validates requests with, engine=None; the picklable factory
    that builds the engine in the child). This process reads only the model's spec and tokenizer."""
    import functools

    from tbjax.weights import load_model_info

    if a.fake_engine:
        from .fake_engine import FakeEngine, fake_served_model
        kw = a.engine_sizes()
        model = fake_served_model(**kw)
        model.engine = None
        return model, functools.partial(FakeEngine, step_time_s=a.fake_step_time, warmup_s=a.fake_warmup_time, **kw)
    spec, tok = load_model_info(a.model)
    defaults = _generation_defaults(a)
    tok.add_eos_token_ids(defaults.eos_token_ids)
    kw = a.engine_kwargs()
    ctx = min(kw.get("max_model_len") or spec.max_position, spec.max_position)
    model = ServedModel(name=a.served_model_name or model_name_for_path(a.model), arch=spec.arch, tokenizer=tok,
                        vocab_size=spec.vocab_size, max_context=ctx,
                        eos_token_ids=tuple(getattr(tok, "eos_token_ids", ()) or spec.eos_token_ids),
                        make_params=defaults.make_params, engine=None, generation_defaults=defaults)
    return model, functools.partial(_child_engine, a.model, kw, generation_config=defaults)


def _generation_defaults(a: ServeConfig):
    """The served model's sampling defaults (--generation-config); GenerationConfigError (a ValueError) when the file
    is bad."""
    from tbjax.weights import load_generation_defaults
    return load_generation_defaults(None if a.model in (None, "synthetic") else a.model, a.generation_config)


def load_served_model(a: ServeConfig) -> ServedModel:
    if a.fake_engine:
        from .fake_engine import fake_served_model
        return fake_served_model(step_time_s=a.fake_step_time, warmup_s=a.fake_warmup_time, **a.engine_sizes())
    import tbjax

    engine_kw = a.engine_kwargs()
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


def _pipeline_models(a: ServeConfig, engine_kw: dict):
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


def http_port(a: ServeConfig) -> int | None:
    """The HTTP port to listen on (0: any free port), or None for no HTTP API (ServeConfig.resolved_http_port)."""
    return a.resolved_http_port()


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
    notes = []
    if isinstance(info.get("programs_total"), int) and info["programs_total"] != info.get("programs"):
        what = f"{info['programs']} step programs"
        notes.append(f"{info['programs_total']} programs in all")
    if isinstance(info.get("loaded"), int) and isinstance(info.get("compiled"), int):
        notes.append(f"{info['loaded']} loaded ready-made, {info['compiled']} compiled")
    if notes:
        what += " (" + "; ".join(notes) + ")"
    how = " (one short request: this engine has no warmup())" if info.get("how") == "one request" else ""
    pages = f"; KV pool {info['kv_pages']} pages" if isinstance(info.get("kv_pages"), int) else ""
    return (f"tbjax: {name}: warm-up readied {what} in {info.get('seconds', 0.0):.1f} s{how}; "
            f"{info.get('xla_compiles', 0)} XLA compiles, {info.get('xla_compile_seconds', 0.0):.1f} s{pages}")


async def _serve_split(a: ServeConfig, models) -> int:
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
        a = dataclasses.replace(a, role="router", prefill_workers=workers[0].address,
                                decode_workers=workers[1].address)
        return await _serve(a, pre_model, label="split: router + prefill + decode workers in one process",
                            before_ready=workers_ready)
    finally:
        for w in reversed(workers):
            await w.stop(0)


async def _serve(a: ServeConfig, model: ServedModel, label: str | None = None, engine_factory=None,
                 before_ready=None) -> int:
    server = Server(model, host=a.host, port=a.port, limits=a.limits(), metrics_host=a.metrics_host,
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
    try:
        a.validate()
    except ConfigError as e:
        if e.usage:
            ap.error(str(e))
        print(f"tbjax: {e}", file=sys.stderr)
        return 2
    a = a.with_environment()
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    first = model[0] if isinstance(model, tuple) else model
    print(f"tbjax: loaded {first.name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    try:
        if a.role == "split":
            return asyncio.run(_serve_split(a, model))
        return asyncio.run(_serve(a, model))
    except OSError as e:
        print(f"tbjax: cannot serve: {e}", file=sys.stderr)
        return 1
