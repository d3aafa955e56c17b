"""The OpenAI-compatible HTTP front end: FastAPI on uvicorn, on the gRPC server's own event loop and engine loop.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming: ``data: {...}`` chunks,
then ``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with the usage), ``GET /v1/models``
(and ``/v1/models/{id}``), ``GET /health`` (503 until the engine is warmed up and while the server drains, 200
otherwise), ``GET /metrics`` (the server's Prometheus registry, the same as on the metrics port).

Requests go through the same admission (``TbjaxServicer.admit``: in-flight and queue limits), validation
(``limits.check_sampling`` on a ``tbjax.v1.SamplingParams`` built from the JSON), sampling defaults
(``ServedModel.make_params``: the model's generation config) and request streams as gRPC's ``Generate``, so the same
request gives the same tokens over both. What is implemented:

- completions: ``prompt`` as a string, a list of token ids, or a list of either (one choice per prompt and n);
  ``max_tokens`` (default 16, as OpenAI's; 0 only with ``echo``), ``echo`` (the prompt text before the completion),
  ``logprobs`` (the top-k per token, plus the sampled token's, OpenAI's legacy format), ``echo`` with ``logprobs``:
  prompt logprobs too (serving/prompt_logprobs.py: one whole-sequence forward over the engine's weights; what
  lm-eval's loglikelihood tasks ask for with ``max_tokens`` 0 or 1);
- chat: ``messages`` (system / developer (rendered as system) / user / assistant / tool, string content or text
  parts) rendered with the model's chat template, ``max_tokens`` / ``max_completion_tokens``, ``logprobs`` +
  ``top_logprobs``, ``chat_template_kwargs``, ``add_generation_prompt``;
- both: ``temperature``, ``top_p``, ``seed``, ``stop`` (a string or a list), ``n`` (the n requests of one prompt
  are handed to the engine in one command, so the prefix cache shares their prompt's pages; with a ``seed``, choice
  i samples with seed + i), ``stream``, ``stream_options``, ``user`` (ignored), and the extensions ``top_k`` (-1 or 0:
  off), ``min_p``, ``ignore_eos``, ``stop_token_ids``. Fields sampling leaves unset take the model's defaults.

Unsupported fields are refused with 400 naming them (``presence_penalty`` / ``frequency_penalty`` other than 0,
``logit_bias``, ``suffix``, ``best_of`` other than n, ``tools``, ``response_format`` other than text, any unknown
field), never ignored. Errors are OpenAI's error JSON (``{"error": {"message", "type", "param", "code"}}``): 400 bad
parameter, 404 unknown model, 429 over the in-flight / queue limits, 503 warming up or draining, 500 engine failure;
an error after a stream started arrives as one ``data: {"error": ...}`` chunk.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi import Request
from fastapi.responses import StreamingResponse

from pallas_kernels.utils import is_int, is_number

from .api import pb
from .engine_loop import EngineStopped
from .limits import (RequestError, StreamFailed, build_params, check_sampling, check_text_bytes, shown, take_stops,
                     token_ids_in_vocab)

__all__ = ["HTTPFrontend", "APIError", "parse_completion_request", "parse_chat_request"]

log = logging.getLogger(__name__)
request_log = logging.getLogger("tbjax.requests")

DEFAULT_COMPLETION_MAX_TOKENS = 16    # OpenAI's default for /v1/completions
MAX_N = 128

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.INTERNAL: 500,
}
_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 409: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable", 504: "timeout", 500: "server_error"}
_ERROR_CODES = {404: "model_not_found", 429: "rate_limit_exceeded", 503: "service_unavailable"}


class APIError(Exception):
    """An HTTP error answer in OpenAI's error format."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code if code is not None else _ERROR_CODES.get(status)
        self.type = type_ or _ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, message: str, param: str | None = None) -> "APIError":
        return cls(_HTTP_STATUS.get(code, 500), message, param=param)


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


_FIELD_RE = re.compile(r"^(?:sampling params: )?([a-z_]+)")


def _from_request_error(e: RequestError, known: set[str]) -> APIError:
    m = _FIELD_RE.match(e.message)
    param = m.group(1) if m and m.group(1) in known else None
    return APIError.from_grpc(e.code, e.message, param=param)


# -- request parsing ---------------------------------------------------------------------------------------------
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream", "stream_options", "stop",
             "seed", "user", "ignore_eos", "stop_token_ids", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "logit_bias", "logprobs"}
COMPLETION_FIELDS = _SAMPLING | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = _SAMPLING | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                           "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "add_generation_prompt",
                           "store", "metadata", "service_tier", "modalities"}
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def _get_int(body: dict, key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not is_int(v):
        raise _bad(f"{key} must be an integer, got {shown(v)}", key)
    return v


def _get_num(body: dict, key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not is_number(v):
        raise _bad(f"{key} must be a number, got {shown(v)}", key)
    return float(v)


def _get_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"{key} must be true or false, got {shown(v)}", key)
    return v


def _unsupported(body: dict, allowed: set[str]) -> None:
    extra = sorted(k for k in body if k not in allowed)
    if extra:
        names = ", ".join(shown(k)[1:-1] if isinstance(k, str) else shown(k) for k in extra[:8])
        more = f" and {len(extra) - 8} more" if len(extra) > 8 else ""
        raise _bad(f"unsupported parameter{'s' if len(extra) > 1 else ''}: {names}{more} (this server does not "
                   "implement them; leave them out)", extra[0][:64])
    neutral = (("presence_penalty", (0, 0.0)), ("frequency_penalty", (0, 0.0)), ("repetition_penalty", (1, 1.0)))
    for key, ok in neutral:
        v = body.get(key)
        if v is not None and v not in ok:
            raise _bad(f"{key}={shown(v)} is not supported (only {ok[0]}): tbjax samples without penalties", key)
    if body.get("logit_bias"):
        raise _bad("logit_bias is not supported", "logit_bias")
    if body.get("suffix"):
        raise _bad("suffix (insertion) is not supported", "suffix")
    if body.get("tools"):
        raise _bad("tools (function calling) are not supported: tool calls are not parsed from the output", "tools")
    tc = body.get("tool_choice")
    if tc is not None and tc != "none" and tc != "auto":
        raise _bad(f"tool_choice={shown(tc)} is not supported (no tools)", "tool_choice")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise _bad(f"response_format={shown(rf)} is not supported (only {{'type': 'text'}})", "response_format")
    if body.get("store"):
        raise _bad("store is not supported", "store")
    if body.get("metadata"):
        raise _bad("metadata is not supported (nothing is stored)", "metadata")
    st = body.get("service_tier")
    if st is not None and st not in ("auto", "default"):
        raise _bad(f"service_tier={shown(st)} is not supported", "service_tier")
    mod = body.get("modalities")
    if mod is not None and mod != ["text"]:
        raise _bad(f"modalities={shown(mod)} is not supported (only ['text'])", "modalities")
    u = body.get("user")
    if u is not None and not isinstance(u, str):
        raise _bad(f"user must be a string, got {shown(u)}", "user")


@dataclass
class Job:
    """A parsed request: prompts (token ids, their text for echo), the engine requests per prompt, how to answer."""

    kind: str                                   # "completion" | "chat"
    prompts: list[list[int]]
    prompt_texts: list[str | None]              # completion echo: the prompt as text (None: decode the ids)
    sampling: Any                               # tbjax.v1.SamplingParams message (checked per prompt)
    n: int = 1
    seed: int | None = None
    max_tokens: int | None = None               # None: the server's default (chat)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None                 # completion: top-k per token; chat: top_logprobs (None: no logprobs)
    params: list = field(default_factory=list)  # per prompt: engine SamplingParams (None: nothing to generate)


def _sampling_message(body: dict, max_tokens: int | None, logprobs: int | None, names: dict[str, str]):
    sp = pb.SamplingParams()

    def put(key, value, wire=None):
        try:
            setattr(sp, wire or key, value)
        except (ValueError, TypeError):
            raise _bad(f"{names.get(key, key)}={shown(value)} is out of range", names.get(key, key)) from None

    if max_tokens is not None:
        put("max_tokens", max_tokens)
    for key in ("temperature", "top_p", "min_p"):
        v = _get_num(body, key)
        if v is not None:
            put(key, v)
    k = _get_int(body, "top_k")
    if k is not None:
        put("top_k", 0 if k == -1 else k)      # vLLM's -1 = off
    seed = _get_int(body, "seed")
    if seed is not None:
        put("seed", seed)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad(f"stop must be a string or a list of strings, got {shown(stop)}", "stop")
        sp.stop.extend(stops)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(is_int(i) for i in ids):
            raise _bad(f"stop_token_ids must be a list of integers, got {shown(ids)}", "stop_token_ids")
        try:
            sp.stop_token_ids.extend(ids)
        except ValueError:
            raise _bad("stop_token_ids: out of range", "stop_token_ids") from None
    if _get_bool(body, "ignore_eos"):
        sp.ignore_eos = True
    if logprobs is not None:
        put("logprobs", max(1, logprobs))       # the engine computes them when asked for at least one
    return sp, seed


def _common(body: dict, kind: str) -> tuple[int, bool, bool]:
    n = _get_int(body, "n")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise _bad(f"n must be in 1..{MAX_N}, got {n}", "n")
    stream = _get_bool(body, "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise _bad("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(so, dict) or any(k not in ("include_usage", "continuous_usage_stats") for k in so):
            raise _bad(f"stream_options must be an object with include_usage, got {shown(so)}", "stream_options")
        include_usage = _get_bool(so, "include_usage")
        if so.get("continuous_usage_stats"):
            raise _bad("stream_options.continuous_usage_stats is not supported", "stream_options")
    return n, stream, include_usage


def _check_model(body: dict, served: str) -> None:
    m = body.get("model")
    if m is not None and not isinstance(m, str):
        raise _bad(f"model must be a string, got {shown(m)}", "model")
    if m and m != served:
        raise APIError(404, f"The model {shown(m)} does not exist: this server serves {served!r}", param="model")


def _prompt_list(prompt) -> list:
    if prompt is None:
        raise _bad("prompt is required", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list):
        if not prompt:
            raise _bad("prompt is an empty list", "prompt")
        if all(is_int(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and all(is_int(t) for t in p) for p in prompt):
            return list(prompt)
    raise _bad("prompt must be a string, a list of token ids, or a list of strings or of token-id lists", "prompt")


def parse_completion_request(body: Any, model) -> Job:
    """Validate a /v1/completions body (before tokenizing); raises APIError."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    _unsupported(body, COMPLETION_FIELDS)
    _check_model(body, model.name)
    n, stream, include_usage = _common(body, "completion")
    best_of = _get_int(body, "best_of")
    if best_of is not None and best_of not in (1, n):
        raise _bad(f"best_of={best_of} is not supported (only best_of = n)", "best_of")
    echo = _get_bool(body, "echo")
    logprobs = _get_int(body, "logprobs")
    if logprobs is not None and logprobs < 0:
        raise _bad(f"logprobs must be >= 0, got {logprobs}", "logprobs")
    mt = _get_int(body, "max_tokens")
    mt = DEFAULT_COMPLETION_MAX_TOKENS if mt is None else mt
    if mt == 0 and not echo:
        raise _bad("max_tokens must be >= 1 (0 only with echo)", "max_tokens")
    prompts = _prompt_list(body.get("prompt"))
    sp, seed = _sampling_message(body, mt if mt != 0 else None, logprobs, {})
    return Job("completion", prompts, [p if isinstance(p, str) else None for p in prompts], sp, n=n, seed=seed,
               max_tokens=mt, stream=stream, include_usage=include_usage, echo=echo, logprobs=logprobs)


def _message_text(i: int, content) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                what = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"messages[{i}].content[{j}]: only text parts are supported, got {shown(what)}", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def parse_chat_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object", "messages")
        extra = sorted(set(m) - _MESSAGE_KEYS)
        if extra:
            raise _bad(f"messages[{i}]: unsupported field(s) {shown(', '.join(map(str, extra)))}", "messages")
        role = m.get("role")
        if role not in _CHAT_ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}, got {shown(role)}", "messages")
        content = _message_text(i, m.get("content"))
        if content is None and not m.get("tool_calls"):
            raise _bad(f"messages[{i}] has no content", "messages")
        msg = {"role": "system" if role == "developer" else role, "content": content if content is not None else ""}
        for k in ("name", "tool_calls", "tool_call_id"):
            if m.get(k) is not None:
                msg[k] = m[k]
        out.append(msg)
    return out


def parse_chat_request(body: Any, model) -> tuple[Job, list[dict], dict, bool]:
    """Validate a /v1/chat/completions body (before rendering); returns (job without prompts, messages, template
    kwargs, add_generation_prompt). Raises APIError."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    _unsupported(body, CHAT_FIELDS)
    _check_model(body, model.name)
    n, stream, include_usage = _common(body, "chat")
    mt, mct = _get_int(body, "max_tokens"), _get_int(body, "max_completion_tokens")
    if mt is not None and mct is not None and mt != mct:
        raise _bad(f"max_tokens={mt} and max_completion_tokens={mct} disagree; give one", "max_completion_tokens")
    mt = mct if mct is not None else mt
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise _bad(f"logprobs must be true or false for chat, got {shown(lp)} (top_logprobs says how many)", "logprobs")
    top = _get_int(body, "top_logprobs")
    if top is not None and not lp:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None and top < 0:
        raise _bad(f"top_logprobs must be >= 0, got {top}", "top_logprobs")
    logprobs = (top or 0) if lp else None
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise _bad("chat_template_kwargs must be an object", "chat_template_kwargs")
    reserved = {"messages", "tools", "documents", "add_generation_prompt"} & set(kwargs)
    if reserved:
        raise _bad(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}", "chat_template_kwargs")
    agp = _get_bool(body, "add_generation_prompt", default=True)
    messages = parse_chat_messages(body.get("messages"))
    names = {"max_tokens": "max_completion_tokens" if mct is not None else "max_tokens", "logprobs": "top_logprobs"}
    sp, seed = _sampling_message(body, mt, logprobs, names)
    return (Job("chat", [], [None], sp, n=n, seed=seed, max_tokens=mt, stream=stream, include_usage=include_usage,
                logprobs=logprobs), messages, kwargs, agp)


# -- the front end -----------------------------------------------------------------------------------------------
@dataclass
class _Choice:
    index: int
    prompt: int
    rid: str | None = None
    token_ids: list = field(default_factory=list)
    text: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    sent_prefix: bool = False


def _norm_lp(tok: int, lp):
    """An engine logprob entry -> (logprob of tok, [(id, logprob), ...] most likely first)."""
    if isinstance(lp, dict):
        top = sorted(lp.items(), key=lambda kv: -kv[1])
        return float(lp.get(tok, float("nan"))), [(int(a), float(b)) for a, b in top]
    value, top = lp
    return float(value), [(int(a), float(b)) for a, b in top]


def _finite(x: float) -> float | None:
    """JSON has no infinities or NaN: -inf (a token with probability 0) -> -9999.0 (as vLLM), NaN -> null."""
    if x != x:
        return None
    return max(min(x, 0.0), -9999.0)


class HTTPFrontend:
    """The OpenAI-compatible HTTP API of one ``Server`` (serving/server.py), served by uvicorn on the server's loop."""

    def __init__(self, server):
        self.server = server
        self.servicer = server.servicer
        self.model = server.model
        self.created = int(time.time())
        self.app = self._build_app()
        self._uvicorn = None
        self._sock: socket.socket | None = None
        self._tick: asyncio.Task | None = None
        self.active = 0            # generation requests being answered (drain waits for them)
        self.bound_port: int | None = None
        self._token_text_cache: dict[int, str] = {}

    # -- life cycle ------------------------------------------------------------------------------------------
    async def start(self, host: str, port: int) -> int:
        import uvicorn

        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            sock.close()
            raise OSError(f"cannot listen on {host}:{port} (HTTP): {e.strerror or e}") from None
        sock.listen(2048)
        sock.setblocking(False)
        tls = {}
        if self.server.tls_cert is not None:     # --tls-cert / --tls-key: HTTPS with the gRPC port's certificate
            tls = dict(ssl_certfile=self.server.tls_cert, ssl_keyfile=self.server.tls_key)
        # log_config=None: uvicorn's loggers propagate to the process's own logging setup instead of uvicorn
        # re-running logging.config.dictConfig (which shuts down every handler already installed) on each start
        config = uvicorn.Config(self.app, lifespan="off", log_level="warning", access_log=False, log_config=None,
                                timeout_graceful_shutdown=1, timeout_keep_alive=30, interface="asgi3", **tls)
        config.load()
        srv = uvicorn.Server(config)
        srv.lifespan = config.lifespan_class(config)
        await srv.startup(sockets=[sock])
        self._uvicorn, self._sock = srv, sock
        self._tick = asyncio.ensure_future(srv.main_loop())   # date header; ends on should_exit
        self.bound_port = sock.getsockname()[1]
        return self.bound_port

    async def stop(self, grace: float | None) -> None:
        """Drain: requests being answered get ``grace`` seconds (new ones get 503 meanwhile), then the listener
        closes and what still runs is cancelled (which aborts it in the engine)."""
        srv = self._uvicorn
        if srv is None:
            return
        deadline = None if grace is None else time.monotonic() + grace
        while self.active and (deadline is None or time.monotonic() < deadline) and not srv.force_exit:
            await asyncio.sleep(0.02)
        srv.should_exit = True
        if self._tick is not None:
            await self._tick
        srv.config.timeout_graceful_shutdown = 0.5
        await srv.shutdown(sockets=[self._sock])
        for t in list(srv.server_state.tasks):
            t.cancel()
        self._uvicorn = None

    def force_stop(self) -> None:
        """Cut a drain short (a second stop)."""
        if self._uvicorn is not None:
            self._uvicorn.force_exit = True
            for t in list(self._uvicorn.server_state.tasks):
                t.cancel()

    # -- app -------------------------------------------------------------------------------------------------
    def _build_app(self):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, Response

        app = FastAPI(title="tbjax", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(APIError)
        async def api_error(request, exc: APIError):
            self.server.metrics.rejected.labels(code=f"HTTP_{exc.status}").inc()
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(404)
        async def not_found(request, exc):
            return JSONResponse(APIError(404, f"no route {request.method[:16]} {shown(request.url.path)[1:-1]}",
                                         code="not_found").body(),
                                status_code=404)

        @app.exception_handler(405)
        async def not_allowed(request, exc):
            return JSONResponse(APIError(405, f"method {request.method[:16]} is not allowed on "
                                         f"{shown(request.url.path)[1:-1]}",
                                         type_="invalid_request_error", code="method_not_allowed").body(),
                                status_code=405)

        @app.get("/health")
        async def health():
            if self.server.ready:
                return {"status": "ok"}
            return JSONResponse(self._unavailable().body(), status_code=503)

        @app.get("/metrics")
        async def metrics():
            from prometheus_client import CONTENT_TYPE_LATEST
            return Response(self.server.metrics.text(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str):
            if model_id != self.model.name:
                raise APIError(404, f"The model {shown(model_id)} does not exist: this server serves "
                                    f"{self.model.name!r}", param="model")
            return self._model_card()

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._handle(request, "completion")

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._handle(request, "chat")

        if self.server.api_key is not None:
            return _ApiKeyGate(app, self.server.api_key, self.server.metrics)
        return app

    def _model_card(self) -> dict:
        m = self.model
        card = {"id": m.name, "object": "model", "created": self.created, "owned_by": "tbjax",
                "max_model_len": m.max_context}
        gd = getattr(m, "generation_defaults", None)
        if gd is not None:
            card["sampling_defaults"] = gd.sampling()
        return card

    def _unavailable(self) -> APIError:
        if self.server._stopping:
            return APIError(503, "the server is draining (shutting down); retry on another server", code="draining")
        return APIError(503, self.servicer._startup_message().replace("gRPC health reports SERVING",
                                                                       "GET /health answers 200"),
                        code="not_ready")

    # -- requests --------------------------------------------------------------------------------------------
    async def _handle(self, request, kind: str):
        t_arrival = time.perf_counter()
        try:
            raw = await request.body()
            if len(raw) > self.server.limits.max_message_bytes:
                raise APIError(413, f"request body of {len(raw)} bytes exceeds the limit of "
                                    f"{self.server.limits.max_message_bytes}", type_="invalid_request_error")
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise _bad(f"the request body is not valid JSON: {str(e)[:200]}") from None
            if not self.server.ready:
                raise self._unavailable()
            job = await self._parse(body, kind)
            return await self._run(request, job, t_arrival)
        except APIError:
            raise
        except RequestError as e:
            raise _from_request_error(e, COMPLETION_FIELDS | CHAT_FIELDS) from None

    async def _parse(self, body, kind: str) -> Job:
        m, lim = self.model, self.server.limits
        cap = self.servicer.prompt_cap
        max_bytes = lim.prompt_bytes_limit(cap + 1)   # text over it is refused before it is tokenized
        if kind == "completion":
            job = parse_completion_request(body, m)
            if job.logprobs is not None and job.logprobs > lim.max_logprobs:
                raise _bad(f"logprobs must be in 0..{lim.max_logprobs}, got {job.logprobs}", "logprobs")
            raw = job.prompts
            texts = [p for p in raw if isinstance(p, str)]
            for i, t in enumerate(texts):
                try:
                    check_text_bytes("prompt" if len(raw) == 1 else f"prompt {i}",
                                     len(t) if len(t) > max_bytes else len(t.encode("utf-8", "surrogatepass")),
                                     max_bytes)
                except RequestError as e:
                    raise _bad(e.message, "prompt") from None
            encoded = iter(await self.servicer.tokenize(lambda: [m.tokenizer.encode(t) for t in texts])
                           if texts else [])
            prompts = []
            for i, p in enumerate(raw):
                if isinstance(p, str):
                    if not p:
                        raise _bad(f"prompt {i} is empty" if len(raw) > 1 else "prompt is empty", "prompt")
                    ids = next(encoded)
                else:
                    if not p:
                        raise _bad(f"prompt {i} is an empty token list", "prompt")
                    ids = token_ids_in_vocab("prompt", p, m.vocab_size)
                if not ids:
                    raise _bad(f"prompt {i} tokenizes to no tokens", "prompt")
                prompts.append(ids)
            job.prompts = prompts
        else:
            job, messages, kwargs, agp = parse_chat_request(body, m)
            if job.logprobs is not None and job.logprobs > lim.max_logprobs:
                raise _bad(f"top_logprobs must be in 0..{lim.max_logprobs}, got {job.logprobs}", "top_logprobs")
            if not getattr(m, "has_chat_template", False):
                raise _bad(f"model {m.name!r} has no chat template; use /v1/completions", "messages")

            n_bytes = 0
            for msg in messages:
                c = msg.get("content") or ""
                n_bytes += len(c) if len(c) > max_bytes else len(c.encode("utf-8", "surrogatepass"))
            try:
                check_text_bytes("messages", n_bytes, max_bytes)
            except RequestError as e:
                raise _bad(e.message, "messages") from None

            def render():
                text = m.tokenizer.apply_chat_template(messages, add_generation_prompt=agp, **kwargs)
                return m.tokenizer.encode(text, add_special_tokens=False)
            try:
                ids = await self.servicer.tokenize(render)
            except (ValueError, TypeError) as e:   # template errors (TokenizerError is a ValueError)
                raise _bad(f"messages: {str(e)[:300]}", "messages") from None
            if not ids:
                raise _bad("messages render to no tokens", "messages")
            job.prompts = [ids]
        for i, ids in enumerate(job.prompts):
            if len(ids) > cap:
                raise _bad(f"prompt{f' {i}' if len(job.prompts) > 1 else ''} has {len(ids)} tokens, more than the "
                           f"limit of {cap}{self.servicer.prompt_cap_note}",
                           "prompt" if kind == "completion" else "messages")
        known = COMPLETION_FIELDS | CHAT_FIELDS
        names = {"max_tokens": "max_tokens"}
        for ids in job.prompts:
            if job.max_tokens == 0:      # echo only: nothing to generate
                job.params.append(None)
                continue
            try:
                kw = check_sampling(job.sampling, prompt_len=len(ids), vocab_size=m.vocab_size,
                                    max_context=m.max_context, limits=lim, kv_tokens=self.servicer.kv_tokens)
                job.params.append(kw)
                build_params(m.make_params, kw, m.vocab_size)   # refuses what the engine's params refuse
            except RequestError as e:
                raise _from_request_error(e, known | set(names)) from None
        return job

    def _params(self, job: Job, prompt: int, j: int):
        kw = dict(job.params[prompt])
        if job.seed is not None:
            kw["seed"] = (job.seed + j) & ((1 << 63) - 1)
        return build_params(self.model.make_params, kw, self.model.vocab_size)

    async def _prompt_logprobs(self, job: Job) -> list | None:
        if not (job.echo and job.logprobs is not None):
            return None
        el = self.servicer.engine_loop
        from .prompt_logprobs import PromptLogprobsUnavailable, prompt_logprobs
        out = []
        for ids in job.prompts:
            try:
                out.append(await asyncio.wrap_future(el.call(functools.partial(prompt_logprobs, token_ids=ids,
                                                                               k=job.logprobs))))
            except PromptLogprobsUnavailable as e:
                raise _bad(str(e), "echo") from None
            except EngineStopped as e:
                if el.engine is None and self.servicer.role == "router":
                    raise _bad(f"echo with logprobs (prompt logprobs) needs an engine in this server; role "
                               f"{self.servicer.role!r} has none", "echo") from None
                raise APIError(503, str(e)) from None
            except EngineStopped as e:
                raise APIError(503, str(e)) from None
        return out

    async def _run(self, request, job: Job, t_arrival: float):
        from fastapi.responses import JSONResponse

        sv = self.servicer
        base = "cmpl-" if job.kind == "completion" else "chatcmpl-"
        rid = base + uuid.uuid4().hex
        choices = [_Choice(p * job.n + j, p) for p in range(len(job.prompts)) for j in range(job.n)]
        gen = [c for c in choices if job.params[c.prompt] is not None]
        slots = sv.admit(len(gen)) if gen else []
        self.active += 1
        started = False
        try:
            if any(s.queued for s in slots):   # over max_concurrent_requests: wait in the server's queue ...
                turn = asyncio.ensure_future(asyncio.gather(*(s.wait_turn() for s in slots)))
                watch = asyncio.ensure_future(_wait_disconnect(request))
                try:
                    await asyncio.wait({turn, watch}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for t in (turn, watch):
                        t.cancel()
                    await asyncio.gather(turn, watch, return_exceptions=True)
                if any(s.queued for s in slots):   # ... unless the client goes away meanwhile
                    raise APIError(499, "client disconnected while its request waited in the queue")
            prompt_lps = await self._prompt_logprobs(job)
            t_validated = time.perf_counter()
            sv.metrics.phase.labels(phase="tokenize").observe(t_validated - t_arrival)
            queue: asyncio.Queue = asyncio.Queue()
            tasks = []
            if gen:
                items = []
                stops = []
                for c, slot in zip(gen, slots):
                    c.rid = f"{rid}-{c.index}" if len(choices) > 1 else rid
                    params = self._params(job, c.prompt, c.index % job.n)
                    stops.append(take_stops(params))
                    items.append((c, slot, params))
                streams = self._submit(items, job)
                for (c, slot, _), st, stop in zip(items, streams, stops):
                    tasks.append(asyncio.ensure_future(self._pump(c, slot, st, len(job.prompts[c.prompt]),
                                                                  t_arrival, t_validated, queue, stop)))
            for c in choices:
                if job.params[c.prompt] is None:
                    c.finish_reason = "length"
                    request_log.info("request %s (http): %d prompt tokens, echo only", rid, len(job.prompts[c.prompt]))
            ctx = _Answer(self, job, rid, choices, prompt_lps)
            if job.stream:
                started = True
                done = False

                async def cleanup():   # once, whether the stream ran to its end, broke off, or never started
                    nonlocal done
                    if done:
                        return
                    done = True
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    for s in slots:
                        s.release()
                    self.active -= 1
                return _CleanupStream(self._sse(ctx, queue, len(gen), cleanup), cleanup,
                                      media_type="text/event-stream",
                                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return JSONResponse(await self._collect(request, ctx, queue, tasks, slots, len(gen)))
        finally:
            if not started:
                self.active -= 1
                for s in slots:
                    s.release()

    def _submit(self, items, job: Job) -> list:
        """Hand the choices' requests to the engine in one command (EngineLoop.submit_many) when it can take one."""
        sv = self.servicer
        many = sv.engine_loop.submit_many
        if len(items) == 1:
            out = []
            try:
                for c, slot, params in items:
                    out.append(sv.submit(slot, c.rid, job.prompts[c.prompt], params))
            except RequestError:
                for st in out:
                    sv.engine_loop.abort(st.request_id)
                    sv._active.pop(st.request_id, None)
                raise
            return out
        from .engine_loop import RequestStream
        loop = asyncio.get_running_loop()
        streams = [RequestStream(loop, c.rid) for c, _, _ in items]
        try:
            many([(c.rid, job.prompts[c.prompt], params, st) for (c, _, params), st in zip(items, streams)])
        except EngineStopped as e:
            for _, slot, _ in items:
                slot.outcome = "unavailable"
            raise APIError(503, str(e)) from None
        for st in streams:
            sv._active[st.request_id] = st
        return streams

    async def _pump(self, c: _Choice, slot, stream, n_prompt: int, t_arrival: float, t_validated: float,
                    queue: asyncio.Queue, stops=()) -> None:
        try:
            async with contextlib.aclosing(self.servicer.stream(slot, stream, n_prompt, t_arrival, t_validated,
                                                                protocol="http", stops=stops)) as chunks:
                async for ch in chunks:
                    queue.put_nowait(("chunk", c, ch))
            queue.put_nowait(("done", c, None))
        except StreamFailed as e:
            queue.put_nowait(("error", c, APIError.from_grpc(e.code, e.message)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must not leave the request hanging
            log.exception("HTTP request stream failed")
            queue.put_nowait(("error", c, APIError(500, f"internal error: {repr(e)[:300]}")))
        finally:
            slot.release()

    async def _events(self, queue: asyncio.Queue, n: int):
        done = 0
        while done < n:
            kind, c, payload = await queue.get()
            if kind == "chunk":
                c.token_ids.extend(payload.token_ids)
                c.text.append(payload.text)
                c.logprobs.extend(payload.logprobs or ())
                if payload.finished:
                    c.finish_reason = payload.finish_reason
                yield c, payload
            elif kind == "error":
                raise payload
            else:
                done += 1

    async def _collect(self, request, ctx: "_Answer", queue, tasks, slots, n: int) -> dict:
        async def gather():
            async for _ in self._events(queue, n):
                pass

        work = asyncio.ensure_future(gather())
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():     # the client went away: abort its requests
                raise APIError(499, "client disconnected")
            work.result()
            return ctx.response()
        finally:
            for t in (work, watch, *tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _sse(self, ctx: "_Answer", queue, n: int, cleanup):
        try:
            for c in ctx.choices:           # the first chunk of every choice (role / echoed prompt)
                first = ctx.first_chunk(c)
                if first is not None:
                    yield _sse(first)
            try:
                async for c, ch in self._events(queue, n):
                    yield _sse(ctx.chunk(c, ch))
                for c in ctx.choices:        # echo-only choices end here
                    if ctx.job.params[c.prompt] is None:
                        yield _sse(ctx.chunk(c, None))
                if ctx.job.include_usage:
                    yield _sse(ctx.usage_chunk())
            except APIError as e:
                yield _sse(e.body())
            yield "data: [DONE]\n\n"
        finally:
            await cleanup()

    def token_text(self, token_id: int) -> str:
        t = self._token_text_cache.get(token_id)
        if t is None:
            t = self.model.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text_cache) < 1 << 18:
                self._token_text_cache[token_id] = t
        return t

    def token_bytes(self, token_id: int) -> list[int]:
        fn = getattr(self.model.tokenizer, "token_bytes", None)
        b = fn(token_id) if fn is not None else self.token_text(token_id).encode("utf-8")
        return list(b)


class _ApiKeyGate:
    """``--api-key`` (an ASGI wrapper, so that streamed answers pass through untouched): every HTTP request but
    ``GET /health`` needs ``Authorization: Bearer <key>`` (compared in constant time), else 401 with OpenAI's error
    body (code ``invalid_api_key``)."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app, api_key: str, metrics=None):
        self.app = app
        self._expected = ("Bearer " + api_key).encode()
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") not in self.OPEN_PATHS:
            import hmac
            got = b""
            for k, v in scope.get("headers") or ():
                if k == b"authorization":
                    got = v
                    break
            if not hmac.compare_digest(got, self._expected):
                if self.metrics is not None:
                    self.metrics.rejected.labels(code="HTTP_401").inc()
                err = APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                               type_="invalid_request_error", code="invalid_api_key")
                body = json.dumps(err.body()).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class _CleanupStream(StreamingResponse):
    """A streaming response that runs ``cleanup`` however its sending ends (a client that goes away before the first
    chunk leaves the body generator unstarted, so the generator's own ``finally`` would never run)."""

    def __init__(self, content, cleanup, **kw):
        super().__init__(content, **kw)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send):
        from starlette.requests import ClientDisconnect
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError) as e:   # the client went away mid-stream: not the server's error
            log.debug("HTTP client disconnected during a streamed answer: %r", e)
        finally:
            await self._cleanup()


async def _wait_disconnect(request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Answer:
    """Builds the JSON of one request's answer (whole, or chunk by chunk) from its choices."""

    def __init__(self, fe: HTTPFrontend, job: Job, rid: str, choices: list[_Choice], prompt_lps: list | None):
        self.fe, self.job, self.rid, self.choices, self.prompt_lps = fe, job, rid, choices, prompt_lps
        self.created = int(time.time())
        self.obj = "text_completion" if job.kind == "completion" else "chat.completion"

    def _head(self, chunk: bool) -> dict:
        return {"id": self.rid, "object": self.obj + (".chunk" if chunk and self.job.kind == "chat" else ""),
                "created": self.created, "model": self.fe.model.name}

    def usage(self) -> dict:
        p = sum(len(ids) for ids in self.job.prompts)
        c = sum(len(ch.token_ids) for ch in self.choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _prompt_text(self, c: _Choice) -> str:
        t = self.job.prompt_texts[c.prompt] if c.prompt < len(self.job.prompt_texts) else None
        return t if t is not None else self.fe.model.tokenizer.decode(self.job.prompts[c.prompt],
                                                                       skip_special_tokens=False)

    # -- logprobs ----------------------------------------------------------------------------------------------
    def _completion_lps(self, ids, lps, offset: int, prompt_lps=None) -> dict:
        k = self.job.logprobs
        fe = self.fe
        tokens, token_lps, tops, offsets = [], [], [], []
        for i, tok in enumerate(ids):
            text = fe.token_text(tok)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            entry = prompt_lps[i] if prompt_lps is not None else (lps[i] if i < len(lps) else None)
            if entry is None:
                token_lps.append(None)
                tops.append(None)
                continue
            value, top = _norm_lp(tok, entry)
            token_lps.append(_finite(value))
            d = {}
            for t, v in top[:k]:
                d.setdefault(fe.token_text(t), _finite(v))
            d.setdefault(text, _finite(value))    # OpenAI: the sampled token's logprob is always there
            tops.append(d)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_lps(self, ids, lps) -> dict:
        k = self.job.logprobs
        fe = self.fe
        content = []
        for tok, entry in zip(ids, lps):
            value, top = _norm_lp(tok, entry)
            content.append({"token": fe.token_text(tok), "logprob": _finite(value), "bytes": fe.token_bytes(tok),
                            "top_logprobs": [{"token": fe.token_text(t), "logprob": _finite(v),
                                              "bytes": fe.token_bytes(t)} for t, v in top[:k]]})
        return {"content": content, "refusal": None}

    def _merge_lps(self, a: dict | None, b: dict) -> dict:
        if a is None:
            return b
        return {k: a[k] + b[k] for k in a}

    # -- whole answer -----------------------------------------------------------------------------------------
    def response(self) -> dict:
        out = self._head(False)
        choices = []
        for c in self.choices:
            text = "".join(c.text)
            if self.job.kind == "completion":
                lp = None
                if self.job.logprobs is not None:
                    if self.job.echo:
                        ptext = self._prompt_text(c)
                        lp = self._completion_lps(self.job.prompts[c.prompt], None, 0, self.prompt_lps[c.prompt])
                        lp = self._merge_lps(lp, self._completion_lps(c.token_ids, c.logprobs, len(ptext)))
                    else:
                        lp = self._completion_lps(c.token_ids, c.logprobs, 0)
                if self.job.echo:
                    text = self._prompt_text(c) + text
                choices.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                lp = self._chat_lps(c.token_ids, c.logprobs) if self.job.logprobs is not None else None
                choices.append({"index": c.index, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": c.finish_reason})
        out["choices"] = choices
        out["usage"] = self.usage()
        return out

    # -- streaming --------------------------------------------------------------------------------------------
    def _chunk(self, choice: dict) -> dict:
        out = self._head(True)
        out["choices"] = [choice]
        if self.job.include_usage:
            out["usage"] = None
        return out

    def first_chunk(self, c: _Choice) -> dict | None:
        if self.job.kind == "chat":
            return self._chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None})
        if not self.job.echo:
            return None
        lp = None
        if self.job.logprobs is not None:
            lp = self._completion_lps(self.job.prompts[c.prompt], None, 0, self.prompt_lps[c.prompt])
        c.sent_prefix = True
        return self._chunk({"index": c.index, "text": self._prompt_text(c), "logprobs": lp, "finish_reason": None})

    def chunk(self, c: _Choice, ch) -> dict:
        """One choice's chunk for new tokens ``ch`` (a server Chunk), or its end when ``ch`` is None."""
        ids = ch.token_ids if ch is not None else []
        lps = ch.logprobs if ch is not None else []
        text = ch.text if ch is not None else ""
        reason = ch.finish_reason if ch is not None and ch.finished else (c.finish_reason if ch is None else None)
        if self.job.kind == "chat":
            lp = self._chat_lps(ids, lps) if self.job.logprobs is not None else None
            return self._chunk({"index": c.index, "delta": {"content": text} if text else {},
                                "logprobs": lp, "finish_reason": reason})
        lp = None
        if self.job.logprobs is not None:
            before = len(self._prompt_text(c)) if self.job.echo else 0
            done = len(c.token_ids) - len(ids)
            offset = before + sum(len(self.fe.token_text(t)) for t in c.token_ids[:done])
            lp = self._completion_lps(ids, lps, offset)
        return self._chunk({"index": c.index, "text": text, "logprobs": lp, "finish_reason": reason})

    def usage_chunk(self) -> dict:
        out = self._head(True)
        out["choices"] = []
        out["usage"] = self.usage()
        return out
