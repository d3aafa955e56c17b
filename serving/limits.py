"""Request limits and validation: turns a wire request into checked engine inputs, or a clear gRPC error.

Every rule a request can break lives here, so that the servicer only maps `RequestError` to a status.
Validation runs before a request reaches the engine thread: a bad request costs no engine time and
never touches the KV cache. The checks are plain Python over the proto message (no engine needed), so
they are unit-testable on their own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from pallas_kernels.utils import check_int

__all__ = ["Limits", "RequestError", "CheckedRequest", "check_generate", "check_tokenize", "token_ids_in_vocab",
           "shown", "check_request_id", "check_text_bytes", "StreamFailed", "take_stops"]

SHOWN_CHARS = 64   # the most characters of a client's value that an error message quotes


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters (with the full length said): error messages quote what a client
    sent only through this, so that a status never echoes unbounded input."""
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > 4 * limit:
        r = repr(value[:limit] if not isinstance(value, dict) else dict(list(value.items())[:limit]))
    else:
        r = repr(value)
    if len(r) <= limit:
        return r
    n = len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else len(r)
    return f"{r[:limit]}... ({n} {'characters' if isinstance(value, str) else 'long'})"


class RequestError(Exception):
    """A request the server refuses; carries the gRPC status code and a message naming the problem."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"RequestError({self.code.name}, {self.message!r})"


class StreamFailed(Exception):
    """A request failed after it was accepted (engine refusal, crash, shutdown); ``code`` is the gRPC status that
    says so (front ends map it to theirs)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(msg: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, msg)


@dataclass(frozen=True)
class Limits:
    """Server limits. ``None`` for ``max_prompt_tokens`` means the model's context less one token."""

    max_prompt_tokens: int | None = None
    max_tokens: int = 4096                 # the largest max_tokens a request may ask for
    default_max_tokens: int = 256          # when the request does not say (capped by the context left)
    # running: handed to the engine, not finished; more wait in the server's queue (oldest first) ...
    max_concurrent_requests: int = 256
    # ... which holds at most this many; beyond: RESOURCE_EXHAUSTED
    max_queued_requests: int = 128
    max_message_bytes: int = 4 << 20       # largest request message (gRPC refuses bigger ones: RESOURCE_EXHAUSTED)
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_logprobs: int = 20
    max_chat_messages: int = 1024
    max_request_id_bytes: int = 256        # a client's request_id (UTF-8 bytes); longer: INVALID_ARGUMENT
    # a text prompt's (or a chat's contents') UTF-8 bytes, checked before tokenizing; None: PROMPT_BYTES_PER_TOKEN x
    # the prompt token limit (at least 64 KiB), so that a prompt too long to tokenize cheaply is refused at once
    max_prompt_bytes: int | None = None
    max_tokenize_concurrency: int = 4      # prompts tokenized at once (in threads, off the event loop)

    def __post_init__(self):
        for name in ("max_tokens", "default_max_tokens", "max_concurrent_requests", "max_queued_requests",
                     "max_message_bytes", "max_stop_strings", "max_stop_string_chars", "max_stop_token_ids",
                     "max_chat_messages", "max_request_id_bytes", "max_tokenize_concurrency"):
            check_int(f"Limits.{name}", getattr(self, name), lo=1)
        check_int("Limits.max_logprobs", self.max_logprobs, lo=0)
        for name in ("max_prompt_tokens", "max_prompt_bytes"):
            if getattr(self, name) is not None:
                check_int(f"Limits.{name} (or None)", getattr(self, name), lo=1)
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(f"Limits.default_max_tokens={self.default_max_tokens} > max_tokens={self.max_tokens}")

    def prompt_limit(self, max_context: int) -> int:
        cap = max_context - 1
        return cap if self.max_prompt_tokens is None else min(self.max_prompt_tokens, cap)

    def prompt_bytes_limit(self, max_context: int) -> int:
        """The most UTF-8 bytes of prompt text tokenized (see ``max_prompt_bytes``)."""
        if self.max_prompt_bytes is not None:
            return self.max_prompt_bytes
        return max(PROMPT_BYTES_PER_TOKEN * self.prompt_limit(max_context), 64 << 10)


# a token is rarely longer than a few bytes (English averages ~4); 32 leaves room for runs of spaces, code, and
# scripts of several bytes per character, while a prompt over the limit is refused before it costs a tokenizer call
PROMPT_BYTES_PER_TOKEN = 32


def check_request_id(rid: str, limits: Limits) -> None:
    """A client's request_id must be at most ``max_request_id_bytes`` (the message never quotes the id)."""
    if len(rid) * 4 > limits.max_request_id_bytes:   # else it cannot be over: UTF-8 takes at most 4 bytes a character
        n = len(rid.encode("utf-8", "surrogatepass"))
        if n > limits.max_request_id_bytes:
            raise _invalid(f"request_id is {n} bytes long, more than the limit of {limits.max_request_id_bytes} "
                           "bytes")


def _utf8_len(text: str, cap: int) -> int:
    """UTF-8 length of ``text``, exact up to ``cap`` (above it: some number > cap, found without encoding it all)."""
    if len(text) > cap:
        return len(text)
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def check_text_bytes(what: str, n_bytes: int, cap: int) -> None:
    if n_bytes > cap:
        raise _invalid(f"{what} has at least {n_bytes} bytes (UTF-8), more than the limit of {cap} bytes of text this "
                       "server tokenizes for one request")


@dataclass
class CheckedRequest:
    """A validated Generate request: prompt token ids and keyword arguments for ``SamplingParams``."""

    prompt_token_ids: list[int]
    params: dict[str, Any] = field(default_factory=dict)


def token_ids_in_vocab(what: str, ids, vocab_size: int) -> list[int]:
    ids = list(ids)   # protobuf repeated int32 -> Python ints; the common all-valid case is checked by min/max in C
    if ids and (not isinstance(ids[0], int) or min(ids) < 0 or max(ids) >= vocab_size):
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < vocab_size]
    else:
        bad = []
    if bad:
        raise _invalid(f"{what}: token ids out of vocabulary (size {vocab_size}): {bad[:8]}"
                       + (f" and {len(bad) - 8} more" if len(bad) > 8 else ""))
    return ids


def check_model_name(requested: str, served: str) -> None:
    if requested and requested != served:
        raise RequestError(grpc.StatusCode.NOT_FOUND,
                           f"unknown model {shown(requested)}: this server serves {served!r} (or leave model empty)")


def _chat_messages(chat, limits: Limits, max_context: int | None = None) -> tuple[list[dict], bool]:
    if not chat.messages:
        raise _invalid("chat has no messages")
    if len(chat.messages) > limits.max_chat_messages:
        raise _invalid(f"chat has {len(chat.messages)} messages, more than the limit {limits.max_chat_messages}")
    msgs = []
    total = 0
    cap = limits.prompt_bytes_limit(max_context) if max_context else None
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise _invalid(f"chat message {i} has an empty role")
        if cap is not None:
            total += _utf8_len(m.content, cap) + _utf8_len(m.role, cap)
            check_text_bytes("chat", total, cap)
        msgs.append({"role": m.role, "content": m.content})
    agp = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return msgs, agp


def prompt_ids_from_input(msg, tokenizer, vocab_size: int, limits: Limits, *, add_special_tokens: bool = True,
                          max_context: int | None = None) -> list[int]:
    """Token ids for the ``input`` oneof of a GenerateRequest / TokenizeRequest (empty input is an error). With
    ``max_context``, text longer than ``limits.prompt_bytes_limit(max_context)`` bytes is refused before it is
    tokenized."""
    which = msg.WhichOneof("input")
    if which is None:
        raise _invalid("no input: set one of prompt, prompt_token_ids or chat")
    try:
        if which in ("prompt", "text"):
            text = getattr(msg, which)
            if not text:
                raise _invalid(f"{which} is empty")
            if max_context:
                cap = limits.prompt_bytes_limit(max_context)
                check_text_bytes(which, _utf8_len(text, cap), cap)
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        elif which == "prompt_token_ids":
            if not msg.prompt_token_ids.ids:
                raise _invalid("prompt_token_ids is empty")
            ids = token_ids_in_vocab("prompt_token_ids", msg.prompt_token_ids.ids, vocab_size)
        else:
            messages, agp = _chat_messages(msg.chat, limits, max_context)
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=agp)
            ids = tokenizer.encode(text, add_special_tokens=False)
    except RequestError:
        raise
    except ValueError as e:  # tokenizer errors (e.g. no chat template) are the caller's fault
        raise _invalid(f"{which}: {str(e)[:200]}") from None
    if not ids:
        raise _invalid(f"{which} tokenizes to no tokens")
    return list(ids)


def _finite(name: str, v: float) -> float:
    if not math.isfinite(v):
        raise _invalid(f"{name} must be a finite number, got {v}")
    return float(v)


def _integer(name: str, v: int) -> int:
    return int(v)


def _checked_field(sp, out: dict, name: str, read: Callable[[str, Any], Any], valid: Callable[[Any], bool],
                   must_be: str) -> None:
    """``out[name]``: field ``name`` of ``sp`` through ``read(name, value)`` when the field is set; INVALID_ARGUMENT
    "``name`` must be ``must_be``" unless ``valid`` holds for it."""
    if sp.HasField(name):
        v = read(name, getattr(sp, name))
        if not valid(v):
            raise _invalid(f"{name} must be {must_be}, got {v}")
        out[name] = v


def check_sampling(sp, *, prompt_len: int, vocab_size: int, max_context: int, limits: Limits,
                   kv_tokens: int | None = None) -> dict[str, Any]:
    """Checked keyword arguments for ``SamplingParams`` from a ``tbjax.v1.SamplingParams`` message. ``kv_tokens``:
    the KV positions one sequence can hold (the default max_tokens stays within them)."""
    out: dict[str, Any] = {}
    left = max_context - prompt_len
    # the KV pool holds kv_tokens positions of one sequence: prompt + max_tokens - 1 of them
    kv_left = None if kv_tokens is None else kv_tokens + 1 - prompt_len
    if sp.HasField("max_tokens"):
        mt = sp.max_tokens
        if mt < 1:
            raise _invalid(f"max_tokens must be >= 1, got {mt}")
        if mt > limits.max_tokens:
            raise _invalid(f"max_tokens {mt} exceeds this server's limit of {limits.max_tokens}")
        if mt > left:
            raise _invalid(f"prompt ({prompt_len} tokens) + max_tokens ({mt}) = {prompt_len + mt} exceeds the "
                           f"model's context of {max_context} tokens")
        if kv_left is not None and mt > kv_left:
            raise _invalid(f"prompt ({prompt_len} tokens) + max_tokens ({mt}) = {prompt_len + mt} exceeds the "
                           f"context one request can have here: {kv_tokens + 1} tokens (what the KV cache's pages "
                           "hold for one sequence)")
    else:
        mt = min(limits.default_max_tokens, left, *(() if kv_left is None else (max(kv_left, 1),)))
    out["max_tokens"] = mt
    _checked_field(sp, out, "temperature", _finite, lambda t: t >= 0, ">= 0 (0 = greedy)")
    _checked_field(sp, out, "top_k", _integer, lambda k: k >= 0, ">= 0 (0 = off)")
    _checked_field(sp, out, "top_p", _finite, lambda p: 0.0 < p <= 1.0, "in (0, 1]")
    _checked_field(sp, out, "min_p", _finite, lambda p: 0.0 <= p < 1.0, "in [0, 1)")
    _checked_field(sp, out, "seed", _integer, lambda s: s >= 0, ">= 0")
    if len(sp.stop) > limits.max_stop_strings:
        raise _invalid(f"{len(sp.stop)} stop strings, more than the limit {limits.max_stop_strings}")
    for i, s in enumerate(sp.stop):
        if not s:
            raise _invalid(f"stop string {i} is empty")
        if len(s) > limits.max_stop_string_chars:
            raise _invalid(f"stop string {i} has {len(s)} characters, more than {limits.max_stop_string_chars}")
    out["stop"] = list(sp.stop)
    if len(sp.stop_token_ids) > limits.max_stop_token_ids:
        raise _invalid(f"{len(sp.stop_token_ids)} stop_token_ids, more than the limit {limits.max_stop_token_ids}")
    out["stop_token_ids"] = token_ids_in_vocab("stop_token_ids", sp.stop_token_ids, vocab_size)
    out["ignore_eos"] = bool(sp.ignore_eos)
    if not 0 <= sp.logprobs <= limits.max_logprobs:
        raise _invalid(f"logprobs must be in 0..{limits.max_logprobs}, got {sp.logprobs}")
    out["logprobs"] = int(sp.logprobs)
    return out


def check_generate(req, *, model_name: str, tokenizer, vocab_size: int, max_context: int, limits: Limits,
                   prompt_cap: int | None = None, prompt_cap_note: str = "", kv_tokens: int | None = None
                   ) -> CheckedRequest:
    """Validate a ``tbjax.v1.GenerateRequest``; raises ``RequestError`` naming the first problem found.
    ``prompt_cap``: the prompt token limit that applies (default ``limits.prompt_limit(max_context)``; the server
    passes one no larger than what the KV cache holds for one sequence)."""
    check_model_name(req.model, model_name)
    check_request_id(req.request_id, limits)
    cap = limits.prompt_limit(max_context) if prompt_cap is None else prompt_cap
    ids = prompt_ids_from_input(req, tokenizer, vocab_size, limits, max_context=cap + 1)
    if len(ids) > cap:
        raise _invalid(f"prompt has {len(ids)} tokens, more than the limit of {cap}{prompt_cap_note}")
    params = check_sampling(req.params, prompt_len=len(ids), vocab_size=vocab_size, max_context=max_context,
                            limits=limits, kv_tokens=kv_tokens)
    return CheckedRequest(ids, params)


def check_tokenize(req, *, model_name: str, tokenizer, vocab_size: int, limits: Limits,
                   max_context: int | None = None) -> list[int]:
    check_model_name(req.model, model_name)
    add = req.add_special_tokens if req.HasField("add_special_tokens") else True
    return prompt_ids_from_input(req, tokenizer, vocab_size, limits, add_special_tokens=add, max_context=max_context)


def build_params(make_params: Callable[..., Any], kwargs: dict[str, Any], vocab_size: int):
    """``make_params(**kwargs)`` then its own ``validate(vocab_size)``; any ValueError -> INVALID_ARGUMENT."""
    try:
        params = make_params(**kwargs)
        validate = getattr(params, "validate", None)
        if validate is not None:
            validate(vocab_size)
    except (ValueError, TypeError) as e:
        raise _invalid(f"sampling params: {e}") from None
    return params


def take_stops(params) -> list[str]:
    """Take the stop strings out of ``params`` (the engine gets none): the front end applies them to the text it
    streams (``tbjax.tokenizer.StopStrings``: held back while they may still match, never sent then taken back)."""
    stops = list(getattr(params, "stop", None) or ())
    if stops:
        params.stop = []
    return stops
