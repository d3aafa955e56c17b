"""The engine: requests in, streamed tokens out. Scheduler (host) + model runner (device) + detokenizer.

Everything above (the LLM API, the gRPC server) drives it through add_request / step / abort. It is not
thread-safe: one thread owns an Engine.

Overlapped scheduling (``EngineConfig.overlap_scheduling``; by default on for accelerators, off on CPU, where the
"device" is the host's own cores and XLA:CPU compiling while a step still runs is best avoided): ``step()`` launches
step N+1 on the
device before it waits for step N, so scheduling, input building and the next step's launch run while the device
computes, and the device never waits for the host between steps. Step N+1 is scheduled as if step N had returned
(tbjax/engine/scheduler.py): a token sampled by step N is fed to step N+1 on the device, without a host round trip.
So ``step()`` returns the outputs of the step before the one it launched (the first call returns none); outputs
are the same tokens as without overlap. When step N+1 cannot be scheduled without step N's results (pages short:
preemption) the engine finishes step N first.

Prefill/decode disaggregation: a prefill engine runs ``add_request(..., prefill_only=True)`` (prompt + the first
token, pages held when it finishes) and then ``export_kv`` (pages to host, then freed); a decode engine reserves
pages only when the KV is about to arrive (``reserve_kv``), writes them (``write_kv_pages``) and continues with
``add_prefilled_request``; ``release_reservation`` (or ``abort``) frees a reservation that never completed.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import Hashable

import jax

from pallas_kernels.utils import is_int
from tbjax.engine.detokenize import IncrementalText, StreamText, incremental_text
from tbjax.engine.kv_cache import KVCacheConfig, auto_num_pages, pages_for_budget
from tbjax.engine.kv_pages import gather_pages, gather_pages_stacked, scatter_pages, scatter_pages_stacked
from tbjax.engine.request import FinishReason, Sequence
from tbjax.engine.runner import ModelRunner
from tbjax.model.quant import params_dtype
from tbjax.engine.scheduler import KVReservationError, RequestTooLarge, Scheduler, SchedulerConfig
from tbjax.engine import speculative
from tbjax.engine.speculative import SpeculativeConfig, SpeculativeDecoder
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
    # tokens per step (the prefill chunk): None => default_max_num_batched_tokens (16384 on GPU / TPU, 512 on CPU)
    max_num_batched_tokens: int | None = None
    max_prefill_chunk: int | None = None
    max_model_len: int | None = None      # None => the model's max_position
    enable_prefix_caching: bool = True
    preemption: str = "recompute"
    attn_impl: str = "auto"
    matmul_impl: str = "auto"             # decode projections: "auto" (kernel on GPU at batch <= 4) | "xla" | "kernel"
    # "auto" (split on GPU) | "stacked" | "split": per-layer weight buffers make the layers' GEMM fusions identical,
    # so XLA:GPU autotunes and compiles them once (H200, Llama-8B decode program: 6.5 s instead of 41 s)
    layer_buffers: str = "auto"
    overlap_scheduling: bool | None = None  # launch step N+1 before waiting for step N; None = on unless on CPU
    fold_norms: bool = False              # RMSNorm weights folded into w_qkv / w_gate_up (fewer kernels; not yet timed)
    # XLA:GPU command buffers (CUDA graphs) around the step's kernels: "auto" (runner.GPU_COMMAND_BUFFERS) | "on" |
    # "off"; other platforms ignore it
    command_buffers: str = "auto"
    # The decode mesh: None (one device), "dp=4,ep=2" (axis=size), a dict, or a jax.sharding.Mesh with the axes
    # dp, ep, tp, pp (sharding.mesh.make_mesh). Requests, KV pools, attention-weight shards and routed experts are
    # spread over all of its devices by default (`decode_layout`: sharding.mesh.DecodeLayout).
    mesh: object = None
    decode_layout: object = None
    # Speculative decoding with a sliding-window draft (tbjax/engine/speculative.py): None (off), or
    # {"draft": "self" | PATH, "num_tokens": 4, "window": 128} (a dict, "draft=self,num_tokens=4" or JSON text, or a
    # SpeculativeConfig). Runs without overlapped scheduling.
    speculative: object = None
    # Batch-invariant steps: a request's tokens and logprobs do not depend on what else is in the batch, when it
    # arrived or how its prompt was chunked (runner.ModelRunner `deterministic`: one token bucket, every attention row
    # as a decode). Costs the padding of every step to max_num_batched_tokens (benchmarks/RESULTS.md); dense models
    # only (a MoE layer's expert grouping still depends on the batch).
    deterministic: bool = False
    # Sampled rows drawn by a small program after the step (only on steps that have one) instead of inside it, so
    # that greedy steps never pay for the top-k / top-p / min-p filters: None = on GPU (runner `post_sample`)
    post_sample: bool | None = None
    # Decode-only steps of buckets above 64 tokens (up to max_num_seqs) run a program of their own with one attention
    # kernel per layer (runner `decode_programs`): None = where the attention runs kernels (GPU / TPU)
    decode_programs: bool | None = None


# Tokens per step when EngineConfig.max_num_batched_tokens is None. GPU / TPU: 16384 (H100, Llama-8B shapes, 128
# requests x (512 + 256): 7126 out tok/s at 16384, 6851 at 4096, 6432 at 512, same call; benchmarks/RESULTS.md
# session 16); a larger chunk stalls running streams for one longer step. CPU: 512, the earlier default for every
# platform (not re-measured).
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 512}
ACCELERATOR_MAX_NUM_BATCHED_TOKENS = 16384


def default_max_num_batched_tokens(max_num_seqs: int, platform: str | None = None) -> int:
    """The step budget used when none is given: per platform, at least max_num_seqs."""
    platform = platform or jax.default_backend()
    return max(DEFAULT_MAX_NUM_BATCHED_TOKENS.get(platform, ACCELERATOR_MAX_NUM_BATCHED_TOKENS), max_num_seqs)


@dataclasses.dataclass
class RequestOutput:
    request_id: Hashable
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list | None = None          # per new token: (token_logprob, [(id, logprob), ...top-n])


@dataclasses.dataclass
class KVExport:
    """A prefilled request's KV, ready to travel to a decode engine: on the host (``pages`` / ``scales``, lists
    over layers) or, from ``export_kv(..., on_device=True)``, still on the device in the transfer layout
    (``device_pages`` [X, L, G, 2K, H], ``device_scales`` [X, L, 2K] or None; rows past ``num_pages`` are
    padding) so that a same-host transfer can DMA it straight into shared memory."""
    request_id: Hashable
    prompt_token_ids: list[int]
    first_token: int
    pages: list | None                    # over layers: np [n_pages, G, 2K, H]
    scales: list | None                   # over layers: np [n_pages, 2K] (fp8 pools) or None
    device_pages: object = None
    device_scales: object = None
    n_pages: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the pages hold (the prompt)."""
        return len(self.prompt_token_ids)

    @property
    def num_pages(self) -> int:
        return self.pages[0].shape[0] if self.pages is not None else self.n_pages

    def stacked(self):
        """Pages as one host array [n_pages, L, G, 2K, H] (one transfer page = one page id over all layers)."""
        import numpy as np
        if self.pages is None:
            return np.asarray(jax.device_get(self.device_pages))[: self.n_pages]
        return np.stack(self.pages, axis=1)

    def stacked_scales(self):
        """fp8 scales as one host array [n_pages, L, 2K], or None."""
        import numpy as np
        if self.pages is None:
            return None if self.device_scales is None else \
                np.asarray(jax.device_get(self.device_scales))[: self.n_pages]
        return None if self.scales is None else np.stack(self.scales, axis=1)


@dataclasses.dataclass
class _InFlight:
    """A launched step: its batch, its device outputs, and where each sampling sequence's token is in them."""
    batch: object
    out: dict
    rows: dict                            # seq id -> row of out["tokens"] (over all ranks)
    local_rows: dict                      # seq id -> row in its rank's outputs (what the next step's src_T names)
    want_logprobs: bool = False


@dataclasses.dataclass
class _ReqState:
    params: SamplingParams
    seed: int
    text: str = ""                        # text emitted so far (stop strings excluded)
    detok: IncrementalText | StreamText | None = None  # the output's text, decoded a few tokens per step
    out_ids: list = dataclasses.field(default_factory=list)   # output token ids so far
    arrival: float = 0.0
    first_token_time: float | None = None


class Engine:
    """The engine (implements ``tbjax.engine.api.StepEngine``, ``KVExporter`` and ``KVImporter``)."""

    prefill_only = False   # decodes too; ``add_request(..., prefill_only=True)`` holds a request's KV after its prefill

    def __init__(self, spec: ModelSpec, params, tokenizer: TextTokenizer, config: EngineConfig = EngineConfig()):
        self.spec, self.params, self.tokenizer, self.config = spec, params, tokenizer, config
        max_len = min(config.max_model_len or spec.max_position, spec.max_position)
        if config.kv_dtype == "auto":
            config = dataclasses.replace(config, kv_dtype=params_dtype(params))   # quantized weights: their compute dtype
            self.config = config
        if config.max_num_batched_tokens is None:
            config = dataclasses.replace(config, max_num_batched_tokens=default_max_num_batched_tokens(
                config.max_num_seqs))
            self.config = config
        self.max_model_len = max_len
        max_pages_per_seq = -(-max_len // config.page_size)
        spec_cfg = SpeculativeConfig.parse(config.speculative)
        if config.deterministic is True and spec.moe is not None:
            log.warning("deterministic=True: %s has MoE layers, whose grouping of tokens by expert depends on the "
                        "batch; its outputs may still change with concurrent traffic", spec.arch)
        if spec_cfg is not None and config.overlap_scheduling:
            raise ValueError("speculative decoding runs without overlapped scheduling (the draft's proposals are "
                             "needed before the target's step is built): leave overlap_scheduling unset or False")
        self.runner = ModelRunner(spec, params, mesh=config.mesh, layout=config.decode_layout,
                                  page_size=config.page_size, max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_pages_per_seq=max_pages_per_seq, attn_impl=config.attn_impl,
                                  matmul_impl=config.matmul_impl, layer_buffers=config.layer_buffers,
                                  fold_norms=config.fold_norms, command_buffers=config.command_buffers,
                                  deterministic=config.deterministic, post_sample=config.post_sample,
                                  decode_programs=config.decode_programs,
                                  spec_role="target" if spec_cfg else None,
                                  spec_tokens=spec_cfg.num_tokens if spec_cfg else 0)
        # the draft (its weights, ring pools, distribution buffer) is placed before the target's KV is sized, so
        # that free-memory sizing counts it
        self.spec_decoder = SpeculativeDecoder(spec_cfg, self) if spec_cfg is not None else None
        pbytes = self.runner.param_bytes_per_device()
        if config.num_pages:
            num_pages = config.num_pages
        elif config.kv_cache_bytes:
            num_pages = pages_for_budget(spec, config.page_size, config.kv_dtype, config.kv_cache_bytes)
        else:
            num_pages = auto_num_pages(spec, config.page_size, config.kv_dtype, pbytes)
        self.kv_config = KVCacheConfig(num_pages=num_pages, page_size=config.page_size, dtype=config.kv_dtype)
        self.runner.init_caches(self.kv_config)
        self.num_ranks = self.runner.num_ranks
        self.scheduler = Scheduler(SchedulerConfig(
            num_pages=num_pages, page_size=config.page_size, dp=self.num_ranks, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_prefill_chunk=config.max_prefill_chunk,
            max_model_len=max_len, enable_prefix_caching=config.enable_prefix_caching,
            preemption=config.preemption, num_speculative_tokens=spec_cfg.num_tokens if spec_cfg else 0))
        self.params = self.runner.params      # one copy: with layer_buffers="split" the stacked tree is dropped
        self.overlap = jax.default_backend() != "cpu" if config.overlap_scheduling is None \
            else bool(config.overlap_scheduling)
        if self.spec_decoder is not None:
            self.overlap = False
        self._reqs: dict[Hashable, _ReqState] = {}
        self._rng = random.Random()
        self._pending: list[RequestOutput] = []   # outputs made outside a step (returned by the next step)
        self._inflight: _InFlight | None = None   # the launched step whose outputs the next step() returns
        self.num_steps = 0
        # host seconds per phase of step(), summed over steps: schedule, build (inputs), launch (dispatch of the step
        # program), wait (for the device, in fetch), emit (scheduler bookkeeping + detokenizing); where the host time
        # of a step goes (benchmarks/bench_engine_decode.py --e2e reports it per step)
        self.host_seconds = dict.fromkeys(("schedule", "build", "launch", "wait", "emit"), 0.0)

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, request_id: Hashable, prompt_token_ids: list[int], params: SamplingParams, *,
                    prefill_only: bool = False) -> None:
        """Queue a request. ``prefill_only``: compute the prompt and sample one token (whatever
        ``params.max_tokens`` says), then keep the pages until ``export_kv`` (or ``abort``)."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, max_tokens=1 if prefill_only else None)
        self.scheduler.add(seq, hold_pages=prefill_only)   # raises RequestTooLarge
        self._add_state(request_id, params)

    def _new_sequence(self, request_id, prompt_token_ids, params, max_tokens=None) -> Sequence:
        if request_id in self._reqs or self.scheduler.held(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate(self.spec.vocab_size)
        bad = [t for t in prompt_token_ids if not (is_int(t) and 0 <= t < self.spec.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary (size {self.spec.vocab_size}): {bad[:5]}")
        eos = () if params.ignore_eos else tuple(self.tokenizer.eos_token_ids or self.spec.eos_token_ids)
        return Sequence(request_id, list(prompt_token_ids), max_tokens=int(max_tokens or params.max_tokens),
                        stop_token_ids=list(params.stop_token_ids), eos_token_ids=list(eos),
                        ignore_eos=params.ignore_eos)

    def _add_state(self, request_id, params) -> _ReqState:
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        st = self._reqs[request_id] = _ReqState(params, seed & 0xFFFFFFFF, arrival=time.monotonic())
        st.detok = incremental_text(self.tokenizer)
        return st

    def abort(self, request_id: Hashable) -> bool:
        """Cancel a request; also frees pages held for export and an open KV reservation under this id."""
        self._reqs.pop(request_id, None)
        self._pending = [o for o in self._pending if o.request_id != request_id]
        held = self.scheduler.release_held(request_id)
        res = self.scheduler.release_reservation(request_id)
        if self.spec_decoder is not None:
            self.spec_decoder.release(request_id)
        return self.scheduler.abort(request_id) or held or res

    # ---- prefill/decode disaggregation -------------------------------------------------------------------
    def export_kv(self, request_id: Hashable, *, on_device: bool = False) -> KVExport:
        """The KV of a finished ``prefill_only`` request, gathered to the host (``on_device``: gathered into one
        device array in the transfer layout, no host copy); its pages are freed after."""
        seq = self.scheduler.held(request_id)
        if seq is None:
            what = "still running" if self.scheduler.get(request_id) is not None else "unknown or already exported"
            raise KeyError(f"request {request_id!r} has no KV to export ({what}; only a finished prefill_only "
                           "request has)")
        n = len(seq.prompt_token_ids)
        ids = self._global_pages(seq.dp_rank, seq.block_table[: -(-n // self.config.page_size)])
        try:
            if on_device:   # a new array: the pages can be freed (and rewritten) while it travels
                dev_pages, dev_scales = gather_pages_stacked(self.runner.caches, ids)
                return KVExport(request_id, list(seq.prompt_token_ids), int(seq.token_ids[n]), None, None,
                                dev_pages, dev_scales, len(ids))
            pages, scales = gather_pages(self.runner.caches, ids)
        finally:
            self.scheduler.release_held(request_id)
        return KVExport(request_id, list(seq.prompt_token_ids), int(seq.token_ids[n]), pages, scales)

    def reserve_kv(self, request_id: Hashable, n_tokens: int) -> list[int]:
        """Reserve the pages that ``n_tokens`` of incoming KV fill (late: call when the transfer starts).
        Raises ``KVReservationError`` when the pages or a sequence slot are not there."""
        if not is_int(n_tokens) or n_tokens < 1:
            raise ValueError(f"n_tokens must be an int >= 1, got {n_tokens!r}")
        if n_tokens >= self.max_model_len:
            raise KVReservationError(f"{n_tokens} tokens of KV leave no room for output (max_model_len "
                                     f"{self.max_model_len})")
        if request_id in self._reqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.scheduler.reserve(request_id, -(-n_tokens // self.config.page_size))

    def write_kv_pages(self, request_id: Hashable, layer_pages, layer_scales=None, first_page: int = 0, *,
                       num_pages: int | None = None) -> None:
        """Write received pages into the reservation's pages ``first_page .. first_page + n - 1``: either lists
        over layers ([n, G, 2K, H]; fp8: scales [n, 2K]) or one array in the transfer layout [n, L, G, 2K, H]
        (fp8: scales [n, L, 2K]) on the host or the device; with ``num_pages`` the array may carry padding rows
        past n (ignored)."""
        res = self.scheduler.reservation(request_id)
        if res is None:
            raise KVReservationError(f"no open KV reservation for {request_id!r}")
        ids = self._global_pages(res[0], res[1])
        if not isinstance(layer_pages, (list, tuple)):      # stacked transfer layout
            n = int(num_pages if num_pages is not None else layer_pages.shape[0])
            if first_page < 0 or n < 1 or first_page + n > len(ids) or n > layer_pages.shape[0]:
                raise ValueError(f"pages [{first_page}, {first_page + n}) do not fit the {len(ids)} reserved for "
                                 f"{request_id!r} (or the {layer_pages.shape[0]} rows given)")
            self.runner.caches = scatter_pages_stacked(self.runner.caches, ids[first_page:first_page + n],
                                                       layer_pages, layer_scales)
            return
        n = len(layer_pages[0]) if len(layer_pages) else 0
        if first_page < 0 or n < 1 or first_page + n > len(ids):
            raise ValueError(f"pages [{first_page}, {first_page + n}) do not fit the {len(ids)} reserved for "
                             f"{request_id!r}")
        self.runner.caches = scatter_pages(self.runner.caches, ids[first_page:first_page + n], layer_pages,
                                           layer_scales)

    def _global_pages(self, rank: int, ids) -> list[int]:
        """Rank-local page ids -> indices into the global pools [R * pages, ...]."""
        return [rank * self.kv_config.num_pages + int(i) for i in ids]

    def warmup(self, progress: bool = False) -> dict:
        """Compile every step program this engine can run (all token buckets, in parallel); afterwards no request
        of any shape compiles a step (one that does is logged as a warning). Returns programs and seconds."""
        runners = [self.runner] + ([self.spec_decoder.runner] if self.spec_decoder is not None else [])
        before = sum(r.num_compiled for r in runners)
        secs = sum(r.precompile(progress=progress) for r in runners)
        # programs taken ready-made (the saved program cache, or another engine of this process) vs compiled here
        loaded = sum(r.last_precompile["loaded"] for r in runners)
        compiled = sum(r.last_precompile["compiled"] for r in runners)
        return {"programs": sum(len(r.programs) for r in runners),
                "programs_total": sum(r.num_programs for r in runners),
                "new_programs": sum(r.num_compiled for r in runners) - before, "seconds": secs,
                "loaded": loaded, "compiled": compiled, "kv_pages": self.kv_config.num_pages}

    @property
    def kv_tokens_per_sequence(self) -> int:
        """KV positions one sequence can hold (one dp rank's usable pages x page size)."""
        return self.scheduler.kv_tokens_per_sequence

    @property
    def ready(self) -> bool:
        """Every step program is compiled (``warmup`` ran)."""
        return self.runner.ready and (self.spec_decoder is None or self.spec_decoder.runner.ready)

    def release_reservation(self, request_id: Hashable) -> bool:
        """Free a reservation whose transfer never completed; False if there is none."""
        return self.scheduler.release_reservation(request_id)

    def add_prefilled_request(self, request_id: Hashable, prompt_token_ids: list[int], first_token: int,
                              params: SamplingParams) -> None:
        """Continue a request whose prompt KV was written into its reservation (same id) and whose first token
        the prefill side sampled: it decodes from there. Outputs carry only tokens after ``first_token``; the
        text deltas continue after the first token's text."""
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        if not (isinstance(first_token, int) and 0 <= first_token < self.spec.vocab_size):
            raise ValueError(f"first_token {first_token!r} is not a token id of this vocabulary "
                             f"(size {self.spec.vocab_size})")
        reason = self.scheduler.add_prefilled(seq, request_id, first_token)
        st = self._add_state(request_id, params)
        st.first_token_time = time.monotonic()
        st.out_ids.append(first_token)
        st.text = st.detok.update(st.out_ids)             # "" while the token is an incomplete UTF-8 piece
        if reason is not None:   # the first token already ended it: report on the next step
            self._reqs.pop(request_id, None)
            self._pending.append(RequestOutput(request_id, [], "", True, reason.value))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self._inflight is not None

    # ---- one iteration -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration. Without overlap: schedule, run, return this step's outputs. With overlap: launch the next
        step, then wait for the one in flight and return its outputs."""
        if self.spec_decoder is not None:
            return self._spec_step()
        pending, self._pending = self._pending, []
        prev = self._inflight
        if prev is None:
            batch = self._schedule()
            if batch is None:
                return pending
            launched = self._launch(batch, None)
            if self.overlap:
                self._inflight = launched
                return pending
            return pending + self._complete(launched)
        batch = self._schedule()                  # built as if `prev` were done; None if it must be done first
        nxt = self._launch(batch, prev) if batch is not None else None
        results = self._complete(prev)
        if nxt is None and self.scheduler.has_unfinished():
            batch = self._schedule()
            nxt = self._launch(batch, None) if batch is not None else None
        self._inflight = nxt
        return pending + results

    def _schedule(self):
        t = time.perf_counter()
        batch = self.scheduler.schedule()
        self.host_seconds["schedule"] += time.perf_counter() - t
        return batch

    def _launch(self, batch, prev: _InFlight | None) -> _InFlight:
        t0 = time.perf_counter()
        entries, sampling, prev_rows = [], [], []
        want_lp = False
        for e in batch.entries:
            st = self._reqs[e.seq_id]
            p = st.params
            if e.from_prev:       # its token is prev's sample for this sequence: read on the device
                entries.append((e.dp_rank, [0], e.start, e.block_table))
                prev_rows.append(prev.local_rows[e.seq_id])
            else:
                entries.append((e.dp_rank, e.token_ids, e.start, e.block_table))
                prev_rows.append(-1)
            sampling.append((p.temperature, p.top_k, p.top_p, p.min_p, st.seed))
            want_lp |= p.logprobs > 0 and e.samples
        use_prev = prev is not None and any(r >= 0 for r in prev_rows)
        inp = self.runner.build_inputs(entries, sampling, prev_rows if use_prev else None)
        packed = inp.pack()
        t1 = time.perf_counter()
        out = self.runner.launch(inp, packed, prev=prev.out if use_prev else None)
        t2 = time.perf_counter()
        self.host_seconds["build"] += t1 - t0
        self.host_seconds["launch"] += t2 - t1
        samples = [(i, e) for i, e in enumerate(batch.entries) if e.samples]
        return _InFlight(batch, out, {e.seq_id: inp.rows[i] for i, e in samples},
                         {e.seq_id: inp.local_rows[i] for i, e in samples}, want_lp)

    def _complete(self, fl: _InFlight) -> list[RequestOutput]:
        """Wait for a launched step, record it in the scheduler and turn it into outputs."""
        batch = fl.batch
        t0 = time.perf_counter()
        out = self.runner.fetch(fl.out, fl.want_logprobs)
        t1 = time.perf_counter()
        self.host_seconds["wait"] += t1 - t0
        self.num_steps += 1
        sampled = {sid: int(out["tokens"][i]) for sid, i in fl.rows.items()}
        lp_by_id = {}
        if "token_logprob" in out:
            for e in batch.entries:
                st = self._reqs.get(e.seq_id)
                if e.samples and st is not None and st.params.logprobs > 0:
                    lp_by_id[e.seq_id] = [_row_logprobs(out, fl.rows.get(e.seq_id), st.params.logprobs)]
        results = self._outputs(batch, sampled, lp_by_id)
        self.host_seconds["emit"] += time.perf_counter() - t1
        return results

    def _outputs(self, batch, sampled, lps: dict) -> list[RequestOutput]:
        """Hands a step's sampled tokens to the scheduler and emits an output per request that got tokens (or
        finished); lps: request id -> one (logprob, top) per new token."""
        results = []
        for so in self.scheduler.on_step_done(batch, sampled):
            st = self._reqs.get(so.seq_id)
            if st is None:
                continue
            if st.first_token_time is None and so.new_token_ids:
                st.first_token_time = time.monotonic()
            results.append(self._emit(so, st, lps.get(so.seq_id)))
        return results

    def _spec_step(self) -> list[RequestOutput]:
        """One step with speculative decoding (tbjax/engine/speculative.py): the draft proposes, one target step
        verifies every decode's drafts and runs the prefill chunks, the scheduler keeps the accepted runs."""
        pending, self._pending = self._pending, []
        sd = self.spec_decoder
        batch = self.scheduler.schedule()
        if batch is None:
            sd.gc(self.scheduler)
            return pending
        props = sd.propose(batch, self._reqs, self.scheduler)
        entries, sampling, verify, want_lp = [], [], [], False
        for e in batch.entries:
            st = self._reqs[e.seq_id]
            p = st.params
            pr = props.get(e.seq_id)
            entries.append((e.dp_rank, e.token_ids + (pr.drafts if pr else []), e.start, e.block_table))
            verify.append(pr.q_rows if pr else None)
            sampling.append((p.temperature, p.top_k, p.top_p, p.min_p, st.seed))
            want_lp |= p.logprobs > 0 and e.samples
        inp = self.runner.build_inputs(entries, sampling, verify=verify)
        out = self.runner.fetch(self.runner.launch(inp, qbuf=sd.qbuf), want_lp)
        self.num_steps += 1
        sampled, lps = {}, {}
        for i, e in enumerate(batch.entries):
            if not e.samples:
                continue
            r0, nr = inp.rows[i], inp.n_rows[i]
            pr, a = props.get(e.seq_id), 0
            if pr is not None:
                a = speculative.accepted_prefix(out["accepted"][r0:r0 + nr - 1])
                sd.commit(e.seq_id, a)
            run = (pr.drafts[:a] if pr is not None else []) + [int(out["tokens"][r0 + a])]
            n_run = a + 1
            sampled[e.seq_id] = run if e.num_draft else run[0]
            st = self._reqs.get(e.seq_id)
            if want_lp and st is not None and st.params.logprobs > 0:
                lps[e.seq_id] = [_row_logprobs(out, j, st.params.logprobs) for j in range(r0, r0 + n_run)]
        if props:
            sd.num_verify_steps += 1
        results = self._outputs(batch, sampled, lps)
        sd.gc(self.scheduler)
        return pending + results

    def _emit(self, so, st: _ReqState, lps) -> RequestOutput:
        """The output of a request's new tokens (lps: one (logprob, top) per token, or None). A run of several
        tokens (speculative decoding) is emitted token by token, as if each came from a step of its own, so stop
        strings end the run where they would end it without speculation; one output."""
        if len(so.new_token_ids) <= 1:
            return self._emit_token(so, st, lps[0] if lps else None)
        ids, text, lp_out, last = [], "", [], None
        n = len(so.new_token_ids)
        for i, tok in enumerate(so.new_token_ids):
            end = i == n - 1
            one = dataclasses.replace(so, new_token_ids=[tok], finished=so.finished and end,
                                      finish_reason=so.finish_reason if end else None,
                                      stop_token_id=so.stop_token_id if end else None)
            last = self._emit_token(one, st, lps[i] if lps else None)
            ids += last.new_token_ids
            text += last.text_delta
            lp_out += last.logprobs or []
            if last.finished:
                break
        return RequestOutput(so.seq_id, ids, text, last.finished, last.finish_reason, lp_out or None)

    def _emit_token(self, so, st: _ReqState, lp) -> RequestOutput:
        st.out_ids.extend(so.new_token_ids)          # (the scheduler drops a finished sequence's own list)
        out_ids = st.out_ids
        finished, reason = so.finished, (so.finish_reason.value if so.finish_reason else None)
        # text of the output so far, holding back an incomplete UTF-8 tail and any stop-token text
        ids_for_text = out_ids
        if finished and reason == "stop" and so.stop_token_id is not None and ids_for_text \
                and ids_for_text[-1] == so.stop_token_id:
            ids_for_text = ids_for_text[:-1]
        full = st.detok.update(ids_for_text, final=finished)     # complete UTF-8 only, unless finished
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
        if self.spec_decoder is not None:
            d.update(self.spec_decoder.stats())
            d["compiled_programs"] += self.spec_decoder.runner.num_compiled
        return d


def _row_logprobs(out, row: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """(chosen-token logprob, the n top (token id, logprob) pairs) of one row of a fetched step."""
    return (float(out["token_logprob"][row]),
            [(int(a), float(b)) for a, b in zip(out["top_ids"][row][:n], out["top_logprobs"][row][:n])])


__all__ = ["Engine", "EngineConfig", "KVExport", "KVReservationError", "RequestOutput", "RequestTooLarge"]
