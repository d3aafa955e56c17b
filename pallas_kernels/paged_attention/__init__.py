"""Paged attention over a KV page pool: jnp reference, Mosaic GPU and Mosaic TPU kernels, and a dispatcher.

Public API (the engine calls exactly these):
  paged_attention(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, *, scale=None, soft_cap=None,
                  sliding_window=None, kv_scales_PK=None, impl="auto", max_q_len=None) -> [T, N, H]
  paged_decode_attention(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, *, ...) -> [S, N, H]
  step_attention(q_TNH, ...same as paged_attention...) -> [T, N, H]: the engine step's one entry (decode and mixed)
  write_kv(kv_pages_PGKH, kv_scales_PK, k_TKH, v_TKH, slot_mapping_T) -> (kv_pages_PGKH, kv_scales_PK)
  paged_sparse_decode_attention(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kmin_PKH, kmax_PKH, *,
                                num_sink_pages, num_window_pages, top_k_pages, ...) -> [S, N, H]
  init_page_summaries / update_page_summaries / select_pages: the per-page key summaries for sparse attention.
"""
from .cache_write import write_kv, write_kv_donated
from .common import Unsupported
from .dispatch import paged_attention, paged_decode_attention, resolve_impl, step_attention
from .reference import paged_attention_reference, paged_decode_attention_reference
from .sparse import (init_page_summaries, paged_sparse_decode_attention, select_pages,
                     sparse_decode_attention_reference, update_page_summaries)

__all__ = [
    "paged_attention", "paged_decode_attention", "step_attention", "write_kv", "write_kv_donated", "Unsupported", "resolve_impl",
    "paged_attention_reference", "paged_decode_attention_reference", "init_page_summaries",
    "paged_sparse_decode_attention", "select_pages", "sparse_decode_attention_reference", "update_page_summaries",
]
