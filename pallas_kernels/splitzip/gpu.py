"""Mosaic GPU kernels for the SplitZip dense streams (BF16), plus the XLA passes around them.

Why this module exists: encode/decode must run at HBM speed on the GPU that produced the KV.

Encode kernel (one program per `group` chunks, plain vector loads/stores from GMEM, no SMEM):
  per lane i of a chunk it loads the 8 row elements, computes sm and code of each and writes one
  codes word and two sm words (layout.py). It also counts the chunk's escapes and its *escaped lanes*
  (lanes with at least one escape; one reduction), and lists up to `slots` escaped lanes as
  (lane << 8 | row mask), found one per iteration by a min-reduction. Everything position-ordered
  and capacity-checked happens afterwards in XLA (escapes.py): expand the slots to positions, sort
  each chunk's few positions, redo chunks with more escaped lanes than slots from the raw data
  (second pass), prefix-sum the counts and scatter into the escape stream, whose static capacity is
  checked (overflow is reported, never cut silently).
Decode kernel: per lane, the codes word and two sm words -> 8 output elements. The 16-entry lookup is
  done four codes at a time in the bytes of a 32-bit word (a tree of bitwise selects: "SWAR"), or
  per element with a tree of selects. Escapes are then patched by an in-place XLA scatter.

BF16 only: e5m2 goes through the jnp reference (its 3-bit sm packing has no kernel here).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from .codebook import Codebook
from .layout import ROWS

BIG = 2**31 - 1


def _layout(lanes: int):
    vec = min(8, lanes // 128)
    if lanes % 128 or lanes % (128 * vec):
        raise ValueError(f"splitzip gpu: lanes per chunk ({lanes}) must be a multiple of 128")
    return plgpu.Layout.WG_STRIDED((lanes,), vec_size=vec)


def _code_chain(e, cb: Codebook):
    code = jnp.zeros_like(e)
    for j in range(1, 16):
        code = jnp.where(e == jnp.uint32(cb.exponents[j]), jnp.uint32(j), code)
    esc = (code == 0) & (e != jnp.uint32(cb.exponents[0]))
    return code, esc


def _code_window(e, cb: Codebook):
    lo, planes, member = cb.window()
    r = e - jnp.uint32(lo)                   # wraps for e < lo
    inwin = r < jnp.uint32(28)
    rr = r & jnp.uint32(31)
    code = jnp.zeros_like(e)
    for b in range(4):
        if planes[b]:
            code = code | ((jnp.uint32(planes[b]) >> rr) & jnp.uint32(1 << b))
    hit = inwin & (((jnp.uint32(member) >> rr) & 1) == 1)
    code = jnp.where(inwin, code, jnp.uint32(0))
    return code, ~hit


def _lut_swar(c4, cb: Codebook):
    """Exponents of four codes held in the bytes of a uint32 (each byte 0..15)."""
    masks = [((c4 >> b) & jnp.uint32(0x01010101)) * jnp.uint32(0xFF) for b in range(4)]
    t = [e * 0x01010101 for e in cb.exponents]
    level = [jnp.uint32(t[2 * j]) ^ (jnp.uint32(t[2 * j] ^ t[2 * j + 1]) & masks[0]) for j in range(8)]
    for b in range(1, 4):
        level = [level[2 * j] ^ ((level[2 * j] ^ level[2 * j + 1]) & masks[b])
                 for j in range(len(level) // 2)]
    return level[0]


def _lut_select(code, cb: Codebook):
    level = [jnp.uint32(e) for e in cb.exponents]
    for b in range(4):
        bit = (code & jnp.uint32(1 << b)) != 0
        level = [jnp.where(bit, level[2 * j + 1], level[2 * j]) for j in range(len(level) // 2)]
    return level[0]


@functools.lru_cache(maxsize=64)
def encode_kernel(nch: int, lanes: int, cb: Codebook, *, lookup: str = "auto", slots: int = 16,
                  group: int = 1, interpret: bool = False):
    """(x_bits uint16[nch, 8, W]) -> (sm_words u32[nch,2,W], code_words u32[nch,W],
    stats i32[nch] (escapes + escaped_lanes << 16), slots i32[nch, max(slots,1)])."""
    if cb.dtype != "bfloat16":
        raise ValueError("splitzip gpu kernels handle bfloat16 only")
    if nch % group:
        raise ValueError(f"splitzip gpu: {nch} chunks not divisible by group {group}")
    if lookup == "auto":
        lookup = "window" if cb.window() is not None else "chain"
    if lookup == "window" and cb.window() is None:
        raise ValueError("splitzip gpu: codebook does not fit a 28-exponent window")
    code_fn = _code_window if lookup == "window" else _code_chain
    lay = _layout(lanes)
    nslot = max(slots, 1)

    def body(x_ref, smw_ref, cw_ref, st_ref, slot_ref):
        g = lax.axis_index("g")
        for q in range(group):
            c = g * group + q
            cw = None
            smw = [None, None]
            m = None
            cnt = None
            for k in range(ROWS):
                u = plgpu.load(x_ref.at[c, k], layout=lay).astype(jnp.uint32)
                e = (u >> 7) & jnp.uint32(0xFF)
                s = ((u >> 8) & jnp.uint32(0x80)) | (u & jnp.uint32(0x7F))
                code, esc = code_fn(e, cb)
                escu = esc.astype(jnp.uint32)
                sk = s << (8 * (k % 4)) if k % 4 else s
                smw[k // 4] = sk if smw[k // 4] is None else smw[k // 4] | sk
                ck = code << (4 * k) if k else code
                cw = ck if cw is None else cw | ck
                mk = escu << k if k else escu
                m = mk if m is None else m | mk
                cnt = escu if cnt is None else cnt + escu
            smw_ref[c, 0] = smw[0]
            smw_ref[c, 1] = smw[1]
            cw_ref[c] = cw
            lane_hit = m != 0
            stat = jnp.sum(cnt.astype(jnp.int32) + (lane_hit.astype(jnp.int32) << 16))
            st_ref[c] = stat
            if slots:
                iota = lax.broadcasted_iota(jnp.int32, (lanes,), 0)
                key = (iota << 8) | m.astype(jnp.int32)
                nl = jnp.minimum(stat >> 16, slots)

                def find(t, prev):
                    v = jnp.min(jnp.where(lane_hit & (iota > prev), key, BIG))
                    slot_ref[c, t] = v
                    return v >> 8

                lax.fori_loop(0, nl, find, jnp.int32(-1))

    out_type = (jax.ShapeDtypeStruct((nch, 2, lanes), jnp.uint32),
                jax.ShapeDtypeStruct((nch, lanes), jnp.uint32),
                jax.ShapeDtypeStruct((nch,), jnp.int32),
                jax.ShapeDtypeStruct((nch, nslot), jnp.int32))
    return plgpu.kernel(body, out_type=out_type, grid=(nch // group,), grid_names=("g",),
                        interpret=plgpu.InterpretGPUParams() if interpret else None)


@functools.lru_cache(maxsize=64)
def decode_kernel(nch: int, lanes: int, cb: Codebook, *, lut: str = "swar", group: int = 1,
                  interpret: bool = False):
    """(sm_words u32[nch,2,W], code_words u32[nch,W]) -> bits uint16[nch, 8, W] (escapes not patched)."""
    if cb.dtype != "bfloat16":
        raise ValueError("splitzip gpu kernels handle bfloat16 only")
    if nch % group:
        raise ValueError(f"splitzip gpu: {nch} chunks not divisible by group {group}")
    lay = _layout(lanes)

    def body(smw_ref, cw_ref, out_ref):
        g = lax.axis_index("g")
        for q in range(group):
            c = g * group + q
            cw = plgpu.load(cw_ref.at[c], layout=lay)
            s0 = plgpu.load(smw_ref.at[c, 0], layout=lay)
            s1 = plgpu.load(smw_ref.at[c, 1], layout=lay)
            if lut == "swar":
                e_lo = _lut_swar(cw & jnp.uint32(0x0F0F0F0F), cb)          # rows 0, 2, 4, 6
                e_hi = _lut_swar((cw >> 4) & jnp.uint32(0x0F0F0F0F), cb)   # rows 1, 3, 5, 7
            for k in range(ROWS):
                if lut == "swar":
                    ew = e_lo if k % 2 == 0 else e_hi
                    e = (ew >> (8 * (k // 2))) & jnp.uint32(0xFF)
                else:
                    e = _lut_select((cw >> (4 * k)) & jnp.uint32(0xF), cb)
                sw = s0 if k < 4 else s1
                s = sw >> (8 * (k % 4)) if k % 4 else sw
                out = ((s & jnp.uint32(0x80)) << 8) | (e << 7) | (s & jnp.uint32(0x7F))
                out_ref[c, k] = out.astype(jnp.uint16)

    out_type = jax.ShapeDtypeStruct((nch, ROWS, lanes), jnp.uint16)
    return plgpu.kernel(body, out_type=out_type, grid=(nch // group,), grid_names=("g",),
                        interpret=plgpu.InterpretGPUParams() if interpret else None)
