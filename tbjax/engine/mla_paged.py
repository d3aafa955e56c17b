"""MLA's paged latent cache: each token's latent stored once, split over the pool's K and V slots.

Why this module exists: an MLA layer caches one latent per token ([c | k_r], C = kv_lora_rank + qk_rope_head_dim
= 576 numbers for DeepSeek-V3), read by the absorbed attention as both key and value. Stored as the key AND the value
of a one-head GQA pool it would take 2C per token; here the pool keeps GQA's layout [P, G, 2K, H] with K = 1 and
H = ceil(C / 2): the K slot holds the latent's first half and the V slot its second half (a zero dim pads an odd C).
So the cache holds C numbers per token (half of 2C: twice the tokens per byte), and everything that
treats pools generically keeps working unchanged: the page allocator, prefix sharing, fp8 quantization with
per-page scales (one scale per half), KV export/transfer between engines.

Reading it needs the halves joined, which the GQA kernels don't do: `latent_attention` is the jnp definition
(gathers each sequence's pages, joins the halves, MQA with the latent as key and value), used for mixed
(prefill) steps; it loops over sequences and scores every query row against each, so its cost grows with S x T.
`latent_decode_attention` is the decode step's path (one query row per sequence): every sequence at once, one
batched gather of the latents and two batched matmuls in the model's dtype with float32 accumulation, O(S x N x J x
C) like the GQA kernels' work (the scan costs S times that at decode). Mixed steps (`latent_mixed_attention`) send
their decodes the same way and scan only the sequences that prefill.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention import write_kv
from pallas_kernels.paged_attention.reference import dequantize_pages, query_positions


def latent_heads(latent_dims: int) -> tuple[int, int]:
    """(kv heads, head dim) of the pool that stores a latent of `latent_dims` numbers per token."""
    return 1, -(-latent_dims // 2)


def write_latent(kv_pages_PGKH, kv_scales_PK, latent_TC, slot_mapping_T):
    """Writes token t's latent at slot slot_mapping_T[t] (first half -> K slot, second half -> V slot)."""
    Hh = kv_pages_PGKH.shape[-1]
    C = latent_TC.shape[-1]
    if kv_pages_PGKH.shape[2] != 2 or 2 * Hh < C or 2 * (Hh - 1) >= C:
        raise ValueError(f"pool {kv_pages_PGKH.shape} does not hold a {C}-dim latent split in two halves")
    lat = jnp.pad(latent_TC, ((0, 0), (0, 2 * Hh - C)))
    return write_kv(kv_pages_PGKH, kv_scales_PK, lat[:, None, :Hh], lat[:, None, Hh:], slot_mapping_T)


def _sequence_latents(kv_pages_PGKH, kv_scales_PK, block_table_P, C):
    """float32 latents [J = pages * G, C] of one sequence (padding pages included; masked by the caller)."""
    pages = kv_pages_PGKH[block_table_P]                                   # [P, G, 2, Hh]
    scales = None if kv_scales_PK is None else kv_scales_PK[block_table_P]
    x = dequantize_pages(pages, scales)
    return x.reshape(x.shape[0] * x.shape[1], -1)[:, :C]                   # K half then V half, joined


def latent_attention(q_TNC, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, *, scale: float,
                     kv_scales_PK=None, sequences_S=None):
    """Absorbed MLA attention over the latent cache: o[t, n] = softmax_j(scale * q[t, n] . lat_j) @ lat_j.

    q_TNC [T, N, C] (C = the latent's dims); queries rows cu_q_lens[s]:cu_q_lens[s+1] belong to sequence s at
    positions kv_len - q_len .. kv_len - 1 and see latents j <= their position (the paged-attention semantics of
    pallas_kernels.paged_attention.reference). A decode batch is the case cu_q_lens = 0..S. Returns [T, N, C] in
    q's dtype; rows that see nothing are zeros. One sequence at a time (lax.scan): memory O(T * N * J).
    ``sequences_S`` (bool [S], optional): compute only these sequences (the others' rows are zeros)."""
    T, N, C = q_TNC.shape
    S = block_tables_SP.shape[0]
    J = block_tables_SP.shape[1] * kv_pages_PGKH.shape[1]
    seg_T, pos_T, valid_T = query_positions(cu_q_lens_S1, kv_lens_S, T)
    q = q_TNC.astype(jnp.float32)
    pos_J = jnp.arange(J, dtype=jnp.int32)

    def one_sequence(acc_TNC, s):
        if sequences_S is None:
            return add_sequence(acc_TNC, s)
        return lax.cond(sequences_S[s], add_sequence, lambda a, _: (a, None), acc_TNC, s)

    def add_sequence(acc_TNC, s):
        lat_JC = _sequence_latents(kv_pages_PGKH, kv_scales_PK, block_tables_SP[s], C)
        logits = jnp.einsum("tnc,jc->tnj", q, lat_JC, precision=lax.Precision.HIGHEST) * scale
        mask = (pos_J[None, :] <= pos_T[:, None]) & (pos_J[None, :] < kv_lens_S[s]) & (valid_T & (seg_T == s))[:, None]
        logits = jnp.where(mask[:, None, :], logits, -jnp.inf)
        m = jnp.max(logits, axis=-1, keepdims=True)
        p = jnp.where(mask[:, None, :], jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
        l = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("tnj,jc->tnc", p, lat_JC, precision=lax.Precision.HIGHEST)
        return acc_TNC + o / jnp.where(l > 0, l, 1.0), None

    out, _ = lax.scan(one_sequence, jnp.zeros((T, N, C), jnp.float32), jnp.arange(S, dtype=jnp.int32))
    return out.astype(q_TNC.dtype)


def latent_decode_attention(q_SNC, kv_pages_PGKH, block_tables_SP, kv_lens_S, *, scale: float, kv_scales_PK=None):
    """Absorbed MLA attention for a decode batch: sequence s's one query row (position kv_len - 1) against its
    latents 0 .. kv_len - 1. q_SNC [S, N, C]; returns [S, N, C] in q's dtype (zeros where kv_len is 0). Products in
    q's dtype with float32 accumulation (exact float32 math for float32 models); fp8 latents are scaled in float32
    first."""
    S, N, C = q_SNC.shape
    _, G, two, Hh = kv_pages_PGKH.shape
    if two != 2 or 2 * Hh < C:
        raise ValueError(f"pool {kv_pages_PGKH.shape} does not hold a {C}-dim latent split in two halves")
    J = block_tables_SP.shape[1] * G
    cdt = q_SNC.dtype
    pages = kv_pages_PGKH[block_tables_SP]                                 # [S, P, G, 2, Hh]
    if kv_scales_PK is not None:
        pages = pages.astype(jnp.float32) * kv_scales_PK[block_tables_SP][:, :, None, :, None]
    lat_SJC = pages.astype(cdt).reshape(S, J, 2 * Hh)[..., :C]             # K half then V half, joined
    prec = lax.Precision.HIGHEST if cdt == jnp.float32 else lax.Precision.DEFAULT
    logits = jnp.einsum("snc,sjc->snj", q_SNC, lat_SJC, preferred_element_type=jnp.float32, precision=prec) * scale
    mask_SJ = jnp.arange(J, dtype=jnp.int32)[None, :] < kv_lens_S[:, None]
    logits = jnp.where(mask_SJ[:, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.where(mask_SJ[:, None, :], jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("snj,sjc->snc", p.astype(cdt), lat_SJC, preferred_element_type=jnp.float32, precision=prec)
    return (o / jnp.where(l > 0, l, 1.0)).astype(q_SNC.dtype)


def latent_mixed_attention(q_TNC, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, *, scale: float,
                           kv_scales_PK=None):
    """`latent_attention` for a mixed step: the sequences with one query row (the decodes) go through
    `latent_decode_attention` together, the scan computes only the sequences with several rows (prefill chunks)."""
    T = q_TNC.shape[0]
    q_lens_S = cu_q_lens_S1[1:] - cu_q_lens_S1[:-1]
    single_S = q_lens_S == 1
    last_S = jnp.clip(cu_q_lens_S1[1:] - 1, 0, T - 1)
    dec_SNC = latent_decode_attention(q_TNC[last_S], kv_pages_PGKH, block_tables_SP,
                                      jnp.where(single_S, kv_lens_S, 0), scale=scale, kv_scales_PK=kv_scales_PK)
    out = latent_attention(q_TNC, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, scale=scale,
                           kv_scales_PK=kv_scales_PK, sequences_S=q_lens_S > 1)
    return out.at[jnp.where(single_S, last_S, T)].set(dec_SNC, mode="drop")


def latent_dims(spec) -> int:
    return spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim

