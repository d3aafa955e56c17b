"""XLA passes that turn per-chunk escape counts (from a kernel) into the ordered escape stream.

Why this module exists: cumulative sums and gathers do not lower inside TPU kernels and are awkward
inside Mosaic GPU ones, so both kernel families only count escapes per chunk (the GPU kernel also
lists up to `slots` escaped lanes per chunk); the ordering and placement of the escapes is done here,
with static capacities and explicit overflow reporting:

  * chunks whose escaped lanes fit in the kernel's slots: expand slots (lane, row mask) to positions
    in position order and rank them with a prefix count;
  * other chunks with escapes (too many escaped lanes, or a kernel with no slots): a second pass
    over their raw bits, at most `cap_rows` such chunks;
  * exclusive prefix sum of the counts, scatter positions into a stream of `capacity` slots, gather
    the raw exponents.

status bit 1: more escapes than `capacity`; bit 2: more second-pass chunks than `cap_rows`. A caller
that sees a nonzero status must redo the encode another way (dispatch.py does); the stream is then
incomplete, never silently so.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .codebook import Codebook
from .layout import ROWS
from .reference import code_of

BIG = 2**31 - 1


def escape_stream(u_ckw, counts, lanes_hit, slots, cb: Codebook, *, capacity: int, cap_rows: int,
                  exp_shift: int = 7, exp_bits: int = 8):
    """u_ckw: element bits [nch, 8, W]; counts, lanes_hit: int32[nch]; slots: int32[nch, S] or None.

    Returns (esc_pos int32[capacity], esc_val int32[capacity], n_esc, status, n_second) (int32 scalars;
    n_second = chunks that needed the second pass).
    """
    nch, _, w = u_ckw.shape
    chunk = ROWS * w
    counts = counts.astype(jnp.int32)
    n_esc = jnp.sum(counts)
    excl = jnp.cumsum(counts) - counts
    nslot = 0 if slots is None else slots.shape[1]
    second = lanes_hit > nslot                       # chunks the second pass must list
    gp_out = jnp.zeros((capacity,), jnp.int32)

    if nslot:
        # Candidates in (row, slot) order = position order (slots are in lane order); their rank
        # among the valid ones is a prefix count, done as one small exact matmul (0/1 values, f32
        # accumulation) instead of a sort or a scan.
        t = jnp.arange(nslot, dtype=jnp.int32)
        ok = (t[None, :] < lanes_hit[:, None]) & ~second[:, None]            # [nch, S]
        lane = slots >> 8
        mask = slots & 0xFF
        k = jnp.arange(ROWS, dtype=jnp.int32)
        bit = ((mask[:, None, :] >> k[None, :, None]) & 1) == 1               # [nch, 8, S]
        valid = (ok[:, None, :] & bit).reshape(nch, ROWS * nslot)
        pos = (k[None, :, None] * w + lane[:, None, :]).reshape(nch, ROWS * nslot)
        a = jnp.arange(ROWS * nslot)
        upper = (a[:, None] < a[None, :]).astype(jnp.bfloat16)
        rank = jnp.dot(valid.astype(jnp.bfloat16), upper,
                       preferred_element_type=jnp.float32).astype(jnp.int32)
        dst = excl[:, None] + rank
        dst = jnp.where(valid & (dst < capacity), dst, capacity)
        gp = jnp.arange(nch, dtype=jnp.int32)[:, None] * chunk + pos
        gp_out = gp_out.at[dst.reshape(-1)].set(gp.reshape(-1), mode="drop")

    n_second = jnp.sum(second.astype(jnp.int32))
    if cap_rows:
        def second_pass(gp_out):
            (rows,) = jnp.nonzero(second, size=cap_rows, fill_value=nch)
            rvalid = rows < nch
            rc = jnp.minimum(rows, nch - 1)
            data = u_ckw[rc].reshape(cap_rows, chunk).astype(jnp.uint32)
            e = (data >> exp_shift) & ((1 << exp_bits) - 1)
            _, esc = code_of(e, cb)
            iota = jnp.arange(chunk, dtype=jnp.int32)
            keys = jnp.sort(jnp.where(esc, iota[None, :], BIG), axis=1)
            cnt = jnp.where(rvalid, counts[rc], 0)
            valid = iota[None, :] < cnt[:, None]
            dst = excl[rc][:, None] + iota[None, :]
            dst = jnp.where(valid & (dst < capacity), dst, capacity)
            gp = rc[:, None] * chunk + keys
            return gp_out.at[dst.reshape(-1)].set(gp.reshape(-1), mode="drop")

        # Skipped at run time when no chunk needs it (the common case for real KV).
        gp_out = jax.lax.cond(n_second > 0, second_pass, lambda g: g, gp_out)

    s = jnp.arange(capacity, dtype=jnp.int32)
    live = s < n_esc
    gp_out = jnp.where(live, gp_out, 0)
    flat = u_ckw.reshape(-1)
    val = ((flat[gp_out].astype(jnp.uint32) >> exp_shift) & ((1 << exp_bits) - 1)).astype(jnp.int32)
    pos = gp_out % chunk
    status = (n_esc > capacity).astype(jnp.int32) | ((n_second > cap_rows).astype(jnp.int32) << 1)
    return jnp.where(live, pos, 0), jnp.where(live, val, 0), n_esc, status, n_second
