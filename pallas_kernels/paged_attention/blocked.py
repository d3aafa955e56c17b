"""Paged attention in plain jnp whose cost follows the real kv lengths, not the block table's width.

Why it exists: the engine's step has fixed shapes (a block table as wide as `max_pages_per_seq`, every sequence slot
of the bucket, most of them padding), so an implementation that gathers every page of the table (reference.py)
costs max_model_len per sequence whatever the context. Here a `lax.while_loop` walks the block table a block of
pages at a time, only up to the longest live sequence, with an online (flash) softmax: the CPU path of the engine
and the portable fallback for layouts no kernel takes (the MLA latent pool).

Two pool readings (``kv_layout``):
  "gqa"        pool [P, G, 2K, H], K and V interleaved on axis 2 (the GQA cache);
  ("latent", C) pool [P, G, 2, Hh] holding one C-dim latent per token split over the K and V slots
               (tbjax/engine/mla_paged.py): key = value = the joined latent, one kv head, head dim C.
Semantics are reference.py's (float32 math, output in q's dtype, rows that see nothing are 0).

`ragged_attention_blocked` is the mixed step: sequences with one query row (decodes) go through the decode loop
together; the others (prefill chunks, usually one or two per step) one at a time in tiles of QUERY_TILE query rows,
each skipped by `lax.cond` when it has no rows. Every dot has a shape fixed by the layout, not by the step, so a
sequence's rows come out bit-identical whatever else shares the step (batch invariance).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import common

BLOCK_TOKENS = 256          # kv tokens per loop iteration (rounded to whole pages)
# Query rows per tile of a multi-row sequence. Every dot of the prefill path has this many rows whatever the step's
# token count, so a row's result does not depend on the bucket or on the other sequences in the step (XLA:CPU's f32
# dot rounds differently at 16 rows than at 32: batch invariance), and a chunk costs its own rows, not the step's.
QUERY_TILE = 32


def _read_kv(x_SnGKH, kv_layout):
    """float32 gathered pages [S, n, G, 2K, H] -> k [S, n*G, Kh, Hk], v [S, n*G, Kh, Hv]."""
    S, n, G, K2, H = x_SnGKH.shape
    if kv_layout == "gqa":
        x = x_SnGKH.reshape(S, n * G, K2 // 2, 2, H)
        return x[..., 0, :], x[..., 1, :]
    _, C = kv_layout
    lat = x_SnGKH.reshape(S, n * G, K2 * H)[..., :C][:, :, None, :]
    return lat, lat


def _gather(kv_pages_PGKH, kv_scales_PK, bt_Sn):
    x = kv_pages_PGKH[bt_Sn].astype(jnp.float32)                  # [S, n, G, 2K, H]
    if kv_scales_PK is not None:
        x = x * kv_scales_PK[bt_Sn][:, :, None, :, None]
    return x


def _pad_table(block_tables_SP, n_pages):
    P = block_tables_SP.shape[1]
    Pp = -(-P // n_pages) * n_pages
    return jnp.pad(block_tables_SP, ((0, 0), (0, Pp - P))) if Pp != P else block_tables_SP


def _block_pages(G):
    return max(1, BLOCK_TOKENS // G)


def _online_softmax_step(m, l, acc, q, k, v, mask, scale, soft_cap, qk_spec, pv_spec):
    """One block of the flash (online) softmax: scores q.k (`qk_spec`), masked, folded into the running max m, sum
    l and output acc (`pv_spec`). Fully masked rows keep m = -inf and contribute nothing."""
    s = jnp.einsum(qk_spec, q, k, precision=lax.Precision.HIGHEST) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
    corr = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
    l = l * corr + p.sum(-1)
    acc = acc * corr[..., None] + jnp.einsum(pv_spec, p, v, precision=lax.Precision.HIGHEST)
    return m_new, l, acc


def _run_blocks(body, b0, b1, rows, Hv):
    """while b0 <= b < b1: body((b, m, l, acc)); returns acc / l (0 where nothing was seen), float32."""
    init = (b0, jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32),
            jnp.zeros((*rows, Hv), jnp.float32))
    _, _, l, acc = lax.while_loop(lambda c: c[0] < b1, body, init)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "kv_layout"))
def decode_attention_blocked(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, *, scale=None, soft_cap=None,
                             sliding_window=None, kv_scales_PK=None, kv_layout="gqa"):
    """One query per sequence at position kv_len - 1 (kv_len 0: output 0). q_SNH [S, N, Hq] -> [S, N, Hv]."""
    S, N, Hq = q_SNH.shape
    G = kv_pages_PGKH.shape[1]
    nb = _block_pages(G)
    bt = _pad_table(block_tables_SP, nb)
    Kh = kv_pages_PGKH.shape[2] // 2 if kv_layout == "gqa" else 1
    Hv = kv_pages_PGKH.shape[3] if kv_layout == "gqa" else kv_layout[1]
    g = N // Kh
    scale = common.default_scale(Hq, scale)
    q = q_SNH.astype(jnp.float32).reshape(S, Kh, g, Hq)
    lens = kv_lens_S.astype(jnp.int32)
    span = nb * G
    lo = jnp.zeros_like(lens) if sliding_window is None else jnp.maximum(lens - sliding_window, 0)
    live = lens > 0
    b0 = jnp.min(jnp.where(live, lo // span, jnp.int32(1 << 30)))
    b1 = -(-jnp.max(jnp.where(live, lens, 0)) // span)
    b0 = jnp.minimum(b0, b1)

    def body(carry):
        b, m, l, acc = carry
        idx = lax.dynamic_slice_in_dim(bt, b * nb, nb, axis=1)                   # [S, nb]
        k, v = _read_kv(_gather(kv_pages_PGKH, kv_scales_PK, idx), kv_layout)      # [S, span, Kh, H]
        pos = b * span + jnp.arange(span, dtype=jnp.int32)
        mask = (pos[None, :] < lens[:, None]) & (pos[None, :] >= lo[:, None])
        return (b + 1, *_online_softmax_step(m, l, acc, q, k, v, mask[:, None, None, :], scale, soft_cap,
                                             "skgh,slkh->skgl", "skgl,slkh->skgh"))

    o = _run_blocks(body, b0, b1, (S, Kh, g), Hv)
    return o.reshape(S, N, Hv).astype(q_SNH.dtype)


def _one_sequence_blocked(q_TKgH, kv_pages_PGKH, kv_scales_PK, bt_P, kv_len, rows_T, pos_T, *, scale, soft_cap,
                          sliding_window, kv_layout):
    """Rows `rows_T` of q (all at their positions pos_T) against one sequence's pages up to kv_len."""
    T, Kh, g, Hq = q_TKgH.shape
    G = kv_pages_PGKH.shape[1]
    nb = _block_pages(G)
    bt = _pad_table(bt_P[None], nb)
    span = nb * G
    Hv = kv_pages_PGKH.shape[3] if kv_layout == "gqa" else kv_layout[1]
    first = jnp.min(jnp.where(rows_T, pos_T, jnp.int32(1 << 30)))
    lo = 0 if sliding_window is None else jnp.maximum(first - sliding_window + 1, 0)
    b0 = jnp.minimum(lo // span, -(-kv_len // span))
    b1 = -(-kv_len // span)

    def body(carry):
        b, m, l, acc = carry
        idx = lax.dynamic_slice_in_dim(bt, b * nb, nb, axis=1)
        k, v = _read_kv(_gather(kv_pages_PGKH, kv_scales_PK, idx), kv_layout)
        k, v = k[0], v[0]                                                         # [span, Kh, H]
        pos = b * span + jnp.arange(span, dtype=jnp.int32)
        mask = (pos[None, :] <= pos_T[:, None]) & (pos[None, :] < kv_len) & rows_T[:, None]
        if sliding_window is not None:
            mask &= pos[None, :] > pos_T[:, None] - sliding_window
        return (b + 1, *_online_softmax_step(m, l, acc, q_TKgH, k, v, mask[:, None, None, :], scale, soft_cap,
                                             "tkgh,lkh->tkgl", "tkgl,lkh->tkgh"))

    return _run_blocks(body, b0, b1, (T, Kh, g), Hv)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "kv_layout"))
def ragged_attention_blocked(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, *, scale=None,
                             soft_cap=None, sliding_window=None, kv_scales_PK=None, kv_layout="gqa"):
    """Ragged paged attention (reference.py's semantics) -> [T, N, Hv]; decodes batched, chunks one at a time."""
    T, N, Hq = q_TNH.shape
    S = block_tables_SP.shape[0]
    Kh = kv_pages_PGKH.shape[2] // 2 if kv_layout == "gqa" else 1
    Hv = kv_pages_PGKH.shape[3] if kv_layout == "gqa" else kv_layout[1]
    g = N // Kh
    scale = common.default_scale(Hq, scale)
    kw = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, kv_layout=kv_layout)
    q_lens = cu_q_lens_S1[1:] - cu_q_lens_S1[:-1]
    single = q_lens == 1
    row_S = jnp.clip(cu_q_lens_S1[:-1], 0, T - 1)
    dec = decode_attention_blocked(q_TNH[row_S], kv_pages_PGKH, block_tables_SP, jnp.where(single, kv_lens_S, 0),
                                   kv_scales_PK=kv_scales_PK, **kw)
    q = q_TNH.astype(jnp.float32).reshape(T, Kh, g, Hq)
    q = jnp.concatenate([q, jnp.zeros((QUERY_TILE, Kh, g, Hq), q.dtype)])      # tiles never run off the end
    tile = jnp.arange(QUERY_TILE, dtype=jnp.int32)

    def one(out_TKgH, s):
        start, q_len, kv_len = cu_q_lens_S1[s], q_lens[s], kv_lens_S[s]

        def tile_body(carry):
            i, out = carry
            r0 = start + i * QUERY_TILE
            rows = i * QUERY_TILE + tile < q_len
            pos = kv_len - q_len + i * QUERY_TILE + tile
            o = _one_sequence_blocked(lax.dynamic_slice_in_dim(q, r0, QUERY_TILE), kv_pages_PGKH, kv_scales_PK,
                                      block_tables_SP[s], jnp.minimum(kv_len, jnp.max(jnp.where(rows, pos, 0)) + 1),
                                      rows, pos, **kw)
            old = lax.dynamic_slice_in_dim(out, r0, QUERY_TILE)
            return i + 1, lax.dynamic_update_slice_in_dim(out, jnp.where(rows[:, None, None, None], o, old), r0, 0)

        def run(out):
            return lax.while_loop(lambda c: c[0] * QUERY_TILE < q_len, tile_body, (jnp.int32(0), out))[1]
        return lax.cond((q_len > 1) & (kv_len > 0), run, lambda o: o, out_TKgH), None

    out, _ = lax.scan(one, jnp.zeros((T + QUERY_TILE, Kh, g, Hv), jnp.float32), jnp.arange(S, dtype=jnp.int32))
    out = out[:T]
    out = out.reshape(T, N, Hv).astype(q_TNH.dtype)
    return out.at[jnp.where(single, row_S, T)].set(dec, mode="drop")
