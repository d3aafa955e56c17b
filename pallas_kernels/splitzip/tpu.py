"""Mosaic TPU kernels for the SplitZip dense streams (BF16) and per-chunk escape counts.

Why this module exists: the same codec on TPU hosts. Inside TPU kernels cumsum and gathers do not
lower, so the encode kernel only writes the dense streams and counts escapes per chunk; ordering and
placing the escapes is the XLA pass in escapes.py (prefix sum outside, then a second pass over the
chunks that have escapes). Decode writes the dense bits; escapes are patched by an XLA scatter.

Blocks are `group` chunks (8 by default) = (8*group, W) uint16 rows, 32-bit math inside. Counts go
out lane-broadcast as int32[nch, 128] (TPU blocks need a 128-wide last dim); column 0 is used.
Not measured on TPU hardware here (none available): correctness is checked in interpret mode and the
lowering by exporting for TPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .codebook import Codebook
from .gpu import _lut_swar, encode_rows, resolve_lookup
from .layout import ROWS


def _group(nch: int) -> int:
    return 8 if nch % 8 == 0 else nch


@functools.lru_cache(maxsize=64)
def encode_kernel(nch: int, lanes: int, cb: Codebook, *, lookup: str = "auto", interpret: bool = False):
    """(bits uint16[nch*8, W]) -> (sm_words u32[2*nch, W], code_words u32[nch, W], counts i32[nch, 128])."""
    if cb.dtype != "bfloat16":
        raise ValueError("splitzip tpu kernels handle bfloat16 only")
    lookup = resolve_lookup(cb, lookup)
    g = _group(nch)

    def body(x_ref, smw_ref, cw_ref, cnt_ref):
        x = x_ref[...].astype(jnp.uint32).reshape(g, ROWS, lanes)
        cw, smw0, smw1, _, cnt = encode_rows([x[:, k, :] for k in range(ROWS)], cb, lookup)
        cw_ref[...] = cw
        smw_ref[...] = jnp.stack([smw0, smw1], axis=1).reshape(2 * g, lanes)
        cnt_ref[...] = jnp.broadcast_to(jnp.sum(cnt.astype(jnp.int32), axis=1, keepdims=True), (g, 128))

    return pl.pallas_call(
        body, grid=(nch // g,),
        in_specs=[pl.BlockSpec((ROWS * g, lanes), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((2 * g, lanes), lambda i: (i, 0)),
                   pl.BlockSpec((g, lanes), lambda i: (i, 0)),
                   pl.BlockSpec((g, 128), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((2 * nch, lanes), jnp.uint32),
                   jax.ShapeDtypeStruct((nch, lanes), jnp.uint32),
                   jax.ShapeDtypeStruct((nch, 128), jnp.int32)],
        interpret=pltpu.InterpretParams(uninitialized_memory="nan") if interpret else False)


@functools.lru_cache(maxsize=64)
def decode_kernel(nch: int, lanes: int, cb: Codebook, *, interpret: bool = False):
    """(sm_words u32[2*nch, W], code_words u32[nch, W]) -> bits uint16[nch*8, W] (escapes unpatched)."""
    if cb.dtype != "bfloat16":
        raise ValueError("splitzip tpu kernels handle bfloat16 only")
    g = _group(nch)

    def body(smw_ref, cw_ref, out_ref):
        cw = cw_ref[...]
        smw = smw_ref[...].reshape(g, 2, lanes)
        s0, s1 = smw[:, 0, :], smw[:, 1, :]
        e_lo = _lut_swar(cw & jnp.uint32(0x0F0F0F0F), cb.exponents)
        e_hi = _lut_swar((cw >> 4) & jnp.uint32(0x0F0F0F0F), cb.exponents)
        rows = []
        for k in range(ROWS):
            ew = e_lo if k % 2 == 0 else e_hi
            e = (ew >> (8 * (k // 2))) & jnp.uint32(0xFF)
            sw = s0 if k < 4 else s1
            s = sw >> (8 * (k % 4))
            rows.append(((s & jnp.uint32(0x80)) << 8) | (e << 7) | (s & jnp.uint32(0x7F)))
        out_ref[...] = jnp.stack(rows, axis=1).reshape(ROWS * g, lanes).astype(jnp.uint16)

    return pl.pallas_call(
        body, grid=(nch // g,),
        in_specs=[pl.BlockSpec((2 * g, lanes), lambda i: (i, 0)),
                  pl.BlockSpec((g, lanes), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((ROWS * g, lanes), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((ROWS * nch, lanes), jnp.uint16),
        interpret=pltpu.InterpretParams(uninitialized_memory="nan") if interpret else False)
