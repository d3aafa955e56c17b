"""Pipeline-parallel prefill: the layers split over `pp` devices by FLOPs, a prompt flowing through in chunks.

Why this module exists: prefill is compute-bound, decode memory-bound, so tbjax prefills on one DP replica whose
layers are spread over a `pp` axis: each device holds 1/pp of the weights (memory left for KV and batch), and once
the pipe is full every device works: stage s runs chunk c while stage s+1 runs chunk c-1. Stages are balanced by
FLOPs, not by layer count: a DeepSeek-style model's dense first layers, MoE layers (only top_k of the routed
experts count) and MLA attention cost different amounts per token.

    layer_flops_per_token(spec, context)  -> [float] per layer (2 x active parameters + attention scores)
    split_layers(spec, pp, context)       -> [range] contiguous stages minimizing the largest stage's FLOPs (exact)
    PipelinePrefill(spec, params, devices, chunk_tokens, max_len).prefill(token_ids)
                                          -> (logits_V float32 of the last prompt token, [(k_TKH, v_TKH)] per layer)
    kv_to_transfer_pages(spec, kv, page_size, kv_dtype, device)
                                          -> (pages [n, L, G, 2K, H], fp8 scales [n, L, 2K] or None, n): what a
                                             decode engine's write_kv_pages takes (the same-host transfer layout)

Execution: one jitted program per stage, with its layers' weights placed on its device (stage 0 also holds the
embedding; the last stage the final norm and the output projection). The host issues, chunk by chunk, stage 0 ..
pp-1; JAX dispatch is asynchronous and each stage runs on its own device, so the stages overlap without any host
synchronisation until the final logits are read. Each stage keeps its layers' K/V of the prompt in dense buffers
[max_len, K, H] on its device (donated and updated in place); a chunk attends causally to every earlier position.
The K/V returned are what a prefill worker exports to the decode side.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import write_kv
from tbjax.engine.kv_cache import KVCacheConfig, init_kv_cache
from tbjax.model import layers as ly
from tbjax.model.params import group_shapes
from tbjax.model.transformer import layer_plan, lm_logits, run_layers
from tbjax.model.quant import params_dtype, take_rows
from tbjax.spec import ModelSpec, rope_attention_scale

ROUTED_EXPERT_PARAMS = ("we_gate", "we_up", "we_down")


def layer_flops_per_token(spec: ModelSpec, context: int) -> list[float]:
    """FLOPs one token costs in each layer: 2 x the parameters it multiplies (for MoE layers the routed experts
    count top_k / n_experts of their size) + 4 x heads x head dims x `context` for the attention scores and values
    (use the average attended length, e.g. half the prompt)."""
    shapes = group_shapes(spec)
    out = [0.0] * spec.n_layers
    for g in spec.layer_groups:
        active = 0.0
        for name, shp in shapes[g.name].items():
            n = float(np.prod(shp[1:]))
            if name in ROUTED_EXPERT_PARAMS:
                n *= spec.moe.top_k / spec.moe.n_experts
            active += n
        if g.attention == "mla":
            m = spec.mla
            att = 2.0 * spec.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * context
        else:
            att = 4.0 * spec.n_heads * spec.head_dim * context
        for i in g.layers:
            out[i] = 2.0 * active + att
    return out


def balanced_partition(costs, parts: int) -> list[range]:
    """Contiguous ranges of `costs` (in order) into `parts` non-empty pieces minimizing the largest piece's sum."""
    L = len(costs)
    if not 1 <= parts <= L:
        raise ValueError(f"pp must be in 1..{L} (the model's layers), got {parts}")
    pre = np.concatenate([[0.0], np.cumsum(np.asarray(costs, np.float64))])
    INF = float("inf")
    # best[s][i]: least possible largest sum covering items [0, i) with s pieces; cut[s][i]: where piece s starts
    best = [[INF] * (L + 1) for _ in range(parts + 1)]
    cut = [[0] * (L + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for s in range(1, parts + 1):
        for i in range(s, L - (parts - s) + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], pre[i] - pre[j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    ranges, i = [], L
    for s in range(parts, 0, -1):
        j = cut[s][i]
        ranges.append(range(j, i))
        i = j
    return ranges[::-1]


def split_layers(spec: ModelSpec, pp: int, context: int = 2048) -> list[range]:
    """Contiguous layer ranges for `pp` stages minimizing the most expensive stage's FLOPs per token."""
    return balanced_partition(layer_flops_per_token(spec, context), pp)


def kv_head_shape(spec: ModelSpec, attention: str) -> tuple[int, int]:
    """(heads, dims) of the K/V a layer kind hands to `attend` (MLA in its expanded form: per head, padded)."""
    if attention == "mla":
        m = spec.mla
        return spec.n_heads, max(m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)
    return spec.n_kv_heads, spec.head_dim


def chunk_attention(q_TNH, k_JKH, v_JKH, q_pos_T, *, scale: float, window: int | None = None,
                    soft_cap: float | None = None):
    """Queries of one chunk over the whole K/V buffer (position = buffer index), causal, float32 softmax."""
    T, N, H = q_TNH.shape
    J, K = k_JKH.shape[:2]
    g = N // K
    q = q_TNH.astype(jnp.float32).reshape(T, K, g, H)
    s = jnp.einsum("tkgh,jkh->kgtj", q, k_JKH.astype(jnp.float32)) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    kpos = jnp.arange(J)[None, :]
    mask = kpos <= q_pos_T[:, None]
    if window is not None:
        mask &= kpos > q_pos_T[:, None] - window
    s = jnp.where(mask[None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("kgtj,jkh->tkgh", p, v_JKH.astype(jnp.float32))
    return o.reshape(T, N, v_JKH.shape[-1]).astype(q_TNH.dtype)


@dataclasses.dataclass(frozen=True)
class _Stage:
    index: int
    layers: tuple[int, ...]
    device: object
    first: bool
    last: bool


def _stage_step(stage_params, x_or_tokens, positions_T, start, kv_bufs, *, spec: ModelSpec, layers, first: bool,
                last: bool, last_row):
    """One chunk through one stage. Returns (hidden_TD or logits of `last_row`, updated K/V buffers)."""
    scale = rope_attention_scale(spec)
    x = take_rows(stage_params["embed"], x_or_tokens) if first else x_or_tokens
    cos, sin = ly.rope_cos_sin(positions_T, spec.rope)

    def attend(layer, q, k, v, cache):
        kb = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), start, axis=0)
        vb = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), start, axis=0)
        o = chunk_attention(q, kb, vb, positions_T, scale=scale, window=spec.layer_window(layer))
        return o, (kb, vb)

    caches = [None] * spec.n_layers
    for li, buf in zip(layers, kv_bufs):
        caches[li] = buf
    x, caches = run_layers(stage_params, spec, x, cos, sin, attend, caches, layers=layers)
    new_bufs = [caches[li] for li in layers]
    if last:
        h = ly.rms_norm(jax.lax.dynamic_slice_in_dim(x, last_row, 1, axis=0), stage_params["final_norm"],
                        spec.norm_eps)
        return lm_logits(stage_params, spec, h)[0], new_bufs
    return x, new_bufs


class PipelinePrefill:
    """Prefill of one prompt at a time over `devices` (one pipeline stage each), in chunks of `chunk_tokens`."""

    def __init__(self, spec: ModelSpec, params, devices, *, chunk_tokens: int = 256, max_len: int = 4096,
                 stages: list[range] | None = None, context: int | None = None):
        devices = list(devices)
        if chunk_tokens < 1 or max_len < chunk_tokens:
            raise ValueError(f"need 1 <= chunk_tokens <= max_len, got chunk_tokens={chunk_tokens}, max_len={max_len}")
        self.spec, self.chunk, self.max_len = spec, chunk_tokens, -(-max_len // chunk_tokens) * chunk_tokens
        self.ranges = stages if stages is not None else split_layers(spec, len(devices), context or max_len // 2)
        if len(self.ranges) != len(devices):
            raise ValueError(f"{len(self.ranges)} stages for {len(devices)} devices")
        if [i for r in self.ranges for i in r] != list(range(spec.n_layers)):
            raise ValueError(f"stages {self.ranges} must cover layers 0..{spec.n_layers - 1} in order")
        plan = layer_plan(spec)
        self.stages, self.params, self._fns = [], [], []
        for s, (r, dev) in enumerate(zip(self.ranges, devices)):
            st = _Stage(s, tuple(r), dev, s == 0, s == len(devices) - 1)
            mine = {(plan[i][0], plan[i][3]) for i in r}       # this stage's (group, index in group)
            tree = {"groups": {g: {k: [v[j] if (g, j) in mine else None for j in range(v.shape[0])]
                                   for k, v in gp.items()} for g, gp in params["groups"].items()}}
            if st.first:
                tree["embed"] = params["embed"]
            if st.last:
                tree["final_norm"] = params["final_norm"]
                tree["lm_head" if not spec.tie_embeddings else "embed"] = (
                    params["embed"] if spec.tie_embeddings else params["lm_head"])
            self.stages.append(st)
            self.params.append(jax.device_put(tree, dev))
            self._fns.append(jax.jit(functools.partial(_stage_step, spec=spec, layers=st.layers, first=st.first,
                                                       last=st.last), donate_argnums=(4,)))
        self.dtype = jnp.dtype(params_dtype(params))   # the compute dtype (not a quantized weight's codes)

    def _empty_kv(self, st: _Stage):
        plan = layer_plan(self.spec)
        bufs = []
        for i in st.layers:
            K, H = kv_head_shape(self.spec, plan[i][1])
            z = jnp.zeros((self.max_len, K, H), self.dtype, device=st.device)
            bufs.append((z, z.copy()))
        return bufs

    def prefill(self, token_ids):
        """(logits_V float32 of the last token, [(k [n, K, H], v [n, K, H]) per layer] as device arrays)."""
        logits, kv, n = self.prefill_padded(token_ids)
        return logits, [(k[:n], v[:n]) for k, v in kv]

    def prefill_padded(self, token_ids):
        """As `prefill`, with each layer's K/V padded to whole chunks ([n_chunks * chunk, K, H]) and n returned:
        no per-length slice, so a prefill after warm-up compiles nothing. -> (logits_V, kv, n)."""
        ids = np.asarray(token_ids, np.int32).reshape(-1)
        n = ids.shape[0]
        if n == 0:
            raise ValueError("empty prompt")
        if n > self.max_len:
            raise ValueError(f"prompt of {n} tokens is longer than this pipeline's max_len={self.max_len}")
        if ids.min() < 0 or ids.max() >= self.spec.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.spec.vocab_size})")
        C = self.chunk
        n_chunks = -(-n // C)
        padded = np.zeros(n_chunks * C, np.int32)
        padded[:n] = ids
        kv = [self._empty_kv(st) for st in self.stages]
        logits = None
        for c in range(n_chunks):
            start = c * C
            pos = jnp.arange(start, start + C, dtype=jnp.int32)
            last_row = min(n - 1 - start, C - 1)
            x = padded[start:start + C]
            for st, fn, p in zip(self.stages, self._fns, self.params):
                x = jax.device_put(x, st.device)
                x, kv[st.index] = fn(p, x, jax.device_put(pos, st.device), start, kv[st.index],
                                     last_row=jnp.int32(max(last_row, 0)))
            logits = x if c == n_chunks - 1 else None
        return logits, [(k, v) for stage_kv in kv for k, v in stage_kv], n


def _no_mla_export(spec: ModelSpec) -> None:
    if spec.mla is not None:
        raise NotImplementedError("pipeline prefill keeps MLA K/V in the expanded per-head form, while the decode "
                                  "engine caches the latent form: exporting MLA KV from the pipeline is not supported "
                                  "yet (PipelinePrefill.prefill itself works for MLA models)")


def kv_to_transfer_pages(spec: ModelSpec, kv, page_size: int, kv_dtype: str, device=None, n: int | None = None):
    """Dense per-layer prompt K/V ([n, K, H] each, any devices; or padded, with the prompt's first `n` rows) -> the
    paged transfer layout of a decode engine:
    pages [n_pages, L, G, 2K, H] and fp8 scales [n_pages, L, 2K] (None for bf16/f32), written by the engine's own
    `write_kv` into fresh pools, so quantization and the K/V interleave are exactly the engine's."""
    _no_mla_export(spec)
    rows = int(kv[0][0].shape[0])
    n = rows if n is None else int(n)
    if not 0 < n <= rows:
        raise ValueError(f"n={n} prompt tokens, but the K/V hold {rows} rows")
    n_pages = -(-n // page_size)
    # page 0 of the scratch pools is the null page; the prompt fills pages 1..n_pages
    pools = init_kv_cache(spec, KVCacheConfig(num_pages=n_pages + 1, page_size=page_size, dtype=kv_dtype))
    slots = jnp.arange(page_size, page_size + n, dtype=jnp.int32)
    write = jax.jit(write_kv, donate_argnums=(0, 1))
    pages, scales = [], []
    for (pg, sc), (k, v) in zip(pools, kv):
        pg, sc = jax.device_put((pg, sc), device)
        k, v = (k, v) if k.shape[0] == n else (k[:n], v[:n])
        pg, sc = write(pg, sc, jax.device_put(k, device), jax.device_put(v, device), jax.device_put(slots, device))
        pages.append(pg[1:])
        scales.append(None if sc is None else sc[1:])
    stacked = jnp.stack(pages, axis=1)
    return stacked, (None if scales[0] is None else jnp.stack(scales, axis=1)), n_pages


class PipelinePrefillEngine:
    """A prefill-only engine over a PipelinePrefill: the subset of `Engine` a prefill worker drives
    (add_request(..., prefill_only=True) / step / has_unfinished / abort / export_kv / stats), so a
    disaggregated prefill worker can own a `pp` mesh instead of one device.

    One prompt per step (the pipeline's chunks are what fill the stages). The first token is sampled from the
    last position's logits with the request's sampling parameters and the engine's seed convention
    (fold_in(seed, position)); `export_kv(..., on_device=True)` gives the decode side's transfer layout.
    Implements ``tbjax.engine.api.StepEngine`` (``prefill_only``) and ``KVExporter``.
    """

    prefill_only = True
    kv_tokens_per_sequence = None   # no page pool: the prompt's KV is built whole, then exported

    def __init__(self, spec: ModelSpec, params, tokenizer, devices, *, page_size: int = 16, kv_dtype: str = "auto",
                 chunk_tokens: int = 256, max_model_len: int | None = None, stages: list[range] | None = None):
        import random
        import types

        _no_mla_export(spec)
        self.spec, self.tokenizer = spec, tokenizer
        self.max_model_len = min(max_model_len or spec.max_position, spec.max_position)
        self.pipe = PipelinePrefill(spec, params, devices, chunk_tokens=min(chunk_tokens, self.max_model_len),
                                    max_len=self.max_model_len, stages=stages)
        self.page_size = page_size
        self.kv_dtype = params_dtype(params) if kv_dtype == "auto" else kv_dtype   # quantized: the compute dtype
        self.device = self.pipe.stages[0].device
        # what page_layout / scales_layout / pool_device of a prefill worker read: one page of every layer
        probe = init_kv_cache(spec, KVCacheConfig(num_pages=2, page_size=page_size, dtype=self.kv_dtype))
        self.runner = types.SimpleNamespace(caches=jax.device_put(probe, self.device), num_compiled=0)
        self._rng = random.Random()
        self._queue: list = []
        self._done: dict = {}
        self.num_steps = 0
        self._warm = False

    def add_request(self, request_id, prompt_token_ids, params, *, prefill_only: bool = False) -> None:
        if not prefill_only:
            raise ValueError("a pipeline prefill engine only runs prefill_only requests (decode runs elsewhere)")
        ids = [int(t) for t in prompt_token_ids]
        params.validate(self.spec.vocab_size)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room for output (max_model_len "
                             f"{self.max_model_len})")
        if any(not 0 <= t < self.spec.vocab_size for t in ids):
            raise ValueError(f"token ids must be in [0, {self.spec.vocab_size})")
        if request_id in self._done or any(r[0] == request_id for r in self._queue):
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        self._queue.append((request_id, ids, params, seed & 0xFFFFFFFF))

    def has_unfinished(self) -> bool:
        return bool(self._queue)

    @property
    def ready(self) -> bool:
        return self._warm

    def warmup(self, progress: bool = False) -> dict:
        """Compile the pipeline's stage programs: one short prefill-only request (every prompt runs the same
        per-chunk programs), its KV dropped."""
        import time

        from tbjax.sampling import SamplingParams
        t0 = time.perf_counter()
        rid = "__tbjax_pipeline_warmup__"
        self.add_request(rid, [0, 1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
        while self.has_unfinished():
            self.step()
        self.abort(rid)
        self._warm = True
        return {"programs": len(self.pipe.stages), "seconds": time.perf_counter() - t0}

    def abort(self, request_id) -> bool:
        n = len(self._queue)
        self._queue = [r for r in self._queue if r[0] != request_id]
        return self._done.pop(request_id, None) is not None or len(self._queue) != n

    def step(self):
        from tbjax.engine.engine import RequestOutput
        from tbjax.sampling import sample
        if not self._queue:
            return []
        rid, ids, p, seed = self._queue.pop(0)
        logits, kv, n = self.pipe.prefill_padded(ids)
        f32 = lambda v: jnp.asarray([v], jnp.float32)   # noqa: E731
        tok, _ = sample(logits[None].astype(jnp.float32), f32(p.temperature), jnp.asarray([p.top_k], jnp.int32),
                        f32(p.top_p), f32(p.min_p), jnp.asarray([seed], jnp.uint32),
                        jnp.asarray([len(ids)], jnp.int32))
        first = int(np.asarray(tok)[0])
        self.num_steps += 1
        eos = () if p.ignore_eos else tuple(getattr(self.tokenizer, "eos_token_ids", ()) or self.spec.eos_token_ids)
        stop_tok = first in set(p.stop_token_ids) | set(eos)
        text = "" if stop_tok else self.tokenizer.decode([first], skip_special_tokens=True)
        stop_str = next((s for s in p.stop if s in text), None)
        if stop_str is not None:
            text = text[:text.find(stop_str)]
        reason = "stop" if (stop_tok or stop_str is not None) else "length"
        self._done[rid] = (ids, first, (kv, n))
        return [RequestOutput(rid, [first], text, True, reason)]

    def export_kv(self, request_id, *, on_device: bool = False):
        """The KV of a prefilled request in the transfer layout (device arrays; `on_device=False` lists over
        layers on the host, like Engine.export_kv); it is dropped from this engine after."""
        from tbjax.engine.engine import KVExport
        got = self._done.pop(request_id, None)
        if got is None:
            raise KeyError(f"request {request_id!r} has no KV to export (unknown, still queued or already exported)")
        ids, first, (kv, n) = got
        pages, scales, n_pages = kv_to_transfer_pages(self.spec, kv, self.page_size, self.kv_dtype, self.device, n=n)
        if on_device:
            return KVExport(request_id, ids, first, None, None, pages, scales, n_pages)
        hp = np.asarray(jax.device_get(pages))
        hs = None if scales is None else np.asarray(jax.device_get(scales))
        return KVExport(request_id, ids, first, [hp[:, l] for l in range(hp.shape[1])],
                        None if hs is None else [hs[:, l] for l in range(hs.shape[1])])

    def stats(self) -> dict:
        return {"running": 0, "waiting": len(self._queue), "steps": self.num_steps, "held": len(self._done),
                "pp_stages": [[r.start, r.stop] for r in self.pipe.ranges]}
