"""Mosaic GPU kernels for the SplitZip dense streams (BF16); the XLA passes around them are in escapes.py.

Why this module exists: encode/decode must run at HBM speed on the GPU that produced the KV.

Encode kernel (one program per `group` chunks; plain 16-byte vector loads/stores from GMEM, no SMEM):
  per lane i of a chunk it loads the 8 row elements, computes sm and code of each and writes one
  codes word and two sm words (layout.py). Codes: with a codebook of 16 consecutive exponents (the
  usual case) code = perm[e - lo], looked up four at a time in the bytes of a 32-bit word ("range");
  otherwise 15 compare/selects per element ("chain"). The kernel also counts the chunk's escapes
  and its escaped lanes (lanes with >= 1 escape) in one reduction, and lists up to `slots` escaped
  lanes as (lane << 8 | row mask), one max-reduction each. Ordering, capacity checks and the chunks
  with more escaped lanes than slots are handled afterwards in XLA (escapes.py).
Decode kernel: per lane, the codes word and two sm words -> 8 output elements; the 16-entry
  exponent lookup is done four codes at a time with bitwise selects ("swar") or per element with a
  tree of selects ("select"). Escapes are then patched by an in-place XLA scatter.

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


def _lut_swar(c4, table):
    """table[c] for four 4-bit values c held in the bytes of a uint32: a tree of bitwise selects
    (SWAR), four lookups per 32-bit operation instead of a gather."""
    masks = [((c4 >> b) & jnp.uint32(0x01010101)) * jnp.uint32(0xFF) for b in range(4)]
    t = [int(v) * 0x01010101 for v in table]
    level = [jnp.uint32(t[2 * j]) ^ (jnp.uint32(t[2 * j] ^ t[2 * j + 1]) & masks[0]) for j in range(8)]
    for b in range(1, 4):
        level = [level[2 * j] ^ ((level[2 * j] ^ level[2 * j + 1]) & masks[b])
                 for j in range(len(level) // 2)]
    return level[0]


def _lut_select(code, table):
    level = [jnp.uint32(v) for v in table]
    for b in range(4):
        bit = (code & jnp.uint32(1 << b)) != 0
        level = [jnp.where(bit, level[2 * j + 1], level[2 * j]) for j in range(len(level) // 2)]
    return level[0]


def _pack_bytes(vals):
    out = vals[0]
    for j in range(1, len(vals)):
        out = out | (vals[j] << (8 * j))
    return out


def resolve_lookup(cb: Codebook, lookup: str) -> str:
    if lookup == "auto":
        return "range" if cb.range_perm() is not None else "chain"
    if lookup == "range" and cb.range_perm() is None:
        raise ValueError("splitzip: lookup='range' needs a codebook of 16 consecutive exponents")
    if lookup not in ("range", "chain"):
        raise ValueError(f"splitzip: unknown lookup {lookup!r} (range, chain, auto)")
    return lookup


def encode_rows(us, cb: Codebook, lookup: str):
    """The dense encode of one chunk's 8 rows (uint32 arrays of equal shape): pure elementwise jnp,
    shared by the GPU and TPU kernels. Returns (code_word, sm_word0, sm_word1, esc_row_mask, esc_count)."""
    es = [(u >> 7) & jnp.uint32(0xFF) for u in us]
    sms = [((u >> 8) & jnp.uint32(0x80)) | (u & jnp.uint32(0x7F)) for u in us]
    if lookup == "range":
        lo, perm = cb.range_perm()
        r0 = cb.exponents[0] - lo
        rs, escs = [], []
        for e in es:
            r = e - jnp.uint32(lo)                     # wraps below lo
            esc = r > jnp.uint32(15)
            escs.append(esc)
            rs.append(jnp.where(esc, jnp.uint32(r0), r))
        c_even = _lut_swar(_pack_bytes(rs[0::2]), perm)   # rows 0, 2, 4, 6 -> low nibbles
        c_odd = _lut_swar(_pack_bytes(rs[1::2]), perm)    # rows 1, 3, 5, 7 -> high nibbles
        cw = c_even | (c_odd << 4)
    else:
        cw, escs = None, []
        for k, e in enumerate(es):
            code = jnp.zeros_like(e)
            for j in range(1, 16):
                code = jnp.where(e == jnp.uint32(cb.exponents[j]), jnp.uint32(j), code)
            escs.append((code == 0) & (e != jnp.uint32(cb.exponents[0])))
            ck = code << (4 * k) if k else code
            cw = ck if cw is None else cw | ck
    m = None
    for k, esc in enumerate(escs):
        mk = jnp.where(esc, jnp.uint32(1 << k), jnp.uint32(0))
        m = mk if m is None else m | mk
    # popcount of the 8-bit row mask
    c = m - ((m >> 1) & jnp.uint32(0x55))
    c = (c & jnp.uint32(0x33)) + ((c >> 2) & jnp.uint32(0x33))
    cnt = (c + (c >> 4)) & jnp.uint32(0x0F)
    return cw, _pack_bytes(sms[0:4]), _pack_bytes(sms[4:8]), m, cnt


@functools.lru_cache(maxsize=64)
def encode_kernel(nch: int, lanes: int, cb: Codebook, *, lookup: str = "auto", slots: int = 16,
                  group: int = 1, interpret: bool = False):
    """(x_bits uint16[nch, 8, W]) -> (sm_words u32[nch,2,W], code_words u32[nch,W],
    stats i32[nch] (escapes + escaped_lanes << 16), slots i32[nch, max(slots,1)]).

    slots[c, t] = lane << 8 | row mask of the t-th escaped lane of chunk c (lane order), for
    t < min(escaped_lanes, slots); the rest is unwritten."""
    if cb.dtype != "bfloat16":
        raise ValueError("splitzip gpu kernels handle bfloat16 only")
    if nch % group:
        raise ValueError(f"splitzip gpu: {nch} chunks not divisible by group {group}")
    lookup = resolve_lookup(cb, lookup)
    lay = _layout(lanes)
    nslot = max(slots, 1)

    def body(x_ref, smw_ref, cw_ref, st_ref, slot_ref):
        g = lax.axis_index("g")
        for q in range(group):
            c = g * group + q
            us = [plgpu.load(x_ref.at[c, k], layout=lay).astype(jnp.uint32) for k in range(ROWS)]
            cw, smw0, smw1, m, cnt = encode_rows(us, cb, lookup)
            smw_ref[c, 0] = smw0
            smw_ref[c, 1] = smw1
            cw_ref[c] = cw
            lane_hit = m != 0
            stat = jnp.sum(cnt.astype(jnp.int32) + jnp.where(lane_hit, jnp.int32(1 << 16), jnp.int32(0)))
            st_ref[c] = stat
            if slots:
                # key: reversed lane in the high bits, so a max-reduction finds the lowest lane
                rev = (lanes - 1) - lax.broadcasted_iota(jnp.int32, (lanes,), 0)
                key = (rev << 8) | m.astype(jnp.int32)
                nl = jnp.minimum(stat >> 16, slots)

                def find(t, bound):
                    v = jnp.max(jnp.where(lane_hit & (rev < bound), key, -1))
                    lane = (lanes - 1) - (v >> 8)
                    slot_ref[c, t] = (lane << 8) | (v & 0xFF)
                    return v >> 8

                lax.fori_loop(0, nl, find, jnp.int32(lanes))

    out_type = (jax.ShapeDtypeStruct((nch, 2, lanes), jnp.uint32),
                jax.ShapeDtypeStruct((nch, lanes), jnp.uint32),
                jax.ShapeDtypeStruct((nch,), jnp.int32),
                jax.ShapeDtypeStruct((nch, nslot), jnp.int32))
    return plgpu.kernel(body, out_type=out_type, grid=(nch // group,), grid_names=("g",),
                        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None)


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
                e_lo = _lut_swar(cw & jnp.uint32(0x0F0F0F0F), cb.exponents)          # rows 0,2,4,6
                e_hi = _lut_swar((cw >> 4) & jnp.uint32(0x0F0F0F0F), cb.exponents)   # rows 1,3,5,7
            for k in range(ROWS):
                if lut == "swar":
                    ew = e_lo if k % 2 == 0 else e_hi
                    e = (ew >> (8 * (k // 2))) & jnp.uint32(0xFF)
                else:
                    e = _lut_select((cw >> (4 * k)) & jnp.uint32(0xF), cb.exponents)
                sw = s0 if k < 4 else s1
                s = sw >> (8 * (k % 4)) if k % 4 else sw
                out = ((s & jnp.uint32(0x80)) << 8) | (e << 7) | (s & jnp.uint32(0x7F))
                out_ref[c, k] = out.astype(jnp.uint16)

    out_type = jax.ShapeDtypeStruct((nch, ROWS, lanes), jnp.uint16)
    return plgpu.kernel(body, out_type=out_type, grid=(nch // group,), grid_names=("g",),
                        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None)
