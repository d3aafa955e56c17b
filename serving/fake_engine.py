"""A test double of ``tbjax.engine.Engine``: the real scheduler and KV page accounting, a toy "model".

It exists so that the serving layer (limits, streaming, cancellation, backpressure, soak) and the load tool
can be exercised quickly on CPU without loading weights. It is NOT a model: the next token is a fixed
hash of (previous token, position, seed), so its output is known in advance (`reference`) and tests can
compare streamed output with it. Pages are allocated by the real ``tbjax.engine.Scheduler``, so "every
page comes back" is checked against the real allocator.

Interface (same as the engine's): add_request / abort / step / has_unfinished / stats / warmup / ready, plus
``FakeTokenizer`` (bytes as tokens) and ``FakeSamplingParams`` (the fields of ``tbjax.sampling.SamplingParams``).
``warmup()`` stands in for compiling every step program: it "compiles" ``warmup_programs`` programs in
``warmup_s`` seconds of ``time.sleep`` (0 by default), then ``ready`` is True; the engine steps without it too.
With ``warmup_jit=True`` each of those programs is a real (tiny) XLA compile, so that compile counting
(``tbjax.compile_monitor``, the ``tbjax_xla_compiles_total`` metric) can be tested through the fake.

As a stand-in for a GPU engine in front-end benchmarks (``benchmarks/load_test.py --spawn fake``):
``step_time_s`` is the device's share of a step, spent in ``time.sleep`` (the GIL is free, as while a real
engine waits for the device). By default it is added to the step's host work (schedule, sample, detokenize:
the engine as it is today); with ``overlap=True`` the device runs steps back to back while the host works, as
in an engine that prepares step N+1 while the device runs step N: a step ends ``step_time_s`` after the
previous one ended, or when this step's host work is done if that is later, so all host work between two
steps (this step's and the caller's own, e.g. the server handing outputs over) is hidden while it takes less
than ``step_time_s``; after an idle gap the step takes ``step_time_s`` from its start. Text is
detokenized incrementally (only the new bytes each step), like the real engine's detokenizer, so the host
cost per step does not grow with output length.
"""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field

from pallas_kernels.utils import check_int, is_number
from tbjax.engine import FinishReason, Scheduler, SchedulerConfig, Sequence

__all__ = ["FakeEngine", "FakeTokenizer", "FakeSamplingParams", "FakeRequestOutput", "fake_served_model"]

EOS, BOS, _OFFSET = 0, 1, 3   # ids 0..2 are special; byte b is token b + 3
VOCAB = 256 + _OFFSET


class FakeTokenizer:
    """Byte-level: token id = byte + 3. A tiny chat template ``<|role|>content\\n``."""

    vocab_size = VOCAB
    eos_token_ids = (EOS,)
    chat_template = "fake"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"expected str to encode, got {type(text).__name__}")
        return [b + _OFFSET for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i - _OFFSET for i in ids if i >= _OFFSET).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


@dataclass
class FakeSamplingParams:
    """Same fields and defaults as ``tbjax.sampling.SamplingParams``."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list = field(default_factory=list)
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int = 0

    def validate(self, vocab_size: int) -> "FakeSamplingParams":
        check_int("max_tokens", self.max_tokens, lo=1)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: {t} is out of vocabulary")
        return self


@dataclass
class FakeRequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    logprobs: list | None = None


def next_token(prev: int, pos: int, seed: int) -> int:
    """The toy model: a fixed hash. Never returns a special id except EOS, which it returns rarely."""
    h = (prev * 1103515245 + pos * 12345 + seed * 2654435761 + 0x9E37) & 0xFFFFFFFF
    h ^= h >> 13
    if h % 97 == 0:
        return EOS
    return _OFFSET + 32 + h % 95   # printable ASCII


def reference(prompt_ids: list[int], max_tokens: int, *, seed: int = 0, ignore_eos: bool = False,
              stop_token_ids=()) -> tuple[list[int], str]:
    """What the fake engine generates for this request (no scheduler involved): (ids, finish_reason)."""
    ids = list(prompt_ids)
    out = []
    for _ in range(max_tokens):
        t = next_token(ids[-1], len(ids), seed)
        ids.append(t)
        out.append(t)
        if t in stop_token_ids or (t == EOS and not ignore_eos):
            return out, "stop"
    return out, "length"


class FakeEngine:
    """Engine test double (see module docstring; implements ``tbjax.engine.api.StepEngine`` and ``PromptScorer``).
    ``step_time_s`` sleeps per step to mimic a device."""

    prefill_only = False

    def __init__(self, *, num_pages: int = 512, page_size: int = 4, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, max_model_len: int = 512, step_time_s: float = 0.0,
                 overlap: bool = False, warmup_s: float = 0.0, warmup_programs: int = 8, warmup_jit: bool = False):
        if not is_number(step_time_s) or not step_time_s >= 0:
            raise ValueError(f"step_time_s must be a number >= 0, got {step_time_s!r}")
        if not is_number(warmup_s) or not warmup_s >= 0:
            raise ValueError(f"warmup_s must be a number >= 0, got {warmup_s!r}")
        self.warmup_s = float(warmup_s)
        self.warmup_programs = int(warmup_programs)
        self.warmup_jit = bool(warmup_jit)
        self.ready = False
        self.scheduler = Scheduler(SchedulerConfig(
            num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len))
        self.max_model_len = max_model_len
        self.step_time_s = step_time_s
        self.overlap = bool(overlap)
        self._device_done = 0.0   # overlap: perf_counter time at which the device finished the previous step
        self.tokenizer = FakeTokenizer()
        # id -> [params, incremental UTF-8 decoder, text so far (with a stop string cut), length of text sent]
        self._req: dict[str, list] = {}
        self.num_added = 0

    def warmup(self, progress: bool = False) -> dict:
        """The engine's warm-up: "compile" every program (``warmup_programs`` sleeps adding up to ``warmup_s``)."""
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        n = max(self.warmup_programs, 1)
        for i in tqdm(range(n), desc="compiling (fake)", disable=not progress, leave=False):
            time.sleep(self.warmup_s / n)
            if self.warmup_jit and i < self.warmup_programs:
                import jax
                import numpy as np
                # a new function object and a shape of its own: never in JAX's in-memory cache, one backend compile
                np.asarray(jax.jit(lambda x: x * 2 + 1)(np.zeros((i + 1, 3), np.float32)))
        self.ready = True
        return {"programs": self.warmup_programs, "seconds": time.perf_counter() - t0}

    @property
    def kv_tokens_per_sequence(self) -> int:
        return self.scheduler.kv_tokens_per_sequence

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: FakeSamplingParams) -> None:
        params.validate(VOCAB)
        bad = [t for t in prompt_token_ids if not 0 <= t < VOCAB]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary: {bad[:5]}")
        seq = Sequence(request_id, list(prompt_token_ids), params.max_tokens,
                       stop_token_ids=params.stop_token_ids, eos_token_ids=(EOS,), ignore_eos=params.ignore_eos)
        self.scheduler.add(seq)  # RequestTooLarge (a ValueError) when it can never fit
        self._req[request_id] = [params, codecs.getincrementaldecoder("utf-8")(errors="replace"), "", 0]
        self.num_added += 1

    def prompt_logprobs(self, token_ids: list[int], k: int) -> list:
        """Toy prompt logprobs (serving/prompt_logprobs.py asks the engine first): None for the first token, then
        each token at -0.5 with the next k - 1 ids after it at -1 - j, as the fake's generated logprobs."""
        return [None] + [(-0.5, ([(t, -0.5)] + [((t + j) % VOCAB, -1.0 - j) for j in range(1, k)])[:k])
                         for t in token_ids[1:]]

    def abort(self, request_id: str) -> None:
        if self._req.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[FakeRequestOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        if self.step_time_s and not self.overlap:
            time.sleep(self.step_time_s)
        sampled = {}
        for e in batch.entries:
            if e.samples:
                p = self._req[e.seq_id][0]
                sampled[e.seq_id] = next_token(e.seq.token_ids[-1], len(e.seq.token_ids), p.seed or 0)
        outs = []
        for so in self.scheduler.on_step_done(batch, sampled):
            st = self._req[so.seq_id]
            p, dec, text, n_sent = st
            reason = so.finish_reason.value if so.finished else None
            # bytes of the new tokens (specials decode to nothing); an incomplete UTF-8 sequence at the end is
            # held back by the decoder until the next step, or shown as U+FFFD when the request ends
            text += dec.decode(bytes(i - _OFFSET for i in so.new_token_ids if i >= _OFFSET), reason is not None)
            cut = min((i for i in (text.find(s) for s in p.stop) if i >= 0), default=-1) if p.stop else -1
            if cut >= 0:  # a stop string: cut it (and what follows) off and finish
                text, reason = text[:cut], "stop"
                if not so.finished:
                    self.scheduler.finish(so.seq_id, FinishReason.STOP)
            lp = None
            if p.logprobs:
                lp = [{t: -0.5, **{(t + k) % VOCAB: -1.0 - k for k in range(1, p.logprobs)}}
                      for t in so.new_token_ids]
            finished = reason is not None
            outs.append(FakeRequestOutput(so.seq_id, list(so.new_token_ids), text[n_sent:], finished, reason, lp))
            if finished:
                del self._req[so.seq_id]
            else:
                st[2], st[3] = text, len(text)
        if self.step_time_s and self.overlap:   # the device ran this step while the host did the above
            prev = self._device_done
            start = prev if t0 - prev < self.step_time_s else t0   # back to back, or from here after a gap
            left = start + self.step_time_s - time.perf_counter()
            if left > 0:
                time.sleep(left)
            # the device's finish time (a late wake-up from sleep does not shift the next step's deadline); when
            # the host took longer than the step, the device waited for it
            self._device_done = start + self.step_time_s if left > 0 else time.perf_counter()
        return outs

    def stats(self) -> dict:
        s = self.scheduler.stats()
        return {"running": s["num_running"], "waiting": s["num_waiting"], "kv_pages_used": s["pages_used"],
                "kv_pages_total": s["pages_used"] + s["pages_free"], "prefix_hit_rate": s["prefix_hit_rate"],
                "pages_free": s["pages_free"], "pages_used": s["pages_used"], "pages_evictable": s["pages_evictable"]}


def fake_served_model(**engine_kwargs):
    """A ``ServedModel`` around a new ``FakeEngine`` (name "fake")."""
    from .model import ServedModel
    eng = FakeEngine(**engine_kwargs)
    return ServedModel(name="fake", arch="fake", tokenizer=eng.tokenizer, vocab_size=VOCAB,
                       max_context=eng.max_model_len, eos_token_ids=(EOS,), make_params=FakeSamplingParams,
                       engine=eng)
