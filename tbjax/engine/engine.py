"""The engine: requests in, streamed tokens out. Scheduler (host) + model runner (device) + detokenizer.

Everything above (the LLM API, the gRPC server) drives it through add_request / step / abort. It is not
thread-safe: one thread owns an Engine.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import Hashable

import jax

from tbjax.engine.kv_cache import KVCacheConfig, auto_num_pages, init_kv_cache, pages_for_budget
from tbjax.engine.request import FinishReason, Sequence
from tbjax.engine.runner import ModelRunner
from tbjax.engine.scheduler import RequestTooLarge, Scheduler, SchedulerConfig
from tbjax.sampling import SamplingParams
from tbjax.spec import ModelSpec
from tbjax.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int | None = None          # per dp rank incl. the null page; None => from kv_cache_bytes / free memory
    kv_cache_bytes: int | None = None     # KV memory budget per dp rank (pages = budget / page bytes)
    kv_dtype: str = "auto"                # "auto" => the weights' dtype; or bfloat16 / float8_e4m3fn / float8_e5m2
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_prefill_chunk: int | None = None
    max_model_len: int | None = None      # None => the model's max_position
    enable_prefix_caching: bool = True
    preemption: str = "recompute"
    attn_impl: str = "auto"


@dataclasses.dataclass
class RequestOutput:
    request_id: Hashable
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list | None = None          # per new token: (token_logprob, [(id, logprob), ...top-n])


@dataclasses.dataclass
class _ReqState:
    params: SamplingParams
    seed: int
    text: str = ""                        # text emitted so far (stop strings excluded)
    n_decoded: int = 0                    # output tokens already turned into text
    arrival: float = 0.0
    first_token_time: float | None = None


class Engine:
    def __init__(self, spec: ModelSpec, params, tokenizer: TextTokenizer, config: EngineConfig = EngineConfig()):
        self.spec, self.params, self.tokenizer, self.config = spec, params, tokenizer, config
        max_len = min(config.max_model_len or spec.max_position, spec.max_position)
        if config.kv_dtype == "auto":
            config = dataclasses.replace(config, kv_dtype=str(jax.tree.leaves(params)[0].dtype))
            self.config = config
        pbytes = sum(a.nbytes for a in jax.tree.leaves(params))
        if config.num_pages:
            num_pages = config.num_pages
        elif config.kv_cache_bytes:
            num_pages = pages_for_budget(spec, config.page_size, config.kv_dtype, config.kv_cache_bytes)
        else:
            num_pages = auto_num_pages(spec, config.page_size, config.kv_dtype, pbytes)
        self.kv_config = KVCacheConfig(num_pages=num_pages, page_size=config.page_size, dtype=config.kv_dtype)
        self.scheduler = Scheduler(SchedulerConfig(
            num_pages=num_pages, page_size=config.page_size, dp=1, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_prefill_chunk=config.max_prefill_chunk,
            max_model_len=max_len, enable_prefix_caching=config.enable_prefix_caching,
            preemption=config.preemption))
        self.max_model_len = max_len
        max_pages_per_seq = -(-max_len // config.page_size)
        self.runner = ModelRunner(spec, params, init_kv_cache(spec, self.kv_config), page_size=config.page_size,
                                  max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_pages_per_seq=max_pages_per_seq, attn_impl=config.attn_impl)
        self._reqs: dict[Hashable, _ReqState] = {}
        self._rng = random.Random()
        self.num_steps = 0

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, request_id: Hashable, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._reqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate(self.spec.vocab_size)
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.spec.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary (size {self.spec.vocab_size}): {bad[:5]}")
        eos = () if params.ignore_eos else tuple(self.tokenizer.eos_token_ids or self.spec.eos_token_ids)
        seq = Sequence(request_id, list(prompt_token_ids), max_tokens=int(params.max_tokens),
                       stop_token_ids=list(params.stop_token_ids), eos_token_ids=list(eos),
                       ignore_eos=params.ignore_eos)
        self.scheduler.add(seq)   # raises RequestTooLarge
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        self._reqs[request_id] = _ReqState(params, seed & 0xFFFFFFFF, arrival=time.monotonic())

    def abort(self, request_id: Hashable) -> bool:
        self._reqs.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one iteration -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        entries, sampling = [], []
        want_lp = False
        for e in batch.entries:
            st = self._reqs[e.seq_id]
            p = st.params
            entries.append((e.token_ids, e.start, list(e.block_table)))
            sampling.append((p.temperature, p.top_k, p.top_p, p.min_p, st.seed))
            want_lp |= p.logprobs > 0 and e.samples
        inp = self.runner.build_inputs(entries, sampling)
        out = self.runner.run(inp, want_logprobs=want_lp)
        self.num_steps += 1
        sampled = {e.seq_id: int(out["tokens"][i]) for i, e in enumerate(batch.entries) if e.samples}
        lp_by_id = {}
        if want_lp:
            for i, e in enumerate(batch.entries):
                if e.samples:
                    n = self._reqs[e.seq_id].params.logprobs
                    lp_by_id[e.seq_id] = (float(out["token_logprob"][i]),
                                          [(int(a), float(b)) for a, b in zip(out["top_ids"][i][:n],
                                                                              out["top_logprobs"][i][:n])])
        results = []
        for so in self.scheduler.on_step_done(batch, sampled):
            st = self._reqs.get(so.seq_id)
            if st is None:
                continue
            if st.first_token_time is None and so.new_token_ids:
                st.first_token_time = time.monotonic()
            results.append(self._emit(so, st, lp_by_id.get(so.seq_id)))
        return results

    def _emit(self, so, st: _ReqState, lp) -> RequestOutput:
        seq = self.scheduler.get(so.seq_id)
        out_ids = list(seq.output_token_ids) if seq is not None else list(so.new_token_ids)
        finished, reason = so.finished, (so.finish_reason.value if so.finish_reason else None)
        # text of the output so far, holding back an incomplete UTF-8 tail and any stop-token text
        ids_for_text = out_ids
        if finished and reason == "stop" and so.stop_token_id is not None and ids_for_text \
                and ids_for_text[-1] == so.stop_token_id:
            ids_for_text = ids_for_text[:-1]
        full = self.tokenizer.decode(ids_for_text, skip_special_tokens=True)
        if not finished and full.endswith("\ufffd"):
            full = full[: len(st.text)] if len(full) > len(st.text) else st.text
        stop_hit = None
        for s in st.params.stop:
            i = full.find(s, max(0, len(st.text) - len(s) + 1))
            if i >= 0 and (stop_hit is None or i < stop_hit):
                stop_hit = i
        if stop_hit is not None:
            full = full[:stop_hit]
            if not finished:
                self.scheduler.finish(so.seq_id, FinishReason.STOP)
            finished, reason = True, "stop"
        delta = full[len(st.text):] if full.startswith(st.text) else full
        st.text = full if len(full) >= len(st.text) else st.text
        if finished:
            self._reqs.pop(so.seq_id, None)
        return RequestOutput(so.seq_id, list(so.new_token_ids), delta, finished, reason,
                             [lp] if lp is not None and so.new_token_ids else None)

    def stats(self) -> dict:
        s = self.scheduler
        d = {"running": s.num_running, "waiting": s.num_waiting, "steps": self.num_steps,
             "compiled_programs": self.runner.num_compiled, "capacity_tokens": s.capacity_tokens}
        if hasattr(s, "stats"):
            d.update(s.stats())
        return d


__all__ = ["Engine", "EngineConfig", "RequestOutput", "RequestTooLarge"]
