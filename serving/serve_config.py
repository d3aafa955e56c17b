"""Every setting of `python -m tbjax.serve` in one dataclass; the command line is generated from it.

Why: the server has ~60 settings across roles (colocated, prefill / decode workers, router, split), pipeline prefill,
an engine process and a fake engine. Argparse calls and cross-checks written apart from the settings let the flags,
their defaults, their help and what may go with what disagree. Here each setting is one field (type, default, help,
the default as help shows it, choices, flag group); `build_parser` turns the fields into flags, and
`ServeConfig.validate` holds every rule on the settings, each failure a `ConfigError` naming the flags.

Which value wins, highest first:
  1. a flag on the command line;
  2. the environment, for two settings only: TBJAX_WARMUP=0 turns the default warm-up off (``--warmup`` /
     ``--no-warmup`` still win), and TBJAX_API_KEY is the API key of the public roles (colocated, router, split)
     when ``--api-key`` is not given. There is no configuration file;
  3. values derived from other settings or from the model when a field is None: ``--http-port`` (8000, or any free
     port when ``--port 0``; none for prefill / decode workers), ``--max-prompt-tokens`` (the model's context - 1),
     the engine sizes (``--num-pages`` from free memory, ``--max-model-len`` the model's, the rest
     tbjax.engine.EngineConfig's defaults);
  4. the field's default here.

Sampling defaults have an order of their own, per request field, highest first: the request's explicit value; with
``--generation-config PATH`` that file, with ``none`` nothing; with ``auto`` (the default) the model's own
(generation_config.json, GGUF sampling metadata, the default model's card); the library's (temperature 1, no
filters). See tbjax/weights/generation_config.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from tbjax import cli
from tbjax.engine import EngineConfig
from tbjax.engine.kv_cache import KV_DTYPES

from .limits import Limits

__all__ = ["ServeConfig", "ConfigError", "build_parser", "ROLES", "HTTP_ROLES", "DEFAULT_PORT", "DEFAULT_HTTP_PORT",
           "DEFAULT_METRICS_PORT"]

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9464
DEFAULT_HTTP_PORT = 8000
ROLES = ("colocated", "prefill", "decode", "router", "split")
HTTP_ROLES = ("colocated", "router", "split")   # the public API; prefill / decode workers serve none
WEIGHT_DTYPES = ("auto", "bf16", "float32", "fp8", "int8", "int4")
_LIMITS = Limits()
_ENGINE = EngineConfig()


class ConfigError(ValueError):
    """A bad setting or settings that cannot go together; the message names the flags. ``usage``: True for a
    command-line mistake (argparse's error: the usage, then the message, exit 2); False for a value the server's
    parts refuse (limits, a generation config file: one line ``tbjax: MESSAGE``, exit 2)."""

    def __init__(self, message: str, usage: bool = True):
        super().__init__(message)
        self.usage = usage


def _s(default, help: str, group: str | None = None, *, shown: str | None = None, choices=None, metavar=None,
       flag: str | None = None, env_default=None, convert=None):
    """A setting: a dataclass field whose metadata says how its flag looks. help: what it does (required); shown:
    the default as help writes it (required when the default is None or "": what the server does then); choices:
    the values allowed (None stays allowed when it is the default); flag: None (takes a value), "bool" (--x / --no-x)
    or "store_true"; env_default: a function giving the default from the environment (rule 2); convert: the flag's
    value type when the annotation's is not it (e.g. str.upper)."""
    if not help:
        raise TypeError("a setting needs its help text")
    if default in (None, "") and not shown:
        raise TypeError(f"a setting with default {default!r} needs shown=: what the server does then")
    return field(default=default, metadata=dict(help=help, group=group, shown=shown, choices=choices, metavar=metavar,
                                                flag=flag, env_default=env_default, convert=convert))


def _warmup_from_env() -> bool:
    return os.environ.get("TBJAX_WARMUP", "1") != "0"     # the same rule as tbjax.llm.default_warmup


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class ServeConfig:
    """The settings of one `python -m tbjax.serve` process (see the module docstring for what wins)."""

    model: str | None = _s(None, "GGUF file, HF safetensors dir or tbjax checkpoint dir; 'synthetic': SmolLM2-135M's "
                                 "shapes with random weights (benchmarks without the file)",
                           shown="SmolLM2-135M-Instruct")
    served_model_name: str | None = _s(None, "name clients use", shown="from the model path")
    generation_config: str = _s("auto", "sampling defaults: auto (the model's generation_config.json, GGUF sampling "
                                        "metadata, or for the default model its card's temperature 0.2 / top_p 0.9), "
                                        "none (temperature 1, no filters) or a generation_config.json path; a "
                                        "request's explicit values always win")
    role: str = _s("colocated", "colocated: one engine does prefill and decode; prefill / decode: a worker of "
                                "disaggregated serving; router: the public API in front of --prefill-workers and "
                                "--decode-workers; split: router + prefill worker + decode worker in this one "
                                "process, the two engines on disjoint device sets (first half / second half of "
                                "jax.devices())", choices=ROLES)
    # prefill/decode disaggregation
    prefill_workers: str = _s("", "router: comma-separated host:port of prefill workers", "pd", shown="none")
    decode_workers: str = _s("", "router: comma-separated host:port of decode workers", "pd", shown="none")
    kv_timeout: float = _s(10.0, "decode: seconds a KV reservation (or landed KV) lives without progress", "pd")
    kv_chunk_pages: int = _s(8, "prefill: KV pages per transfer chunk", "pd")
    pp: int = _s(1, "prefill / split: pipeline-parallel prefill over this many devices (layers split by FLOPs, "
                    "prompts in chunks of --max-num-batched-tokens); split: decode on the next device", "pd")
    kv_shm_mb: int = _s(256, "decode: shared-memory arena (MiB) for KV from prefill workers on this host (0: gRPC "
                             "only); prefill: 0 never offers shared memory", "pd")
    kv_ipc_mb: int = _s(256, "decode on a GPU: device staging buffer (MiB) shared by CUDA IPC with GPU prefill "
                             "workers on this host (device-to-device KV; 0: none)", "pd")
    kv_copier: str = _s("auto", "how KV pages move between the device and shared memory", "pd",
                        choices=("auto", "cupy", "jax-pinned", "numpy"))
    worker_timeout: float = _s(60.0, "router / prefill: seconds to wait for a worker's next message", "pd")
    # network
    host: str = _s("127.0.0.1", "gRPC and HTTP listen address (loopback unless you say otherwise)", "network")
    port: int = _s(DEFAULT_PORT, "gRPC port (0: any free port)", "network")
    http_port: int | None = _s(None, "OpenAI-compatible HTTP port (/v1/completions, /v1/chat/completions, /v1/models, "
                                     f"/health, /metrics); 0 turns it off; roles {', '.join(HTTP_ROLES)} only",
                               "network", shown=f"{DEFAULT_HTTP_PORT}, or any free port when --port is 0")
    metrics_host: str = _s("127.0.0.1", "Prometheus /metrics listen address", "network")
    metrics_port: int = _s(DEFAULT_METRICS_PORT, "Prometheus port (0: any free port, -1: no metrics endpoint)",
                           "network")
    drain_timeout: float = _s(30.0, "seconds running requests get on shutdown", "network")
    # security
    tls_cert: str | None = _s(None, "PEM certificate (chain): serve gRPC and the HTTP API over TLS (with --tls-key)",
                              "security", shown="none, plaintext")
    tls_key: str | None = _s(None, "PEM private key of --tls-cert", "security", shown="none")
    api_key: str | None = _s(None, "require 'authorization: Bearer <key>' on every gRPC call (else UNAUTHENTICATED; "
                                   "gRPC health checks stay open) and HTTP request (else 401; GET /health stays "
                                   "open)", "security",
                             shown="the environment variable TBJAX_API_KEY if set, else no key")
    reflection: bool = _s(True, "gRPC server reflection (grpcurl can list the services); --no-reflection turns it "
                                "off", "security", flag="bool")
    # limits
    max_prompt_tokens: int | None = _s(None, "longest prompt in tokens", "limits", shown="the model's context - 1")
    max_tokens_limit: int = _s(_LIMITS.max_tokens, "largest max_tokens accepted", "limits")
    default_max_tokens: int = _s(_LIMITS.default_max_tokens, "max_tokens of a request that does not say", "limits")
    max_concurrent_requests: int = _s(_LIMITS.max_concurrent_requests, "requests running at once (handed to the "
                                      "engine, not finished); more wait in the queue", "limits")
    max_queued_requests: int = _s(_LIMITS.max_queued_requests, "requests waiting in the server's queue for a "
                                  "running place; beyond: RESOURCE_EXHAUSTED / 429", "limits")
    max_message_bytes: int = _s(_LIMITS.max_message_bytes, "largest request message", "limits")
    max_prompt_bytes: int | None = _s(None, "UTF-8 bytes of prompt text (a chat's contents) checked before "
                                            "tokenizing", "limits",
                                      shown="32 x the prompt token limit, at least 64 KiB")
    # engine (the defaults shown are tbjax.engine.EngineConfig's: the engine decides what is not given)
    max_num_seqs: int | None = _s(None, "sequences in one engine step", "engine", shown=str(_ENGINE.max_num_seqs))
    max_num_batched_tokens: int | None = _s(None, "tokens in one engine step (prefill chunk size)", "engine",
                                            shown="16384 on GPU / TPU, 512 on CPU (at least --max-num-seqs)")
    num_pages: int | None = _s(None, "KV pages", "engine", shown="sized from free memory")
    page_size: int | None = _s(None, "tokens per KV page", "engine", shown=str(_ENGINE.page_size))
    max_model_len: int | None = _s(None, "longest sequence (prompt + output) in tokens", "engine",
                                   shown="the model's context")
    kv_dtype: str | None = _s(None, "KV cache dtype", "engine", shown=f"{_ENGINE.kv_dtype}: the weights' compute dtype",
                              choices=("auto", *KV_DTYPES))
    weight_dtype: str | None = _s(None, "resident weight format: auto = the checkpoint's own quantization (GGUF Q4/Q8 "
                                        "as int4/int8, fp8 block-scaled safetensors as fp8), bf16/float32 = "
                                        "dequantized at load, int8/int4/fp8 = converted at load", "engine",
                                  shown="auto", choices=WEIGHT_DTYPES)
    layer_buffers: str | None = _s(None, "engine weight layout: split = per-layer buffers (XLA compiles a step "
                                         "several times faster)", "engine", shown=_ENGINE.layer_buffers,
                                   choices=("stacked", "split", "auto"))
    overlap_scheduling: bool | None = _s(None, "launch engine step N+1 before waiting for step N; "
                                               "--no-overlap-scheduling runs one step at a time", "engine",
                                         shown="on with an accelerator, off on CPU", flag="bool")
    speculative: str | None = _s(None, "speculative decoding with a sliding-window draft: key=value list "
                                       "draft=self|PATH,num_tokens=K,window=W (e.g. draft=self,num_tokens=4,"
                                       "window=128; omitted keys take those defaults) or the same as a JSON object; "
                                       "draft=PATH is a small model with the target's tokenizer. Runs without "
                                       "overlapped scheduling (docs/speculative.md)", "engine", shown="off",
                                 metavar="SETTINGS")
    deterministic: bool = _s(False, "batch-invariant steps: a request's tokens and logprobs do not depend on "
                                    "concurrent traffic or chunking (every step padded to --max-num-batched-tokens; "
                                    "docs/step.md)", "engine", flag="store_true")
    mesh: str | None = _s(None, "decode mesh as axis=size list, e.g. dp=4,ep=2 (axes dp, ep, tp, pp): requests, KV "
                                "pools, attention-weight shards and routed experts spread over its devices", "engine",
                          shown="one device")
    attn_gather: str | None = _s(None, "how each layer's 1/N attention-weight shards are gathered on a mesh",
                                 "engine", shown="all_gather", choices=("all_gather", "ppermute"))
    attn_wire: str | None = _s(None, "attention weights on the wire: the weights' dtype, or fp8 with block scales",
                               "engine", shown="native", choices=("native", "fp8"))
    ep_mode: str | None = _s(None, "how tokens reach the devices of their routed experts", "engine", shown="gather",
                             choices=("gather", "all_to_all"))
    warmup: bool = _s(True, "compile every program the engine can run before reporting ready (health SERVING); "
                            "--no-warmup serves at once and compiles on first use", "engine",
                      shown="on unless TBJAX_WARMUP=0", flag="bool", env_default=_warmup_from_env)
    engine_process: bool = _s(False, "colocated: run the engine in a child process, off the server's GIL (streams "
                                     "keep up with big batches; the child loads the weights, this process only the "
                                     "tokenizer)", "engine", flag="store_true")
    fake_engine: bool = _s(False, "serve serving.fake_engine (a test double, no model) - for testing the front end "
                                  "only", "engine", flag="store_true")
    fake_step_time: float = _s(0.0, "seconds per fake engine step", "engine")
    fake_warmup_time: float = _s(0.0, "seconds the fake engine's warm-up takes", "engine")
    log_level: str = _s("WARNING", "Python logging level", choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                        convert=str.upper)

    # ---- the rules on settings ------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Every rule on the settings, in the order they are reported; ConfigError naming the flags. Reads files
        only to check them (TLS files exist, a --generation-config file parses)."""
        for f in dataclasses.fields(self):      # argparse checks these for flags; here for configs built in code
            allowed, value = f.metadata["choices"], getattr(self, f.name)
            if allowed is not None and value not in allowed and not (value is None and f.default is None):
                raise ConfigError(f"{_flag(f.name)}: invalid choice {value!r} (choose from {', '.join(allowed)})")
        if self.role == "router" and not (self.prefill_workers and self.decode_workers):
            raise ConfigError("--role router needs --prefill-workers and --decode-workers")
        if self.role == "split" and self.fake_engine:
            raise ConfigError("--role split serves the real model; --fake-engine is for colocated front-end tests")
        if self.pp < 1 or (self.pp > 1 and self.role not in ("prefill", "split")):
            raise ConfigError(f"--pp must be >= 1, and > 1 only with --role prefill or split (got --pp {self.pp}, "
                              f"--role {self.role})")
        if self.pp > 1 and self.fake_engine:
            raise ConfigError("--pp pipelines the real model; --fake-engine has none")
        if self.role != "router" and (self.prefill_workers or self.decode_workers):
            raise ConfigError(f"--prefill-workers / --decode-workers are for --role router, not {self.role}")
        if self.mesh is not None:
            from sharding.mesh import MeshMismatch, parse_mesh_arg
            try:
                parse_mesh_arg(self.mesh)
            except MeshMismatch as e:
                raise ConfigError(f"--mesh {self.mesh!r}: {e}") from None
            if self.role not in ("colocated", "decode") or self.fake_engine:
                raise ConfigError(f"--mesh is for the colocated or decode role of a real model (got --role "
                                  f"{self.role}{', --fake-engine' if self.fake_engine else ''})")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{flag} {path}: no such file")
        if self.api_key == "":
            raise ConfigError("--api-key must not be empty")
        if (self.api_key or self.tls_cert) and self.role in ("prefill", "decode"):
            raise ConfigError(f"--api-key / --tls-cert are for the public server (roles colocated, router, split), "
                              f"not the {self.role} worker (its router talks to it in plaintext without a key: keep "
                              "workers on a private network)")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ConfigError(f"--http-port must be in 0..65535 (0: no HTTP API), got {self.http_port}")
        if self.http_port and self.role not in HTTP_ROLES:
            raise ConfigError(f"--http-port: --role {self.role} serves no HTTP API (only {', '.join(HTTP_ROLES)})")
        if self.engine_process and (self.role != "colocated" or self.pp > 1):
            raise ConfigError(f"--engine-process is for the colocated role (got --role {self.role}"
                              f"{', --pp ' + str(self.pp) if self.pp > 1 else ''})")
        if self.engine_process and self.model == "synthetic":
            raise ConfigError("--engine-process serves a model file (or --fake-engine); the synthetic model is for "
                              "benchmarks/load_test.py --engine-process")
        self.engine_kwargs()            # --speculative parses
        try:
            self.limits()
        except ValueError as e:
            raise ConfigError(f"bad limits: {e}", usage=False) from None
        if self.generation_config not in ("auto", "none") and not self.fake_engine:
            from tbjax.weights.generation_config import GenerationConfigError, read_generation_config
            try:
                read_generation_config(self.generation_config)
            except GenerationConfigError as e:
                raise ConfigError(f"--generation-config: {e}", usage=False) from None

    def with_environment(self) -> "ServeConfig":
        """Rule 2 for the API key: TBJAX_API_KEY when --api-key was not given, on the public roles."""
        if self.api_key is None and self.role not in ("prefill", "decode"):
            return dataclasses.replace(self, api_key=os.environ.get("TBJAX_API_KEY") or None)
        return self

    # ---- what the pieces are built from ---------------------------------------------------------------------------
    def limits(self) -> Limits:
        """The server's request limits (ValueError naming the field when one is out of range)."""
        return Limits(max_prompt_tokens=self.max_prompt_tokens, max_tokens=self.max_tokens_limit,
                      default_max_tokens=self.default_max_tokens, max_concurrent_requests=self.max_concurrent_requests,
                      max_queued_requests=self.max_queued_requests, max_message_bytes=self.max_message_bytes,
                      max_prompt_bytes=self.max_prompt_bytes)

    def resolved_http_port(self) -> int | None:
        """The HTTP port to listen on (0: any free port), or None for no HTTP API (rule 3)."""
        if self.role not in HTTP_ROLES:
            return None
        if self.http_port is None:
            return 0 if self.port == 0 else DEFAULT_HTTP_PORT
        return None if self.http_port == 0 else self.http_port

    def engine_sizes(self) -> dict:
        """The engine size settings that were given (the engine derives the others)."""
        return {k: getattr(self, k) for k in ("max_num_seqs", "max_num_batched_tokens", "num_pages", "page_size",
                                              "max_model_len") if getattr(self, k) is not None}

    def engine_kwargs(self) -> dict:
        """Keyword arguments of tbjax.LLM / EngineConfig for the settings that were given."""
        kw = self.engine_sizes()
        kw.update({k: getattr(self, k) for k in ("kv_dtype", "layer_buffers", "overlap_scheduling", "mesh",
                                                 "weight_dtype") if getattr(self, k) is not None})
        if self.deterministic:
            kw["deterministic"] = True
        lay = {k: getattr(self, k) for k in ("attn_gather", "attn_wire", "ep_mode") if getattr(self, k) is not None}
        if lay:
            from sharding.mesh import DecodeLayout
            kw["decode_layout"] = DecodeLayout(**lay)
        if self.speculative is not None and self.role not in ("router", "prefill"):   # those never decode
            from tbjax.engine.speculative import SpeculativeConfig, SpeculativeConfigError
            try:
                kw["speculative"] = SpeculativeConfig.parse(self.speculative)
            except SpeculativeConfigError as e:
                raise ConfigError(f"--speculative: {e}") from None
        return kw


_GROUP_TITLES = {"pd": "prefill/decode disaggregation", "network": "network", "security": "security",
                 "limits": "limits", "engine": "engine"}


class _Parser(argparse.ArgumentParser):
    """parse_args returns the config dataclass (rule 1 over the fields' defaults, rule 2 for the warm-up)."""

    config: type = None

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        return self.config(**vars(ns))


def build_parser(description: str | None = None, config: type = ServeConfig) -> argparse.ArgumentParser:
    """The command line of ``config`` (ServeConfig): a flag per field (``--field-name``), in the fields' groups, its
    help ending in ``(default: ...)``. TypeError naming the field when a field is not a setting made by ``_s``."""
    ap = _Parser(prog=cli.prog("python -m tbjax.serve"), description=description)
    ap.config = config
    groups = {}
    for f in dataclasses.fields(config):
        m = f.metadata
        if "help" not in m:
            raise TypeError(f"{config.__name__}.{f.name} is not a setting: declare it with serve_config._s")
        g = m["group"]
        if g is None:
            target = ap
        elif g not in _GROUP_TITLES:
            raise TypeError(f"{config.__name__}.{f.name}: unknown flag group {g!r} (one of {', '.join(_GROUP_TITLES)})")
        else:
            target = groups.get(g) or groups.setdefault(g, ap.add_argument_group(_GROUP_TITLES[g]))
        default = m["env_default"]() if m["env_default"] is not None else f.default
        shown = m["shown"] if m["shown"] is not None else default
        kw = dict(default=default, help=f"{m['help']} (default: {shown})".replace("%", "%%"))
        if m["flag"] == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif m["flag"] == "store_true":
            kw["action"] = "store_true"
        else:
            kw["type"] = m["convert"] or _value_type(config, f)
            if m["choices"] is not None:
                kw["choices"] = list(m["choices"])
            if m["metavar"] is not None:
                kw["metavar"] = m["metavar"]
        target.add_argument(_flag(f.name), **kw)
    return ap


def _value_type(config: type, f: dataclasses.Field):
    """The argparse type of a field's annotation ("int | None" -> int)."""
    base = f.type.__name__ if isinstance(f.type, type) else str(f.type).split("|")[0].strip()
    types = {"int": int, "float": float, "str": str}
    if base not in types:
        raise TypeError(f"{config.__name__}.{f.name}: a flag's value is int, float or str, not {f.type!r}")
    return types[base]
