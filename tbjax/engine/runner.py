"""Jitted model steps over the paged KV cache, with a small fixed set of shape buckets.

One compiled program per (kind, tokens, sequences, pages-per-sequence) bucket:
  decode  every sequence contributes one token (T == S): the decode attention fast path;
  mixed   decodes + prefill chunks, ragged over `cu_q_lens`.
Buckets are powers of two, so steady state never recompiles. Only the rows that sample are projected to
logits, and sampling runs inside the same program: one small int32 array comes back per step.
The KV pools are donated and updated in place. Decode steps send the projections to the weight-streaming matmul
kernel on GPU when that is faster (batches of <= 4: `matmul_impl`, tbjax/model/linear.py); others use XLA dots.
A step's host inputs travel as two packed arrays (int32 and float32, fields 256-byte aligned) and are unpacked in
the program: per-array transfers cost more than the arrays (H200: host round trip 1.43 -> 0.54 ms at batch 32).
Overlapped scheduling launches step N+1 before step N's tokens reach the host: a token the host does not know yet
is taken, inside the program, from step N's sampled tokens (``src_T`` names the row; every step returns its tokens
padded to one fixed length, ``tokens_M``, so this adds no shape buckets).
`precompile` compiles chosen buckets ahead of use, several XLA compiles at once. MLA layers keep their latent once
per token (tbjax/engine/mla_paged.py).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import paged_attention, paged_decode_attention, write_kv
from tbjax.engine.mla_paged import latent_decode_attention, latent_mixed_attention, write_latent
from tbjax.model.kinds import fold_norms as fold_layer_norms
from tbjax.model.linear import kernel_impl_for
from tbjax.model.params import split_layer_buffers
from tbjax.model.transformer import forward_hidden, lm_logits
from tbjax.sampling import sample
from tbjax.spec import ModelSpec, rope_attention_scale

TOP_LOGPROBS = 20
# How a layer group's weights are held: "stacked" [L, ...] arrays (sliced per layer inside the program) or "split"
# into per-layer buffers (tbjax/model/params.py split_layer_buffers: identical per-layer fusions, compiled once);
# "auto" = split on GPU.
LAYER_BUFFERS = ("auto", "stacked", "split")


def bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= max(n, lo), capped at hi (hi itself is allowed to be a non-power)."""
    b = lo
    while b < n:
        b *= 2
    return min(b, hi) if n <= hi else n


@dataclasses.dataclass
class StepInputs:
    """Host-built arrays for one step (already padded to the bucket)."""
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
    decode_only: bool
    src_T: np.ndarray | None = None       # per token: row of the previous step's sampled tokens to feed, or -1

    def __post_init__(self):
        if self.src_T is None:
            self.src_T = np.full(self.tokens_T.shape, -1, np.int32)

    def pack(self) -> tuple[np.ndarray, np.ndarray, tuple]:
        """All int32 fields in one array, all float32 fields in another, and the (static) layout to unpack them:
        two host->device transfers per step instead of thirteen."""
        ints = [self.tokens_T, self.positions_T, self.slots_T, self.block_tables_SP, self.kv_lens_S,
                self.cu_q_lens_S1, self.sample_rows_S, self.top_k_S, self.seed_S.view(np.int32), self.sample_pos_S,
                self.src_T]
        floats = [self.temperature_S, self.top_p_S, self.min_p_S]
        layout = tuple(a.shape for a in ints + floats)
        return _concat_aligned(ints, np.int32), _concat_aligned(floats, np.float32), layout


_INT_FIELDS = ("tokens_T", "positions_T", "slots_T", "block_tables_SP", "kv_lens_S", "cu_q_lens_S1", "sample_rows_S",
               "top_k_S", "seed_S", "sample_pos_S", "src_T")
_F32_FIELDS = ("temperature_S", "top_p_S", "min_p_S")


# Each field starts at a multiple of 64 elements (256 bytes): XLA hands a slice of the packed argument to a custom
# call in place, and the Mosaic GPU kernels refuse operands that are not 256-byte aligned (H200: "Input buffer 2 is
# not 256-byte aligned" with unpadded packing).
_ALIGN = 64


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _concat_aligned(arrays, dtype) -> np.ndarray:
    out = np.zeros(sum(_padded(a.size) for a in arrays), dtype)
    o = 0
    for a in arrays:
        out[o:o + a.size] = np.asarray(a).ravel()
        o += _padded(a.size)
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


def _step(params, caches, ints, floats, prev_tokens_M=None, *, layout, spec: ModelSpec, decode_only: bool,
          want_logprobs: bool, attn_impl: str, matmul_impl: str = "auto"):
    inp = _unpack(ints, floats, layout)
    if prev_tokens_M is not None:   # tokens sampled by the previous step (overlapped scheduling) come from the device
        src_T = inp["src_T"]
        inp["tokens_T"] = jnp.where(src_T >= 0, jnp.take(prev_tokens_M, jnp.maximum(src_T, 0)), inp["tokens_T"])
    scale = rope_attention_scale(spec)
    mm = kernel_impl_for(matmul_impl, decode_only, inp["tokens_T"].shape[0])

    def attend(layer, q, k, v, cache):
        pages, scales = cache
        if spec.mla is not None:       # latent (absorbed) MLA: k == v == the latent, stored once (mla_paged.py)
            pages, scales = write_latent(pages, scales, k[:, 0, :], inp["slots_T"])
            if decode_only:
                o = latent_decode_attention(q, pages, inp["block_tables_SP"], inp["kv_lens_S"], scale=scale,
                                            kv_scales_PK=scales)
            else:
                o = latent_mixed_attention(q, pages, inp["block_tables_SP"], inp["kv_lens_S"], inp["cu_q_lens_S1"],
                                           scale=scale, kv_scales_PK=scales)
            return o, (pages, scales)
        pages, scales = write_kv(pages, scales, k, v, inp["slots_T"])
        window = spec.layer_window(layer)
        if decode_only:
            o = paged_decode_attention(q, pages, inp["block_tables_SP"], inp["kv_lens_S"], scale=scale,
                                       sliding_window=window, kv_scales_PK=scales, impl=attn_impl)
        else:
            o = paged_attention(q, pages, inp["block_tables_SP"], inp["kv_lens_S"], inp["cu_q_lens_S1"], scale=scale,
                                sliding_window=window, kv_scales_PK=scales, impl=attn_impl)
        return o, (pages, scales)
    attend.mla_latent = spec.mla is not None     # MLA layers hand over their latent form (one kv head, k == v)

    h_TD, caches = forward_hidden(params, spec, inp["tokens_T"], inp["positions_T"], attend, caches, kernel_impl=mm)
    logits_SV = lm_logits(params, spec, jnp.take(h_TD, inp["sample_rows_S"], axis=0), kernel_impl=mm)
    tok_S, logprobs_SV = sample(logits_SV, inp["temperature_S"], inp["top_k_S"], inp["top_p_S"], inp["min_p_S"],
                                inp["seed_S"], inp["sample_pos_S"])
    out = {"tokens": tok_S}
    if prev_tokens_M is not None:
        out["tokens_M"] = jnp.zeros_like(prev_tokens_M).at[:tok_S.shape[0]].set(tok_S)
    if want_logprobs:
        out["token_logprob"] = jnp.take_along_axis(logprobs_SV, tok_S[:, None], axis=-1)[:, 0]
        out["top_logprobs"], out["top_ids"] = jax.lax.top_k(logprobs_SV, TOP_LOGPROBS)
    return out, caches


class ModelRunner:
    """Owns the KV pools of one dp rank and runs scheduled batches on them."""

    def __init__(self, spec: ModelSpec, params, caches, *, page_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_pages_per_seq: int, attn_impl: str = "auto",
                 matmul_impl: str = "auto", layer_buffers: str = "stacked", fold_norms: bool = False):
        if fold_norms:       # RMSNorm weights folded into the next projection (tbjax/model/kinds.py): 2 fewer kernels
            params = fold_layer_norms(spec, params)
        if layer_buffers not in LAYER_BUFFERS:
            raise ValueError(f"layer_buffers must be one of {LAYER_BUFFERS}, got {layer_buffers!r}")
        if layer_buffers == "auto":
            layer_buffers = "split" if jax.default_backend() == "gpu" else "stacked"
        if layer_buffers == "split":
            params = split_layer_buffers(params)
        self.layer_buffers = layer_buffers
        self.spec, self.params, self.caches = spec, params, caches
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.max_pages = max_pages_per_seq
        self.attn_impl = attn_impl
        kernel_impl_for(matmul_impl, True)     # validates the name
        self.matmul_impl = matmul_impl
        # XLA:CPU's bf16 single-row dot against a transposed matrix (the tied lm_head) is ~14x slower than two
        # rows (measured: 174 ms vs 12 ms for SmolLM2), so CPU batches hold at least two sequences.
        self.min_seqs = 2 if jax.default_backend() == "cpu" else 1
        self.max_seqs = max(self.max_num_seqs, self.min_seqs)     # the largest sequence bucket
        self._no_prev = jnp.zeros(self.max_seqs, jnp.int32)        # prev_tokens_M of a step that takes none
        self._wait_before_launch = jax.default_backend() == "cpu"
        self._fn = jax.jit(_step, static_argnames=("layout", "spec", "decode_only", "want_logprobs", "attn_impl",
                                                   "matmul_impl"),
                           donate_argnums=(1,))
        self._compiled: dict = {}          # bucket key -> executable compiled ahead of use (precompile)

    @property
    def num_compiled(self) -> int:
        return self._fn._cache_size() + len(self._compiled)

    def build_inputs(self, entries, sampling, prev_rows=None) -> StepInputs:
        """entries: list of (token_ids, start, block_table); sampling: list of (temp, top_k, top_p, min_p, seed).
        prev_rows (overlapped scheduling): per entry, -1, or the row of the previous step's sampled tokens that is
        this entry's one token (its token_ids value is then ignored)."""
        G = self.page_size
        S = len(entries)
        n_tok = sum(len(t) for t, _, _ in entries)
        decode_only = all(len(t) == 1 for t, _, _ in entries)
        Sb = bucket(S, self.min_seqs, self.max_seqs)
        Tb = Sb if decode_only else bucket(n_tok, 16, max(self.max_tokens, 16))
        Pb = bucket(max(len(bt) for _, _, bt in entries), 1, self.max_pages)
        tokens = np.zeros(Tb, np.int32)
        positions = np.zeros(Tb, np.int32)
        slots = np.full(Tb, -1, np.int32)
        bts = np.zeros((Sb, Pb), np.int32)
        kv_lens = np.zeros(Sb, np.int32)
        cu = np.zeros(Sb + 1, np.int32)
        rows = np.zeros(Sb, np.int32)
        temp = np.zeros(Sb, np.float32)
        top_k = np.zeros(Sb, np.int32)
        top_p = np.ones(Sb, np.float32)
        min_p = np.zeros(Sb, np.float32)
        seed = np.zeros(Sb, np.uint32)
        spos = np.zeros(Sb, np.int32)
        src = np.full(Tb, -1, np.int32)
        if S:
            cols = list(zip(*sampling))
            temp[:S], top_k[:S], top_p[:S], min_p[:S], seed[:S] = cols
        if decode_only:                 # the common step, vectorized (one token per sequence)
            start = np.fromiter((st for _, st, _ in entries), np.int32, S)
            tokens[:S] = [ids[0] for ids, _, _ in entries]
            positions[:S] = start
            for s, (_, _, bt) in enumerate(entries):
                bts[s, :len(bt)] = bt
            slots[:S] = bts[np.arange(S), start // G] * G + start % G
            kv_lens[:S] = spos[:S] = start + 1
            cu[1:S + 1] = np.arange(1, S + 1)
            rows[:S] = np.arange(S)
            cu[S + 1:] = S
            if prev_rows is not None:
                src[:S] = prev_rows
            return StepInputs(tokens, positions, slots, bts, kv_lens, cu, rows, temp, top_k, top_p, min_p, seed,
                              spos, decode_only, src)
        t = 0
        for s, (ids, start, bt) in enumerate(entries):
            n = len(ids)
            pos = np.arange(start, start + n, dtype=np.int32)
            tokens[t:t + n] = ids
            positions[t:t + n] = pos
            bt_arr = np.asarray(bt, np.int32)
            slots[t:t + n] = bt_arr[pos // G] * G + pos % G
            bts[s, :len(bt)] = bt_arr
            kv_lens[s] = start + n
            t += n
            cu[s + 1] = t
            rows[s] = t - 1
            spos[s] = start + n
            if prev_rows is not None and prev_rows[s] >= 0:
                if n != 1:
                    raise ValueError(f"entry {s} takes its token from the previous step but has {n} tokens")
                src[t - 1] = prev_rows[s]
        cu[S + 1:] = t
        return StepInputs(tokens, positions, slots, bts, kv_lens, cu, rows, temp, top_k, top_p, min_p, seed, spos,
                          decode_only, src)

    @staticmethod
    def _key(inp: StepInputs, want_logprobs: bool, layout=None):
        return inp.decode_only, want_logprobs, layout if layout is not None else inp.pack()[2]

    def _static(self, inp: StepInputs, want_logprobs: bool, layout) -> dict:
        return dict(layout=layout, spec=self.spec, decode_only=inp.decode_only, want_logprobs=want_logprobs,
                    attn_impl=self.attn_impl, matmul_impl=self.matmul_impl)

    def precompile(self, inputs: list[StepInputs], want_logprobs: bool = False, workers: int = 8) -> float:
        """Compile the step for each input's bucket ahead of use, several at once; returns the wall seconds.

        Lowering (tracing) runs here one bucket at a time; the XLA compiles run in a thread pool (they release the
        GIL; on the H200 most of a decode step's compile is Triton GEMM codegen). Later `run` calls of the same
        bucket use these executables; a bucket compiled twice is compiled once."""
        import concurrent.futures as cf
        import time
        t = time.perf_counter()
        todo = {}
        for inp in inputs:
            ints, floats, layout = inp.pack()
            key = self._key(inp, want_logprobs, layout)
            if key not in self._compiled and key not in todo:
                todo[key] = self._fn.lower(self.params, self.caches, ints, floats, self._no_prev,
                                           **self._static(inp, want_logprobs, layout))
        with cf.ThreadPoolExecutor(max(1, min(workers, len(todo)))) as pool:
            for key, exe in zip(todo, pool.map(lambda lowered: lowered.compile(), todo.values())):
                self._compiled[key] = exe
        return time.perf_counter() - t

    def launch(self, inp: StepInputs, packed=None, want_logprobs: bool = False, prev=None) -> dict:
        """Start the step on device (no wait); `packed` = inp.pack()'s arrays, host or already on device; `prev` =
        the previous launch's outputs when `inp.src_T` takes tokens from them (overlapped scheduling).
        Returns the step's outputs as device arrays; the KV pools are updated in place."""
        ints, floats, layout = inp.pack() if packed is None else packed
        prev_M = self._no_prev if prev is None else prev["tokens_M"]
        if self._wait_before_launch:
            # XLA:CPU: the previous step (whose output pools this one donates) is finished first. Three clean-clone
            # test runs with steps launched onto pending donated pools segfaulted later inside XLA:CPU; the host
            # work of overlapped scheduling still overlaps the previous step, only the launch waits.
            jax.block_until_ready((self.caches, prev_M))
        exe = self._compiled.get(self._key(inp, want_logprobs, layout))
        if exe is not None:
            out, self.caches = exe(self.params, self.caches, ints, floats, prev_M)
        else:
            out, self.caches = self._fn(self.params, self.caches, ints, floats, prev_M,
                                        **self._static(inp, want_logprobs, layout))
        return out

    @staticmethod
    def fetch(out: dict) -> dict[str, np.ndarray]:
        """Wait for a launched step and bring what the host needs (not the padded device-side tokens)."""
        return jax.device_get({k: v for k, v in out.items() if k != "tokens_M"})

    def run(self, inp: StepInputs, want_logprobs: bool = False) -> dict[str, np.ndarray]:
        return self.fetch(self.launch(inp, want_logprobs=want_logprobs))
