"""The engine's step: one ragged program over the decode mesh, compiled for a short fixed list of token buckets.

A step is every scheduled sequence's tokens concatenated, per dp rank: per sequence a query start (`cu_q_lens`),
a kv length and a row of the block table. Decode-only and mixed steps are the same program (the attention entry
`step_attention` sends one-row sequences to the decode kernel and the rest to the ragged kernel, each seeing the
other's sequences at kv length 0). Shapes depend only on the token bucket T (`token_buckets`): the sequence slots
are S = min(T, max_num_seqs) and the block table is always `max_pages_per_seq` wide, so no batch composition,
context length or sampling setting ever needs another program. The step returns its sampling rows' logits. Two
small programs keyed by the number of sampling slots follow it only on the steps that need them: on GPU the
sampled rows are drawn after the step (`_post_sample`, so greedy steps skip the filters), and the chosen token's
and the top `TOP_LOGPROBS` log-probabilities (`top_logprobs`) where a request asked for logprobs.

Mesh first: the program is one `jax.shard_map` over the decode mesh, a 1x1 mesh on one device. Requests are
split over the layout's batch axes: every device is a dp rank with its own KV pools (the global pool arrays are
[R * pages, ...], split over those axes) and its own page ids, and a step's inputs are stacked per rank. Attention
weights are either replicated (the plain tree) or packed 1/N per device and gathered a layer ahead; routed experts
are split over the expert axes (tbjax/model/mesh_forward.py plans and places; tbjax/model/transformer.py's
`run_layers` is the layer loop).

A step's host inputs travel as two packed arrays per rank (int32 and float32, fields 256-byte aligned) and are
unpacked in the program: per-array transfers cost more than the arrays (H200: host round trip 1.43 -> 0.54 ms at
batch 32). Overlapped scheduling launches step N+1 before step N's tokens reach the host: a token the host does not
know yet is taken, inside the program, from step N's sampled tokens (``src_T`` names the row of the rank's previous
output; every step returns its tokens padded to a fixed length, ``tokens_M``, so this adds no programs).

`precompile` compiles every bucket ahead of use, several XLA compiles at once (`ready` afterwards: a step that
still has to compile logs a warning naming its bucket).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import itertools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.paged_attention import step_attention, write_kv
from pallas_kernels.paged_attention.blocked import ragged_attention_blocked
from pallas_kernels.paged_attention.dispatch import ROWS_AS_DECODES_MAX_T, resolve_impl
from sharding import rules as sr
from sharding.mesh import DecodeLayout, MeshMismatch, axes_size
from tbjax.engine.kv_cache import KVCacheConfig, cache_heads
from tbjax.engine.mla_paged import latent_dims, write_latent
from tbjax.model import mesh_forward as mf
from tbjax.model.kinds import fold_norms as fold_layer_norms
from tbjax.model.linear import AUTO_KERNEL_MAX_T, MATMUL_IMPLS
from tbjax.model.params import split_layer_buffers
from tbjax.model.transformer import forward_hidden, lm_logits
from tbjax.sampling import sample, sampling_probs, top_k, verify_draft
from tbjax.spec import ModelSpec, rope_attention_scale

log = logging.getLogger(__name__)

TOP_LOGPROBS = 20
# How a layer group's weights are held: "stacked" [L, ...] arrays (sliced per layer inside the program) or "split"
# into per-layer buffers (tbjax/model/params.py split_layer_buffers: identical per-layer fusions, compiled once);
# "auto" = split on GPU.
LAYER_BUFFERS = ("auto", "stacked", "split")
# Token buckets: every power of two up to the largest decode batch (max_num_seqs, at least DENSE_UP_TO), then every
# fourth power of two, and the budget itself. Few programs (<= ~12 for budgets up to 16k) and at most 2x padding
# where decode lives (a 128-row decode in a 256-token bucket ran its GEMMs on twice the rows).
DENSE_UP_TO = 64
# XLA:GPU command buffers (CUDA graphs) for the step programs when EngineConfig.command_buffers is "auto". Off: on
# the H200 the Llama-8B decode step was faster without them at 32 x 1k, 64 x 8k and 1 x 1k in two separate calls
# (benchmarks/RESULTS.md, H200 runs of 2026-12-02 and 2026-12-04).
GPU_COMMAND_BUFFERS = False
COMMAND_BUFFERS = ("auto", "on", "off")


def token_buckets(max_tokens: int, min_tokens: int = 1, dense_up_to: int = DENSE_UP_TO) -> tuple[int, ...]:
    """The step's token buckets for a budget of `max_tokens` tokens per rank (sorted, the last one == max_tokens):
    powers of two times `min_tokens` below `dense_up_to` (at least DENSE_UP_TO), then every fourth one."""
    if max_tokens < 1 or min_tokens < 1:
        raise ValueError(f"token budget and minimum bucket must be >= 1, got {max_tokens}, {min_tokens}")
    dense = max(dense_up_to, DENSE_UP_TO)
    out, b = [], min_tokens
    while b < max_tokens:
        out.append(b)
        b *= 2 if b < dense else 4
    out.append(max_tokens)
    return tuple(out)


@dataclasses.dataclass
class StepInputs:
    """Host-built arrays of one step, stacked per dp rank ([R, ...]) and padded to the bucket."""
    tokens_T: np.ndarray
    positions_T: np.ndarray
    slots_T: np.ndarray
    block_tables_SP: np.ndarray
    kv_lens_S: np.ndarray
    cu_q_lens_S1: np.ndarray
    sample_rows_S: np.ndarray
    temperature_S: np.ndarray
    top_k_S: np.ndarray
    top_p_S: np.ndarray
    min_p_S: np.ndarray
    seed_S: np.ndarray
    sample_pos_S: np.ndarray
    src_T: np.ndarray                     # per token: row of the rank's previous sampled tokens to feed, or -1
    rows: list                            # per entry: its (first) row in the step's outputs [R * S]
    local_rows: list                      # per entry: its (first) row in its rank's outputs (what src_T refers to)
    # speculative decoding (tbjax/engine/speculative.py), per sampling slot: the drafted token a verify row checks
    # and the row of the draft-distribution buffer holding its q (target), or where to store q (draft); -1 = none
    draft_tok_S: np.ndarray = None
    q_row_S: np.ndarray = None
    n_rows: list = dataclasses.field(default_factory=list)   # per entry: how many output rows it has
    decode_only: bool = False             # one token per entry, in a bucket that has a decode program

    @property
    def program(self) -> tuple[int, bool]:
        """The step program that runs these inputs: (token bucket, decode program)."""
        return self.num_tokens, self.decode_only

    @property
    def num_tokens(self) -> int:
        """The token bucket T of this step (per rank)."""
        return self.tokens_T.shape[1]

    def pack(self) -> tuple[np.ndarray, np.ndarray, tuple]:
        """All int32 fields in one array [R, n], all float32 fields in another [R, m], and the (static) layout to
        unpack them: two host->device transfers per step instead of thirteen."""
        ints = [self.tokens_T, self.positions_T, self.slots_T, self.block_tables_SP, self.kv_lens_S,
                self.cu_q_lens_S1, self.sample_rows_S, self.top_k_S, self.seed_S.view(np.int32), self.sample_pos_S,
                self.src_T, self.draft_tok_S, self.q_row_S]
        floats = [self.temperature_S, self.top_p_S, self.min_p_S]
        layout = tuple(a.shape[1:] for a in ints + floats)
        return _concat_aligned(ints, np.int32), _concat_aligned(floats, np.float32), layout


_INT_FIELDS = ("tokens_T", "positions_T", "slots_T", "block_tables_SP", "kv_lens_S", "cu_q_lens_S1", "sample_rows_S",
               "top_k_S", "seed_S", "sample_pos_S", "src_T", "draft_tok_S", "q_row_S")
_F32_FIELDS = ("temperature_S", "top_p_S", "min_p_S")


# Each field starts at a multiple of 64 elements (256 bytes): XLA hands a slice of the packed argument to a custom
# call in place, and the Mosaic GPU kernels refuse operands that are not 256-byte aligned (H200: "Input buffer 2 is
# not 256-byte aligned" with unpadded packing).
_ALIGN = 64


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _concat_aligned(arrays, dtype) -> np.ndarray:
    R = arrays[0].shape[0]
    out = np.zeros((R, sum(_padded(int(np.prod(a.shape[1:]))) for a in arrays)), dtype)
    o = 0
    for a in arrays:
        n = int(np.prod(a.shape[1:]))
        out[:, o:o + n] = np.asarray(a).reshape(R, n)
        o += _padded(n)
    return out


def _unpack(ints, floats, layout) -> dict:
    out, shapes = {}, iter(layout)
    for arr, names in ((ints, _INT_FIELDS), (floats, _F32_FIELDS)):
        o = 0
        for name in names:
            shp = next(shapes)
            n = int(np.prod(shp))
            out[name] = arr[o:o + n].reshape(shp)
            o += _padded(n)
    out["seed_S"] = jax.lax.bitcast_convert_type(out["seed_S"], jnp.uint32)
    return out


@dataclasses.dataclass(frozen=True)
class _StepStatic:
    """Everything static about a step program except its bucket."""
    spec: ModelSpec
    plan: mf.MeshPlan
    attn_impl: str
    kernel_impl: str | None               # decode matmul kernel for this bucket, or None (XLA dots)
    spec_role: str | None = None          # speculative decoding: "target" (verifies drafts), "draft", or None
    branchless: bool = False              # no runtime branch in the sampler (GPU: a conditional blocks dispatch)
    rows_as_decodes: bool = False         # every row's attention as a one-query decode (deterministic mode)
    decode_only: bool = False             # every sequence has one query row (a decode program: one attention kernel)
    post_sample: bool = False             # the step takes the argmax; sampled rows are drawn by `_post_sample`


def _body(params, caches, ints, floats, prev_M, qbuf_QV=None, *, layout, st: _StepStatic):
    """One rank's step (inside the shard_map): ints / floats [1, n], prev_M [M] this rank's previous tokens;
    qbuf_QV: this rank's draft-distribution buffer (speculative roles only)."""
    spec = st.spec
    inp = _unpack(ints[0], floats[0], layout)
    src_T = inp["src_T"]
    inp["tokens_T"] = jnp.where(src_T >= 0, jnp.take(prev_M, jnp.maximum(src_T, 0)), inp["tokens_T"])
    scale = rope_attention_scale(spec)
    # The attention kernels' index operands as buffers of their own, not views into the packed input: a custom
    # call whose operand is a (dynamic) slice becomes a dynamic-slice fusion on XLA:GPU, a thunk outside the CUDA
    # graph (command buffer), i.e. two graph breaks per layer.
    bt, kv_lens, cu, inp["slots_T"] = jax.lax.optimization_barrier(
        (inp["block_tables_SP"], inp["kv_lens_S"], inp["cu_q_lens_S1"], inp["slots_T"]))

    def attend(layer, q, k, v, cache):
        pages, scales = cache
        if spec.mla is not None:       # latent (absorbed) MLA: k == v == the latent, stored once (mla_paged.py)
            pages, scales = write_latent(pages, scales, k[:, 0, :], inp["slots_T"])
            o = ragged_attention_blocked(q, pages, bt, kv_lens, cu, scale=scale, kv_scales_PK=scales,
                                         kv_layout=("latent", latent_dims(spec)))
            return o, (pages, scales)
        pages, scales = write_kv(pages, scales, k, v, inp["slots_T"])
        o = step_attention(q, pages, bt, kv_lens, cu, scale=scale, sliding_window=spec.layer_window(layer),
                           kv_scales_PK=scales, impl=st.attn_impl,
                           rows_as_decodes_max_t=q.shape[0] if st.rows_as_decodes or st.decode_only else None)
        return o, (pages, scales)
    attend.mla_latent = spec.mla is not None     # MLA layers hand over their latent form (one kv head, k == v)

    ctx = mf.loop_context(st.plan)
    h_TD, caches = forward_hidden(params, spec, inp["tokens_T"], inp["positions_T"], attend, caches,
                                  kernel_impl=st.kernel_impl, ctx=ctx)
    logits_SV = lm_logits(params, spec, jnp.take(h_TD, inp["sample_rows_S"], axis=0), kernel_impl=st.kernel_impl)
    smp = (inp["temperature_S"], inp["top_k_S"], inp["top_p_S"], inp["min_p_S"])
    extra = {}
    if st.post_sample:
        # greedy here; a step with a sampled row runs the sampling program after this one (`ModelRunner.launch`),
        # so greedy steps never pay for the filters (H100: 0.62 ms at [32, 128k], 8.4 ms at [256, 128k])
        tok_S = jnp.argmax(logits_SV, axis=-1).astype(jnp.int32)
        extra["smp_f"] = jnp.concatenate([inp["temperature_S"], inp["top_p_S"], inp["min_p_S"]])
        extra["smp_i"] = jnp.concatenate([inp["top_k_S"], jax.lax.bitcast_convert_type(inp["seed_S"], jnp.int32),
                                          inp["sample_pos_S"]])
    else:
        tok_S, _ = sample(logits_SV, *smp, inp["seed_S"], inp["sample_pos_S"], branchless=st.branchless)
    if st.spec_role == "target":       # verify rows: rejection sampling against the draft's q (sampling.py)
        q_row = inp["q_row_S"]
        verify = q_row >= 0

        def verified():
            q_SV = jnp.take(qbuf_QV, jnp.maximum(q_row, 0), axis=0)
            return verify_draft(logits_SV, q_SV, jnp.maximum(inp["draft_tok_S"], 0), *smp, inp["seed_S"],
                                inp["sample_pos_S"])
        v_tok, v_acc = jax.lax.cond(jnp.any(verify), verified,
                                    lambda: (tok_S, jnp.zeros(tok_S.shape, bool)))
        tok_S = jnp.where(verify, v_tok, tok_S)
        extra["accepted"] = (verify & v_acc).astype(jnp.int32)
    elif st.spec_role == "draft":      # keep the distribution each proposal was drawn from, for the target's check
        dst = inp["q_row_S"]
        Q = qbuf_QV.shape[0]

        def stored():
            q_SV = sampling_probs(logits_SV, *smp)
            return qbuf_QV.at[jnp.where(dst >= 0, dst, Q)].set(q_SV, mode="drop")
        needed = jnp.any((dst >= 0) & (inp["temperature_S"] > 0))
        extra["qbuf"] = jax.lax.cond(needed, stored, lambda: qbuf_QV)
    out = {"tokens": tok_S,
           # (a slice update, not .at[:S].set: with S == M that is a scatter with an empty index constant, which
           # crashes Shardy's unused-input canonicalization of the shard_map on XLA:CPU, jax 0.11.2)
           "tokens_M": jax.lax.dynamic_update_slice(jnp.zeros_like(prev_M), tok_S, (0,)),
           # the logprobs are not computed here: a top-k over [S, V] on every step cost 0.3-1 ms on the H200
           # (benchmarks/RESULTS.md, 2026-12-02); `ModelRunner.top_logprobs` runs it on the steps that need it
           "logits": logits_SV.astype(jnp.float32), **extra}
    return out, caches


def _post_sample(logits_UV, tokens_U, tokens_M, smp_f, smp_i, *, branchless: bool):
    """One rank's sampled rows of a step whose program took the argmax (`_StepStatic.post_sample`): the same
    `sample` the step would have run, from the step's logits and sampling parameters; greedy rows keep their token.
    Returns the tokens and the padded tokens_M that overlapped scheduling reads."""
    U = tokens_U.shape[0]
    temperature, top_p, min_p = smp_f[:U], smp_f[U:2 * U], smp_f[2 * U:]
    top_k_U, seed, pos = smp_i[:U], jax.lax.bitcast_convert_type(smp_i[U:2 * U], jnp.uint32), smp_i[2 * U:]
    tok, _ = sample(logits_UV, temperature, top_k_U, top_p, min_p, seed, pos, branchless=branchless)
    return tok, jax.lax.dynamic_update_slice(tokens_M, tok, (0,))


def _top_logprobs(logits_UV, tokens_U):
    """The chosen token's log-probability and the top TOP_LOGPROBS (values, ids) of each sampling row, of the
    unmodified distribution."""
    logprobs_UV = jax.nn.log_softmax(logits_UV, axis=-1)
    top_lp, top_ids = top_k(logprobs_UV, TOP_LOGPROBS)
    return {"token_logprob": jnp.take_along_axis(logprobs_UV, tokens_U[:, None], axis=-1)[:, 0],
            "top_logprobs": top_lp, "top_ids": top_ids.astype(jnp.int32)}


def resolve_mesh(mesh, devices=None):
    """A `jax.sharding.Mesh` with the axes dp, ep, tp, pp from None (1x1 on the default device), an 'axis=size'
    string ("dp=4,ep=2"), a dict, or a Mesh. Refused with MeshMismatch naming the axis and numbers."""
    from sharding.mesh import AXES, make_mesh, parse_mesh_arg
    if isinstance(mesh, jax.sharding.Mesh):
        missing = [a for a in AXES if a not in mesh.shape]
        if missing:
            raise MeshMismatch(f"mesh axes {tuple(mesh.shape)} lack {missing}: use sharding.mesh.make_mesh (axes "
                               f"{', '.join(AXES)}, size-1 axes included)")
        return mesh
    if devices is None:
        dflt = jax.config.jax_default_device
        devices = [dflt] if (mesh is None and dflt is not None) else jax.devices()
    sizes = {} if mesh is None else (parse_mesh_arg(mesh) if isinstance(mesh, str) else dict(mesh))
    m = make_mesh(**sizes, devices=devices)
    # Auto axes: the step is a shard_map either way, and host-side helpers (KV export / import, cache fills) index
    # the sharded pools with plain jnp ops, which explicit-sharding types would refuse.
    return jax.sharding.Mesh(m.devices, m.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(m.axis_names))


class ModelRunner:
    """Owns the parameters (placed on the mesh) and the KV pools of every dp rank, and runs scheduled steps."""

    def __init__(self, spec: ModelSpec, params, *, mesh=None, layout: DecodeLayout | None = None, page_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_pages_per_seq: int, attn_impl: str = "auto",
                 matmul_impl: str = "auto", layer_buffers: str = "stacked", fold_norms: bool = False,
                 fp8_scales=None, spec_role: str | None = None, spec_tokens: int = 0, shared_params=None,
                 command_buffers: str = "auto", deterministic: bool = False, post_sample: bool | None = None,
                 decode_programs: bool | None = None):
        """spec_role (speculative decoding, tbjax/engine/speculative.py): "target" gives every step
        max_num_seqs * (spec_tokens + 1) sampling slots (a verify entry samples each of its rows) and verifies drafts
        against the draft-distribution buffer; "draft" stores each sampled row's distribution there.
        shared_params: the placed parameters of another runner on the same mesh (the "self" draft runs the target's
        weights): nothing is placed or copied.
        deterministic: one token bucket (the budget) instead of the list, and every row's attention as a one-query
        decode: a row's result then depends only on its own sequence, not on what shares the step, the step's size
        or how its prompt was chunked (docs/step.md, "Batch invariance").
        post_sample: the step program takes the argmax and a small program per sampling-slot count draws the
        sampled rows, run only on steps that have one (None: on where the sampler is branchless, i.e. on GPU; the
        speculative roles sample inside the step).
        decode_programs: buckets above ROWS_AS_DECODES_MAX_T, up to the one holding max_num_seqs, get a second program
        for steps whose sequences all have one token (decode-only steps): one attention kernel per layer instead of
        the decode and the ragged kernel plus a select (None: on where the attention runs kernels; off for MLA,
        speculative roles and deterministic mode, whose steps already run every row as a decode)."""
        if spec_role not in (None, "target", "draft"):
            raise ValueError(f"spec_role must be None, 'target' or 'draft', got {spec_role!r}")
        if post_sample is not None and not isinstance(post_sample, bool):
            raise ValueError(f"post_sample must be None (auto), True or False, got {post_sample!r}")
        self.spec_role, self.spec_tokens = spec_role, int(spec_tokens)
        self.mesh = resolve_mesh(mesh)
        self.layout = layout or DecodeLayout()
        self.plan = mf.make_plan(spec, self.mesh, self.layout, fp8_scales=fp8_scales)
        self.num_ranks = axes_size(dict(self.mesh.shape), self.layout.batch_axes)
        if shared_params is not None:
            fold_norms, layer_buffers = False, "split" if any(
                isinstance(v, list) for g in shared_params["groups"].values() for v in g.values()) else "stacked"
        if fold_norms:       # RMSNorm weights folded into the next projection (tbjax/model/kinds.py): 2 fewer kernels
            if self.plan.packed:
                raise MeshMismatch("fold_norms with DP-sharded attention weights is not supported: the packed "
                                   "attention layout holds the norm weights (use attn_axes=() or fold_norms=False)")
            params = fold_layer_norms(spec, params)
        if layer_buffers not in LAYER_BUFFERS:
            raise ValueError(f"layer_buffers must be one of {LAYER_BUFFERS}, got {layer_buffers!r}")
        if command_buffers not in COMMAND_BUFFERS:
            raise ValueError(f"command_buffers must be one of {COMMAND_BUFFERS}, got {command_buffers!r}")
        self.command_buffers = command_buffers
        if matmul_impl not in MATMUL_IMPLS:
            raise ValueError(f"matmul_impl must be one of {MATMUL_IMPLS}, got {matmul_impl!r}")
        if layer_buffers == "auto":
            layer_buffers = "split" if jax.default_backend() == "gpu" else "stacked"
        if layer_buffers == "split" and shared_params is None:
            params = split_layer_buffers(params)
        self.layer_buffers = layer_buffers
        self.spec = spec
        self.params = shared_params if shared_params is not None else \
            mf.mesh_params(params, self.plan, self.mesh, fp8_scales)
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.max_pages = max_pages_per_seq
        self.attn_impl = attn_impl
        self.matmul_impl = matmul_impl
        # XLA:CPU's bf16 single-row dot against a transposed matrix (the tied lm_head) is ~14x slower than two
        # rows (measured: 174 ms vs 12 ms for SmolLM2), so CPU buckets hold at least two tokens and sequences.
        self.min_seqs = 2 if jax.default_backend() == "cpu" else 1
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic must be True or False, got {deterministic!r}")
        self.deterministic = deterministic
        budget = max(max_num_batched_tokens, self.min_seqs)
        self.buckets = (budget,) if deterministic else token_buckets(budget, self.min_seqs, max_num_seqs)
        self.max_seqs = max(self.max_num_seqs, self.min_seqs)     # the largest sequence bucket
        if decode_programs is not None and not isinstance(decode_programs, bool):
            raise ValueError(f"decode_programs must be None (auto), True or False, got {decode_programs!r}")
        if decode_programs is None:
            decode_programs = resolve_impl(attn_impl) not in ("reference", "blocked")
        decode_programs = decode_programs and spec.mla is None and spec_role is None and not deterministic
        # buckets whose decode-only steps run a program of their own (`StepInputs.decode_only`): above
        # ROWS_AS_DECODES_MAX_T (below it every step runs one attention kernel) up to the one that holds max_num_seqs
        cap = self._bucket_for(min(self.max_seqs, self.buckets[-1]))
        self.decode_buckets = tuple(b for b in self.buckets if ROWS_AS_DECODES_MAX_T < b <= cap) \
            if decode_programs else ()
        # every step program: (token bucket, decode program)
        self.programs = tuple((b, False) for b in self.buckets) + tuple((b, True) for b in self.decode_buckets)
        self.max_samples = self.samples_for(self.buckets[-1])       # M: sampling slots of the largest bucket
        self.q_rows = self.max_num_seqs * self.spec_tokens         # draft-distribution rows per rank (speculative)
        self._bax = tuple(self.layout.batch_axes) or None
        self._rank_sharding = NamedSharding(self.mesh, P(self._bax))
        self._no_prev = jax.device_put(np.zeros(self.num_ranks * self.max_samples, np.int32), self._rank_sharding)
        self._wait_before_launch = jax.default_backend() == "cpu"
        self.caches = None
        self._fns: dict = {}               # (bucket, decode program) -> jitted step
        self._compiled: dict = {}          # (bucket, decode program) -> executable compiled ahead of use
        self._top_lp = jax.jit(_top_logprobs)
        on_gpu = self.mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm")
        self.post_sample = (on_gpu if post_sample is None else bool(post_sample)) and spec_role is None
        self._post = jax.jit(jax.shard_map(functools.partial(_post_sample, branchless=on_gpu), mesh=self.mesh,
                                           in_specs=(P(self._bax),) * 5, out_specs=(P(self._bax),) * 2,
                                           check_vma=False))
        self._post_compiled: dict = {}     # sampling slots U -> compiled sampling program (post_sample)
        self._top_lp_compiled: dict = {}   # sampling slots U -> compiled top-logprobs program (precompile)
        self.ready = False                 # set after precompile(): a later compile is logged as a warning
        # host seconds of launch() summed over steps: put (inputs to the device), exe (dispatch of the step
        # program), post (dispatch of the sampling program)
        self.launch_seconds = dict.fromkeys(("put", "exe", "post"), 0.0)
        self.last_precompile = {"loaded": 0, "compiled": 0}   # programs of the last precompile() by origin

    # ---- KV pools -------------------------------------------------------------------------------------------
    def init_caches(self, kv: KVCacheConfig) -> None:
        """Zero-filled pools for every dp rank: per layer pages [R * num_pages, G, 2K, H] (and fp8 scales
        [R * num_pages, 2K]), split over the batch axes: each rank's pages are its own."""
        K, H = cache_heads(self.spec)
        R = self.num_ranks
        sh = self._rank_sharding
        pshape = (R * kv.num_pages, kv.page_size, 2 * K, H)
        make_pages = jax.jit(lambda: jnp.zeros(pshape, kv.jnp_dtype), out_shardings=sh)
        make_scales = jax.jit(lambda: jnp.zeros((R * kv.num_pages, 2 * K), jnp.float32), out_shardings=sh)
        self.caches = [(make_pages(), make_scales() if kv.is_fp8 else None) for _ in range(self.spec.n_layers)]
        self.pages_per_rank = kv.num_pages

    def param_bytes_per_device(self) -> int:
        dev = self.mesh.devices.flat[0]
        return sum(s.data.nbytes for a in jax.tree.leaves(self.params) for s in a.addressable_shards
                   if s.device == dev)

    # ---- programs -------------------------------------------------------------------------------------------
    def _bucket_for(self, n_tokens: int) -> int:
        for b in self.buckets:
            if n_tokens <= b:
                return b
        raise ValueError(f"{n_tokens} tokens on one rank exceed the step budget {self.buckets[-1]}")

    def seqs_for(self, bucket: int) -> int:
        return max(min(bucket, self.max_num_seqs), self.min_seqs)

    def samples_for(self, bucket: int) -> int:
        """Sampling slots of a step: one per sequence slot, or with a speculative target one per row of every
        verify entry (1 + spec_tokens rows per decode)."""
        if self.spec_role != "target":
            return self.seqs_for(bucket)
        return max(min(bucket, self.max_num_seqs * (self.spec_tokens + 1)), self.min_seqs)

    def new_qbuf(self):
        """A zeroed draft-distribution buffer [R * q_rows, V] float32 (split over the ranks): the draft's steps write
        it, the target's verify step reads it."""
        R, Q, V = self.num_ranks, max(self.q_rows, 1), self.spec.vocab_size
        return jax.jit(lambda: jnp.zeros((R * Q, V), jnp.float32), out_shardings=self._rank_sharding)()

    def _kernel_impl(self, bucket: int) -> str | None:
        if self.matmul_impl == "kernel":
            return "gpu"
        if self.matmul_impl == "auto" and jax.default_backend() == "gpu" and bucket <= AUTO_KERNEL_MAX_T:
            return "gpu"
        return None

    def _fn(self, pid: tuple[int, bool]):
        """The jitted step program `pid` = (token bucket, decode program)."""
        fn = self._fns.get(pid)
        if fn is not None:
            return fn
        st = self._static(pid)
        layout = self._layout(pid[0])
        pspecs = sr.match_rules(self.params, mf.mesh_rules(self.plan))
        cspec = jax.tree.map(lambda _: P(self._bax), self.caches)
        rank = P(self._bax)
        names = ["tokens", "tokens_M", "logits"] + (["smp_f", "smp_i"] if st.post_sample else [])
        names += {"target": ["accepted"], "draft": ["qbuf"]}.get(self.spec_role, [])
        outs = {k: rank for k in names}
        donate = (1, 5) if self.spec_role == "draft" else (1,)
        if self.spec_role is None:
            def body(params, caches, ints, floats, prev_M):
                return _body(params, caches, ints, floats, prev_M, layout=layout, st=st)
            in_specs = (pspecs, cspec, rank, rank, rank)
        else:
            def body(params, caches, ints, floats, prev_M, qbuf_QV):
                return _body(params, caches, ints, floats, prev_M, qbuf_QV, layout=layout, st=st)
            in_specs = (pspecs, cspec, rank, rank, rank, rank)
        smap = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=(outs, cspec), check_vma=False)
        fn = jax.jit(smap, donate_argnums=donate, compiler_options=self._xla_options() or None)
        self._fns[pid] = fn
        return fn

    def _xla_options(self) -> dict:
        """The step programs' compiler options: the mesh layout's (mf.xla_options) and, on GPU, command buffers off
        when EngineConfig.command_buffers says so."""
        opts = dict(mf.xla_options(self.layout))
        if self.mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm"):
            on = GPU_COMMAND_BUFFERS if self.command_buffers == "auto" else self.command_buffers == "on"
            if not on:
                opts["xla_gpu_enable_command_buffer"] = ""
        return opts

    def _static(self, pid: tuple[int, bool]) -> _StepStatic:
        bucket, decode_only = pid
        return _StepStatic(self.spec, self.plan, self.attn_impl, self._kernel_impl(bucket), self.spec_role,
                           branchless=self.mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm"),
                           rows_as_decodes=self.deterministic, decode_only=decode_only,
                           post_sample=self.post_sample)

    def _layout(self, bucket: int) -> tuple:
        return self._empty_inputs(bucket).pack()[2]

    @property
    def num_programs(self) -> int:
        """Programs this runner holds ready to run: step, top-logprobs and sampling programs."""
        return len(self._compiled) + len(self._top_lp_compiled) + len(self._post_compiled)

    @property
    def num_compiled(self) -> int:
        return sum(f._cache_size() for f in self._fns.values()) + len(self._compiled)

    # ---- inputs ---------------------------------------------------------------------------------------------
    def _empty_inputs(self, T: int) -> StepInputs:
        R, S, Pm = self.num_ranks, self.seqs_for(T), self.max_pages
        U = self.samples_for(T)
        z = lambda *shape: np.zeros((R, *shape), np.int32)   # noqa: E731
        return StepInputs(z(T), z(T), np.full((R, T), -1, np.int32), z(S, Pm), z(S), z(S + 1), z(U),
                          np.zeros((R, U), np.float32), z(U), np.ones((R, U), np.float32),
                          np.zeros((R, U), np.float32), np.zeros((R, U), np.uint32), z(U),
                          np.full((R, T), -1, np.int32), [], [], np.full((R, U), -1, np.int32),
                          np.full((R, U), -1, np.int32))

    def build_inputs(self, entries, sampling, prev_rows=None, *, sample_pos=None, verify=None,
                     q_dst=None) -> StepInputs:
        """entries: list of (token_ids, start, block_table) or (rank, token_ids, start, block_table); sampling: list
        of (temp, top_k, top_p, min_p, seed). prev_rows (overlapped scheduling): per entry, -1, or the entry's row in
        its rank's previous step outputs (`local_rows` of that step) whose token is this entry's one token (its
        token_ids value is then ignored).

        Speculative decoding: ``sample_pos`` per entry None or the position whose token it samples (the PRNG's
        position; default start + len(token_ids)); ``verify`` (target) per entry None or the draft-buffer rows of
        its drafted tokens token_ids[1:]: every row of such an entry samples (row i checks token_ids[i + 1], the
        last row samples freely), ``n_rows`` says how many; ``q_dst`` (draft) per entry -1 or the draft-buffer row
        that stores the distribution its token is drawn from."""
        G = self.page_size
        norm = [e if len(e) == 4 else (0, *e) for e in entries]
        R, n = self.num_ranks, len(norm)
        ranks = [e[0] for e in norm]
        for r in ranks:
            if not 0 <= r < R:
                raise ValueError(f"entry on dp rank {r}, the mesh has {R}")
        ks = [len(e[1]) for e in norm]
        per_rank_tokens = [0] * R
        for r, k in zip(ranks, ks):
            per_rank_tokens[r] += k
        T = self._bucket_for(max(max(per_rank_tokens), 1))
        inp = self._empty_inputs(T)
        S = inp.kv_lens_S.shape[1]
        U = inp.sample_rows_S.shape[1]
        if n == 0:
            return inp
        # each entry's sequence slot s, first token t and first sampling row u within its rank (plain ints)
        nrs = [1 if verify is None or verify[i] is None else ks[i] for i in range(n)]
        t_of, s_of, u_of = [0] * R, [0] * R, [0] * R
        ss, ts, us = [0] * n, [0] * n, [0] * n
        for i in range(n):
            r = ranks[i]
            s, t, u = s_of[r], t_of[r], u_of[r]
            if s >= S:
                raise ValueError(f"dp rank {r}: more than {S} sequences in a step of {T} tokens")
            if len(norm[i][3]) > self.max_pages:
                raise ValueError(f"block table of {len(norm[i][3])} pages is wider than "
                                 f"max_pages_per_seq={self.max_pages}")
            if verify is not None and verify[i] is not None and len(verify[i]) != ks[i] - 1:
                raise ValueError(f"entry {i}: {len(verify[i])} draft rows for {ks[i] - 1} drafted tokens")
            if u + nrs[i] > U:
                raise ValueError(f"dp rank {r}: more than {U} sampling rows in a step of {T} tokens")
            if prev_rows is not None and prev_rows[i] >= 0 and ks[i] != 1:
                raise ValueError(f"entry {i} takes its token from the previous step but has {ks[i]} tokens")
            ss[i], ts[i], us[i] = s, t, u
            s_of[r], t_of[r], u_of[r] = s + 1, t + ks[i], u + nrs[i]
        # the same, vectorized over every token / block-table cell / sampling row of the step
        rk = np.asarray(ranks, np.int64)
        k_a, s_a, t_a, u_a = (np.asarray(x, np.int64) for x in (ks, ss, ts, us))
        start = np.fromiter((e[2] for e in norm), np.int64, n)
        within = np.arange(int(k_a.sum()), dtype=np.int64) - np.repeat(np.cumsum(k_a) - k_a, k_a)
        tok_r, tok_t = np.repeat(rk, k_a), np.repeat(t_a, k_a) + within
        pos = np.repeat(start, k_a) + within
        inp.tokens_T[tok_r, tok_t] = np.fromiter(itertools.chain.from_iterable(e[1] for e in norm), np.int64,
                                                 len(pos))
        inp.positions_T[tok_r, tok_t] = pos
        bt_len = np.fromiter((len(e[3]) for e in norm), np.int64, n)
        bt_flat = np.fromiter(itertools.chain.from_iterable(e[3] for e in norm), np.int64, int(bt_len.sum()))
        bt_off = np.cumsum(bt_len) - bt_len
        page = pos // G
        short = page >= np.repeat(bt_len, k_a)
        if short.any():
            i = int(np.repeat(np.arange(n), k_a)[np.argmax(short)])
            raise ValueError(f"entry {i}: position {int(pos[np.argmax(short)])} lies past its block table of "
                             f"{int(bt_len[i])} pages of {G} tokens")
        inp.slots_T[tok_r, tok_t] = bt_flat[np.repeat(bt_off, k_a) + page] * G + pos % G
        cell = np.arange(len(bt_flat), dtype=np.int64) - np.repeat(bt_off, bt_len)
        inp.block_tables_SP[np.repeat(rk, bt_len), np.repeat(s_a, bt_len), cell] = bt_flat
        inp.kv_lens_S[rk, s_a] = start + k_a
        inp.cu_q_lens_S1[rk, s_a + 1] = t_a + k_a
        nr_a = np.asarray(nrs, np.int64)
        row_in = np.arange(int(nr_a.sum()), dtype=np.int64) - np.repeat(np.cumsum(nr_a) - nr_a, nr_a)
        row_r, row_u = np.repeat(rk, nr_a), np.repeat(u_a, nr_a) + row_in
        pos0 = start + k_a
        if sample_pos is not None:
            pos0 = np.asarray([p0 if sp is None else int(sp) for p0, sp in zip(pos0.tolist(), sample_pos)],
                              np.int64)
        inp.sample_rows_S[row_r, row_u] = np.repeat(t_a + k_a - nr_a, nr_a) + row_in
        inp.sample_pos_S[row_r, row_u] = np.repeat(pos0 - nr_a + 1, nr_a) + row_in
        for j, arr in enumerate((inp.temperature_S, inp.top_k_S, inp.top_p_S, inp.min_p_S, inp.seed_S)):
            arr[row_r, row_u] = np.repeat(np.asarray([smp[j] for smp in sampling], arr.dtype), nr_a)
        if verify is not None:
            for i, vq in enumerate(verify):
                if vq is not None:
                    r, u, nr = ranks[i], us[i], nrs[i]
                    inp.draft_tok_S[r, u:u + nr - 1] = norm[i][1][1:]
                    inp.q_row_S[r, u:u + nr - 1] = vq
        if q_dst is not None:
            inp.q_row_S[rk, u_a] = np.asarray(q_dst, np.int64)
        if prev_rows is not None:
            pr = np.asarray(prev_rows, np.int64)
            take = pr >= 0
            inp.src_T[rk[take], t_a[take]] = pr[take]
        inp.decode_only = T in self.decode_buckets and verify is None and max(ks) == 1
        inp.rows = (rk * U + u_a).tolist()
        inp.local_rows = list(us)
        inp.n_rows = nrs
        for r in range(R):              # padding sequences: empty (cu stays at the rank's token count)
            inp.cu_q_lens_S1[r, s_of[r] + 1:] = t_of[r]
        return inp

    # ---- running --------------------------------------------------------------------------------------------
    def _abstract_args(self, bucket: int):
        ints, floats, _ = self._empty_inputs(bucket).pack()
        sd = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._rank_sharding)  # noqa: E731
        args = (self.params, self.caches, sd(ints), sd(floats), self._no_prev)
        if self.spec_role is not None:
            shape = (self.num_ranks * max(self.q_rows, 1), self.spec.vocab_size)
            args += (jax.ShapeDtypeStruct(shape, jnp.float32, sharding=self._rank_sharding),)
        return args

    def precompile(self, buckets=None, workers: int = 8, progress: bool = False) -> float:
        """Compile the step for `buckets` (default: all) ahead of use, several XLA compiles at once; returns the wall
        seconds. Lowering (tracing) runs here one bucket at a time; the compiles run in a thread pool (they release
        the GIL). Afterwards `ready` is set."""
        from tqdm.auto import tqdm

        from tbjax.engine import program_cache
        t = time.perf_counter()
        saveable = self.mesh.devices.size == 1 and program_cache.cache_dir() is not None
        # the programs wanted: ("step", bucket) and ("lp", sampling slots), each under its key
        want = {}
        for b in (self.buckets if buckets is None else buckets):
            b = self._bucket_for(b)
            for pid in ((b, False), (b, True)) if b in self.decode_buckets else ((b, False),):
                if pid not in self._compiled:
                    want.setdefault(("step", pid), None)
            U = self.samples_for(b)
            if U not in self._top_lp_compiled:
                want.setdefault(("lp", U), None)
            if self.post_sample and U not in self._post_compiled:
                want.setdefault(("post", U), None)
        keyf = {"step": self._program_key, "lp": self._top_lp_key, "post": self._post_key}
        keys = {w: keyf[w[0]](w[1]) for w in want}
        found = {w: program_cache.shared_get(k) for w, k in keys.items()}    # compiled by another engine here
        missing = [w for w, exe in found.items() if exe is None]
        if saveable and missing:
            # a warm start loads whole executables (no trace, lowering, compile), several at once: deserializing
            # and loading onto the device release the GIL, and one after the other they were most of a warm start
            with cf.ThreadPoolExecutor(max(1, min(workers, len(missing)))) as pool:
                for w, exe in zip(missing, pool.map(lambda w: program_cache.load(keys[w]), missing)):
                    if exe is not None:
                        program_cache.shared_put(keys[w], exe)
                        found[w] = exe
        self.last_precompile = {"loaded": sum(exe is not None for exe in found.values()),
                                "compiled": sum(exe is None for exe in found.values())}
        tables = {"step": self._compiled, "lp": self._top_lp_compiled, "post": self._post_compiled}
        todo = {}
        for (kind, n), exe in found.items():
            if exe is not None:
                tables[kind][n] = exe
            else:
                todo[(kind, n)] = self._lowered(kind, n)
        n_steps = sum(kind == "step" for kind, _ in todo)
        bar = tqdm(total=n_steps, desc="compiling step programs", disable=not progress or not n_steps, unit="prog")
        with cf.ThreadPoolExecutor(max(1, min(workers, len(todo)))) as pool:
            futs = {pool.submit(lowered.compile): w for w, lowered in todo.items()}
            for f in cf.as_completed(futs):
                kind, n = w = futs[f]
                tables[kind][n] = exe = f.result()
                program_cache.shared_put(keys[w], exe)
                if saveable:
                    program_cache.save(keys[w], exe)
                if kind == "step":
                    bar.update(1)
        bar.close()
        if buckets is None:
            self.ready = True
        return time.perf_counter() - t

    def _lowered(self, kind: str, n: int):
        """The lowered program of `kind` ("step": program n = (bucket, decode); "lp" / "post": n sampling slots)."""
        if kind == "step":
            return self._fn(n).lower(*self._abstract_args(n[0]))
        if kind == "lp":
            return self._top_lp.lower(*self._top_lp_args(n))
        return self._post.lower(*self._post_args(n))

    def _program_key(self, pid: tuple[int, bool]) -> str:
        from tbjax.engine import program_cache
        dev = self.mesh.devices.flat[0]
        bucket = pid[0]
        # leaves by path (a tree.map would rebuild QuantizedWeight nodes around tuples)
        args = [(jax.tree_util.keystr(k), tuple(a.shape), str(a.dtype), str(getattr(a, "sharding", None)))
                for k, a in jax.tree_util.tree_flatten_with_path(self._abstract_args(bucket))[0]]
        st = self._static(pid)
        return program_cache.program_key("step", bucket, self._layout(bucket), st, dev.platform,
                                         getattr(dev, "device_kind", ""), dict(self.mesh.shape),
                                         [d.id for d in self.mesh.devices.flat],
                                         jax.tree.structure(self.params), args, self._xla_options())

    def launch(self, inp: StepInputs, packed=None, want_logprobs: bool = False, prev=None, qbuf=None) -> dict:
        """Start the step on device (no wait); `packed` = inp.pack()'s arrays; `prev` = the previous launch's outputs
        when `inp.src_T` takes tokens from them (overlapped scheduling). Returns the step's outputs as device arrays
        (`want_logprobs` is accepted for callers and ignored: `fetch` computes the top logprobs). The KV pools are
        updated in place. `qbuf`: the draft-distribution buffer (speculative roles; a draft step donates it and
        returns the new one as out["qbuf"])."""
        ints, floats, _ = inp.pack() if packed is None else packed
        prev_M = self._no_prev if prev is None else prev["tokens_M"]
        if self._wait_before_launch:
            # XLA:CPU: the previous step (whose output pools this one donates) is finished first. Three clean-clone
            # test runs with steps launched onto pending donated pools segfaulted later inside XLA:CPU; the host
            # work of overlapped scheduling still overlaps the previous step, only the launch waits.
            jax.block_until_ready((self.caches, prev_M))
        pid = inp.program
        t0 = time.perf_counter()
        ints = jax.device_put(ints, self._rank_sharding)
        floats = jax.device_put(floats, self._rank_sharding)
        t1 = time.perf_counter()
        args = (self.params, self.caches, ints, floats, prev_M)
        if self.spec_role is not None:
            if qbuf is None:
                raise ValueError(f"a speculative {self.spec_role} step needs the draft-distribution buffer (qbuf)")
            args += (qbuf,)
        exe = self._compiled.get(pid)
        if exe is None:
            exe = self._shared_or_compile(pid)
        out, self.caches = exe(*args)
        t2 = time.perf_counter()
        if self.post_sample and np.any(inp.temperature_S > 0):
            out = dict(out)
            out["tokens"], out["tokens_M"] = self._post_exe(inp.temperature_S.shape[1])(
                out["logits"], out["tokens"], out["tokens_M"], out["smp_f"], out["smp_i"])
        ls = self.launch_seconds
        ls["put"] += t1 - t0
        ls["exe"] += t2 - t1
        ls["post"] += time.perf_counter() - t2
        return out

    def _post_exe(self, U: int):
        exe = self._post_compiled.get(U)
        if exe is None:
            exe = self._shared_or(self._post_key(U), lambda: self._post.lower(*self._post_args(U)),
                                  f"sampling program for {U} sampling slots")
            self._post_compiled[U] = exe
        return exe

    def _post_args(self, U: int):
        sd = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=self._rank_sharding)  # noqa: E731
        R = self.num_ranks
        return (sd((R * U, self.spec.vocab_size), jnp.float32), sd((R * U,), jnp.int32),
                sd((R * self.max_samples,), jnp.int32), sd((R * 3 * U,), jnp.float32), sd((R * 3 * U,), jnp.int32))

    def _post_key(self, U: int) -> str:
        return self._small_key(("post_sample", U), self._post_args(U))

    def _shared_or_compile(self, pid: tuple[int, bool]):
        """Step program `pid`, from another engine of this process (same key) or compiled now."""
        b = pid[0]
        exe = self._shared_or(self._program_key(pid), lambda: self._fn(pid).lower(*self._abstract_args(b)),
                              "%sstep program for %d tokens per rank (x%d ranks, %d sequence slots, %d pages per "
                              "sequence)" % ("decode " if pid[1] else "", b, self.num_ranks, self.seqs_for(b),
                                             self.max_pages))
        self._compiled[pid] = exe
        return exe

    def _shared_or(self, key: str, lower, what: str):
        """This process's program under `key` (program_cache.shared_get), else `lower()` compiled now and shared;
        a compile after warm-up is logged as a warning naming `what`."""
        from tbjax.engine import program_cache
        exe = program_cache.shared_get(key)
        if exe is None:
            if self.ready:
                log.warning("%s compiles after warm-up", what)
            exe = lower().compile()
            program_cache.shared_put(key, exe)
        return exe

    def _top_lp_args(self, U: int):
        sd = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=self._rank_sharding)  # noqa: E731
        R = self.num_ranks
        return sd((R * U, self.spec.vocab_size), jnp.float32), sd((R * U,), jnp.int32)

    def _top_lp_key(self, U: int) -> str:
        return self._small_key(("top_logprobs", U, TOP_LOGPROBS), self._top_lp_args(U))

    def _small_key(self, what: tuple, args) -> str:
        """Program-cache key of a small per-sampling-slot program: `what`, the devices, the arguments."""
        from tbjax.engine import program_cache
        dev = self.mesh.devices.flat[0]
        return program_cache.program_key(*what, dev.platform, getattr(dev, "device_kind", ""), dict(self.mesh.shape),
                                         [d.id for d in self.mesh.devices.flat],
                                         [(a.shape, str(a.dtype), str(a.sharding)) for a in args])

    def top_logprobs(self, out: dict) -> dict:
        """The launched step's logprobs (device arrays, no wait): token_logprob [R * U], top_logprobs / top_ids
        [R * U, TOP_LOGPROBS]."""
        U = out["tokens"].shape[0] // self.num_ranks
        exe = self._top_lp_compiled.get(U)
        if exe is None:
            exe = self._shared_or(self._top_lp_key(U), lambda: self._top_lp.lower(*self._top_lp_args(U)),
                                  f"top-logprobs program for {U} sampling slots")
            self._top_lp_compiled[U] = exe
        return exe(out["logits"], out["tokens"])

    def fetch(self, out: dict, want_logprobs: bool = True) -> dict[str, np.ndarray]:
        """Wait for a launched step and bring what the host needs (not the padded device-side tokens); with
        `want_logprobs` also the chosen token's and the top logprobs."""
        got = {"tokens": out["tokens"]}
        if "accepted" in out:
            got["accepted"] = out["accepted"]
        if want_logprobs:
            got.update(self.top_logprobs(out))
        return jax.device_get(got)

    def run(self, inp: StepInputs, want_logprobs: bool = False) -> dict[str, np.ndarray]:
        """Launch and fetch; outputs in entry order (row i = the i-th entry of `build_inputs`)."""
        out = self.fetch(self.launch(inp), want_logprobs)
        rows = np.asarray(inp.rows, np.int64)
        return {k: v[rows] for k, v in out.items()}
