"""One entry point per operation that picks the implementation by platform, overridable, with fallback.

impl: "auto" (Mosaic GPU on Hopper GPUs, Mosaic TPU on TPUs, the jnp reference elsewhere), "reference",
"blocked" (jnp whose cost follows the kv lengths, blocked.py), "gpu", "tpu", "gpu_interpret", "tpu_interpret" (the
kernels run by the Pallas interpreters on CPU, for tests).

`step_attention` is what the engine's step calls: one entry for decode-only and mixed batches with a block table
as wide as the longest allowed sequence; "auto" there means the kernels on GPU / TPU and "blocked" elsewhere.
A kernel that cannot handle a shape/dtype raises `Unsupported` while tracing; the dispatcher then logs a
warning naming the reason and runs the blocked jnp version instead. Bad input (wrong shapes/dtypes) is not a fallback
case: it raises from the shared checks before any implementation is chosen.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from . import blocked, common, gpu, reference, tpu

log = logging.getLogger("pallas_kernels.paged_attention")
IMPLS = ("auto", "reference", "blocked", "gpu", "tpu", "gpu_interpret", "tpu_interpret")


def _platform_impl() -> str:
  backend = jax.default_backend()
  if backend == "gpu":
    try:
      cc = getattr(jax.devices()[0], "compute_capability", "0")
      if float(cc) >= 9.0:
        return "gpu"
    except Exception:  # noqa: BLE001 - unknown device kinds use the reference
      pass
    return "reference"
  if backend == "tpu":
    return "tpu"
  return "reference"


def resolve_impl(impl: str) -> str:
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  return _platform_impl() if impl == "auto" else impl


def _fallback(name, impl, err, fn):
  log.warning("paged attention: %s kernel (%s) cannot run this call (%s); using the blocked jnp version", impl, name,
              err)
  return fn()


def paged_decode_attention(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, *, scale=None, soft_cap=None,
                           sliding_window=None, kv_scales_PK=None, impl="auto"):
  """Decode attention: one query per sequence (q_SNH [S, N, H]) at position kv_len - 1 -> [S, N, H]."""
  common.check_decode(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kv_scales_PK, soft_cap=soft_cap,
                      sliding_window=sliding_window)
  which = resolve_impl(impl)
  kw = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, kv_scales_PK=kv_scales_PK)
  ref = lambda: reference.paged_decode_attention_reference(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, **kw)
  if which == "reference":
    return ref()
  if which == "blocked":
    return blocked.decode_attention_blocked(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, **kw)
  try:
    if which.startswith("gpu"):
      return gpu.paged_decode_attention_gpu(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S,
                                            interpret=which.endswith("interpret"), **kw)
    return tpu.paged_decode_attention_tpu(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S,
                                          interpret=which.endswith("interpret"), **kw)
  except common.Unsupported as err:
    return _fallback("decode", which, err, lambda: blocked.decode_attention_blocked(
        q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, **kw))


def paged_attention(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, *, scale=None, soft_cap=None,
                    sliding_window=None, kv_scales_PK=None, impl="auto", max_q_len=None):
  """Ragged paged attention over a page pool (see reference.py for the exact semantics) -> [T, N, H].

  max_q_len: optional static bound on tokens per sequence; max_q_len == 1 routes to the decode kernel.
  """
  S, N, K, g, P, G, H = common.check_ragged(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1,
                                            kv_scales_PK, soft_cap=soft_cap, sliding_window=sliding_window)
  which = resolve_impl(impl)
  kw = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, kv_scales_PK=kv_scales_PK)
  if max_q_len == 1:
    return _decode_from_ragged(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, impl=which, **kw)
  ref = lambda: reference.paged_attention_reference(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S,
                                                    cu_q_lens_S1, **kw)
  if which == "reference":
    return ref()
  if which == "blocked":
    return blocked.ragged_attention_blocked(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, **kw)
  try:
    if which.startswith("gpu"):
      return gpu.paged_attention_gpu(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1,
                                     interpret=which.endswith("interpret"), **kw)
    return tpu.paged_attention_tpu(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1,
                                   interpret=which.endswith("interpret"), **kw)
  except common.Unsupported as err:
    return _fallback("ragged", which, err, lambda: blocked.ragged_attention_blocked(
        q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, **kw))


def _decode_from_ragged(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, *, impl, **kw):
  """Ragged call with at most one query per sequence: gather those rows, run decode, scatter back."""
  T = q_TNH.shape[0]
  q_lens = cu_q_lens_S1[1:] - cu_q_lens_S1[:-1]
  has_q = q_lens > 0
  row_S = jnp.clip(cu_q_lens_S1[:-1], 0, T - 1)
  q_SNH = q_TNH[row_S]
  lens = jnp.where(has_q, kv_lens_S, 0)
  out_SNH = paged_decode_attention(q_SNH, kv_pages_PGKH, block_tables_SP, lens, impl=impl, **kw)
  out = jnp.zeros_like(q_TNH)
  return out.at[jnp.where(has_q, row_S, T)].set(out_SNH, mode="drop")


# Steps of at most this many token rows run every row through the decode kernel (rows_as_decodes): one attention
# launch per layer for decode-only steps (the decode buckets), at the price of a small chunk's rows each reading their
# sequence's KV. Larger steps split decodes (decode kernel) from chunks (ragged kernel). H200, Llama-8B 32 x 1k:
# running the ragged kernel too in a decode-only step cost ~0.5 ms per step (an empty launch, a select and a
# transpose per layer); benchmarks/RESULTS.md.
ROWS_AS_DECODES_MAX_T = 64


def rows_as_decodes(block_tables_SP, kv_lens_S, cu_q_lens_S1, T: int):
  """Every token row of a ragged batch as a one-query "sequence" of its own: row t of sequence s (query rows
  [cu[s], cu[s+1])) attends to the first kv_lens[s] - (cu[s+1] - 1 - t) positions of s's block-table row (the causal
  prefix up to and including its own token). -> (block_tables_TP, kv_lens_T). Rows past cu[S] (padding) get kv
  length 1 on their table row (pools hold finite values, so padding rows stay finite: a kernel leaves kv-length-0
  outputs unwritten)."""
  S = kv_lens_S.shape[0]
  cu = cu_q_lens_S1.astype(jnp.int32)
  t = jnp.arange(T, dtype=jnp.int32)
  seq_T = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right", method="compare_all").astype(jnp.int32), S - 1)
  live = t < cu[S]
  kv_T = jnp.take(kv_lens_S, seq_T) - (jnp.take(cu, seq_T + 1) - 1 - t)
  kv_T = jnp.where(live, jnp.maximum(kv_T, 1), 1).astype(jnp.int32)
  return jnp.take(block_tables_SP, seq_T, axis=0), kv_T


def step_attention(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, *, scale=None, soft_cap=None,
                   sliding_window=None, kv_scales_PK=None, impl="auto", rows_as_decodes_max_t=None):
  """The engine step's attention: decode-only and mixed batches alike (ragged semantics, reference.py), the block
  table as wide as the longest allowed sequence, padding sequences at kv_len 0. -> [T, N, H].

  With kernels: steps of at most `rows_as_decodes_max_t` rows (default ROWS_AS_DECODES_MAX_T) run every row in the
  decode kernel (`rows_as_decodes`); larger steps send the sequences that have one query row to the decode kernel
  (split over the kv length) and the others to the ragged kernel, each kernel seeing the other's sequences at kv_len
  0 (no work). Elsewhere the blocked jnp loop, whose cost follows the live lengths; there `rows_as_decodes_max_t`
  applies only when given. Every row as a decode makes a row's result independent of how its sequence was chunked
  (the engine's deterministic mode). Rows past the last sequence's are padding: their values are unspecified
  (finite)."""
  common.check_ragged(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, kv_scales_PK,
                      soft_cap=soft_cap, sliding_window=sliding_window)
  which = "blocked" if impl == "auto" and _platform_impl() == "reference" else resolve_impl(impl)
  kw = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, kv_scales_PK=kv_scales_PK)
  T = q_TNH.shape[0]
  S = kv_lens_S.shape[0]
  jnp_impl = which in ("reference", "blocked")
  max_t = rows_as_decodes_max_t if rows_as_decodes_max_t is not None else (0 if jnp_impl else ROWS_AS_DECODES_MAX_T)
  if T <= max_t:
    bt_TP, kv_T = rows_as_decodes(block_tables_SP, kv_lens_S, cu_q_lens_S1, T)
    return paged_decode_attention(q_TNH, kv_pages_PGKH, bt_TP, kv_T, impl=which, **kw)
  if jnp_impl:
    return paged_attention(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, impl=which, **kw)
  if S > T:
    raise ValueError(f"step_attention needs at most as many sequences as tokens, got S={S} > T={T}")
  # The leading run of one-row sequences (the step's decodes: the scheduler puts them first) has sequence s at
  # row s: those go to the decode kernel and come back by a select (no scatter); every other sequence, one-row
  # prefill chunks included, goes to the ragged kernel.
  q_lens = cu_q_lens_S1[1:] - cu_q_lens_S1[:-1]
  lead = jnp.cumprod((q_lens == 1).astype(jnp.int32)) > 0                  # [S]: in the leading run of decodes
  n_lead = jnp.sum(lead.astype(jnp.int32))
  dec = paged_decode_attention(q_TNH[:S], kv_pages_PGKH, block_tables_SP, jnp.where(lead, kv_lens_S, 0),
                               impl=which, **kw)
  rag = paged_attention(q_TNH, kv_pages_PGKH, block_tables_SP, jnp.where(lead, 0, kv_lens_S), cu_q_lens_S1,
                        impl=which, **kw)
  if T > S:
    dec = jnp.concatenate([dec, jnp.zeros((T - S, *dec.shape[1:]), dec.dtype)])
  rows = jnp.arange(T, dtype=jnp.int32)[:, None, None]
  return jnp.where(rows < n_lead, dec, rag)
