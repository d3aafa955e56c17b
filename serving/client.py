"""Python client and command line for a tbjax server.

    from serving.client import Client
    with Client("127.0.0.1:50051") as c:
        for chunk in c.generate_stream("Once upon a time", max_tokens=32, temperature=0):
            print(chunk.text, end="", flush=True)

    python -m serving.client "Once upon a time" --max-tokens 32 --temperature 0
    python -m serving.client --chat "What is JAX?"          # renders the model's chat template
    python -m serving.client --info                          # model and limits

Errors come back as ``grpc.RpcError`` with the server's status code and message.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .api import METHODS, finish_reason_name, method_path, pb

__all__ = ["Client", "Chunk", "Completion", "build_generate_request", "main"]

DEFAULT_TARGET = "127.0.0.1:50051"
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stop_token_ids",
                    "ignore_eos", "logprobs")


@dataclass
class Chunk:
    """One streamed piece of a completion."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None          # set on the last chunk
    prompt_tokens: int | None = None          # set on the last chunk
    completion_tokens: int | None = None      # set on the last chunk
    logprobs: list | None = None              # [(token_id, logprob, [(top_id, top_logprob), ...]), ...]


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list = field(default_factory=list)


def build_generate_request(prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                           messages: Sequence[dict] | None = None, add_generation_prompt: bool | None = None,
                           request_id: str = "", model: str = "", **sampling) -> "pb.GenerateRequest":
    """A GenerateRequest from exactly one of prompt / token_ids / messages plus sampling fields
    (max_tokens, temperature, top_k, top_p, min_p, seed, stop, stop_token_ids, ignore_eos, logprobs)."""
    given = [x is not None for x in (prompt, token_ids, messages)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, token_ids, messages")
    unknown = set(sampling) - set(_SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s): {sorted(unknown)}; known: {list(_SAMPLING_FIELDS)}")
    req = pb.GenerateRequest(request_id=request_id, model=model)
    if prompt is not None:
        req.prompt = prompt
    elif token_ids is not None:
        req.prompt_token_ids.ids.extend(int(t) for t in token_ids)
        req.prompt_token_ids.SetInParent()
    else:
        _fill_chat(req.chat, messages, add_generation_prompt)
    for k, v in sampling.items():
        if v is None:
            continue
        if k in ("stop", "stop_token_ids"):
            getattr(req.params, k).extend(v)
        else:
            setattr(req.params, k, v)
    return req


def _fill_chat(chat, messages, add_generation_prompt) -> None:
    for m in messages:
        chat.messages.add(role=m["role"], content=m["content"])
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    chat.SetInParent()


def _chunk(resp) -> Chunk:
    fin = finish_reason_name(resp.finish_reason)
    lps = [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in resp.logprobs] or None
    return Chunk(resp.request_id, list(resp.token_ids), resp.text, fin,
                 resp.usage.prompt_tokens if fin else None, resp.usage.completion_tokens if fin else None, lps)


class Client:
    """Blocking client over one channel. Thread-safe (gRPC channels are)."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 max_message_bytes: int = 64 << 20, channel: grpc.Channel | None = None):
        self.target = target
        self.timeout = timeout
        self.channel = channel or grpc.insecure_channel(target, options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)])
        self._rpc = {}
        for name, (req_cls, resp_cls, streaming) in METHODS.items():
            make = self.channel.unary_stream if streaming else self.channel.unary_unary
            self._rpc[name] = make(method_path(name), request_serializer=req_cls.SerializeToString,
                                   response_deserializer=resp_cls.FromString)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    # -- RPCs ----------------------------------------------------------------------------------------------
    def generate_stream(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Iterator[Chunk]:
        """Stream a completion chunk by chunk (see ``build_generate_request`` for the arguments).
        Breaking out of the loop cancels the RPC (the server then frees the request's KV pages)."""
        req = build_generate_request(prompt, **kwargs)
        call = self._rpc["Generate"](req, timeout=timeout if timeout is not None else self.timeout)
        try:
            for resp in call:
                yield _chunk(resp)
        finally:
            call.cancel()  # no-op when the stream already ended

    def generate_call(self, request: "pb.GenerateRequest", timeout: float | None = None):
        """The raw streaming call (a grpc iterator with .cancel()) for a prepared request."""
        return self._rpc["Generate"](request, timeout=timeout if timeout is not None else self.timeout)

    def generate(self, prompt: str | None = None, **kwargs) -> Completion:
        """The whole completion at once."""
        c = Completion(request_id="", text="")
        parts = []
        for ch in self.generate_stream(prompt, **kwargs):
            c.request_id = ch.request_id
            parts.append(ch.text)
            c.token_ids.extend(ch.token_ids)
            if ch.logprobs:
                c.logprobs.extend(ch.logprobs)
            if ch.finish_reason:
                c.finish_reason = ch.finish_reason
                c.prompt_tokens, c.completion_tokens = ch.prompt_tokens, ch.completion_tokens
        c.text = "".join(parts)
        return c

    def tokenize(self, text: str | None = None, *, messages: Sequence[dict] | None = None,
                 add_special_tokens: bool | None = None, add_generation_prompt: bool | None = None,
                 model: str = "") -> list[int]:
        if (text is None) == (messages is None):
            raise ValueError("give exactly one of text, messages")
        req = pb.TokenizeRequest(model=model)
        if text is not None:
            req.text = text
        else:
            _fill_chat(req.chat, messages, add_generation_prompt)
        if add_special_tokens is not None:
            req.add_special_tokens = add_special_tokens
        return list(self._rpc["Tokenize"](req, timeout=self.timeout).token_ids)

    def model_info(self) -> dict:
        r = self._rpc["ModelInfo"](pb.ModelInfoRequest(), timeout=self.timeout)
        return json_format.MessageToDict(r, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)

    def health(self, service: str = "") -> str:
        """"SERVING", "NOT_SERVING", ... from the standard grpc.health.v1 service."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout or 10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.client", description="Stream a completion from a tbjax server.")
    ap.add_argument("prompt", nargs="?", help="prompt text (read from stdin when '-' or absent)")
    ap.add_argument("--target", default=DEFAULT_TARGET, help=f"server address (default {DEFAULT_TARGET})")
    ap.add_argument("--chat", action="store_true", help="send the prompt as one user message (chat template)")
    ap.add_argument("--system", help="system message (with --chat)")
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--min-p", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--stop", action="append", help="stop string (repeatable)")
    ap.add_argument("--model", default="")
    ap.add_argument("--timeout", type=float, help="deadline in seconds")
    ap.add_argument("--info", action="store_true", help="print the model info and exit")
    ap.add_argument("--tokens", action="store_true", help="also print the token ids at the end")
    a = ap.parse_args(argv)
    with Client(a.target, timeout=a.timeout) as c:
        try:
            if a.info:
                for k, v in c.model_info().items():
                    print(f"{k}: {v}")
                return 0
            prompt = a.prompt if a.prompt not in (None, "-") else sys.stdin.read()
            kw = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                      min_p=a.min_p, seed=a.seed, stop=a.stop, model=a.model)
            if a.chat:
                msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [
                    {"role": "user", "content": prompt}]
                stream = c.generate_stream(messages=msgs, **kw)
            else:
                stream = c.generate_stream(prompt, **kw)
            ids = []
            for ch in stream:
                sys.stdout.write(ch.text)
                sys.stdout.flush()
                ids.extend(ch.token_ids)
                if ch.finish_reason:
                    sys.stdout.write("\n")
                    print(f"[finish_reason={ch.finish_reason} prompt_tokens={ch.prompt_tokens} "
                          f"completion_tokens={ch.completion_tokens}]", file=sys.stderr)
            if a.tokens:
                print(ids)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
