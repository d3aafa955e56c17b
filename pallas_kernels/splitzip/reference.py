"""Reference SplitZip encoder/decoder in numpy and in jnp: the definition the kernels are checked against.

Why this module exists: it states the codec as plainly as possible (bit fields, a table lookup, a
nonzero for the escapes), so that it is bit-exact by construction. numpy versions are exact for any
number of escapes; the jnp versions are jittable with a static escape capacity and report the true
escape count, so a caller can see (and redo) an overflow instead of getting a silently cut stream.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .codebook import Codebook
from .layout import DTYPES, ROWS, DtypeSpec, Encoded, Geometry, check_chunk, dtype_spec


def _filler(spec: DtypeSpec, cb: Codebook) -> int:
    """Padding element: sign 0, mantissa 0, exponent of code 0 (never escapes)."""
    return cb.exponents[0] << spec.exp_shift


def _check_codebook(spec: DtypeSpec, cb: Codebook) -> None:
    if not isinstance(cb, Codebook):
        raise TypeError(f"splitzip: codebook must be a Codebook, got {type(cb).__name__}")
    if cb.dtype != spec.name:
        raise ValueError(f"splitzip: codebook is for {cb.dtype}, tensor is {spec.name}")


# ----------------------------------------------------------------------------------------------
# numpy
# ----------------------------------------------------------------------------------------------
def _fields_np(u: np.ndarray, spec: DtypeSpec):
    u = u.astype(np.uint32)
    e = (u >> spec.exp_shift) & ((1 << spec.exp_bits) - 1)
    sm = ((u >> spec.sign_shift) << spec.man_bits) | (u & ((1 << spec.man_bits) - 1))
    return e, sm


def pack_sm_np(sm_ckw: np.ndarray, spec: DtypeSpec) -> np.ndarray:
    """sm[nch, 8, W] -> sm words (bf16: uint32[nch, 2, W]; e5m2: uint32[nch, W])."""
    nch, _, w = sm_ckw.shape
    sm = sm_ckw.astype(np.uint32)
    if spec.bits == 16:
        words = np.zeros((nch, 2, w), np.uint32)
        for k in range(ROWS):
            words[:, k // 4] |= sm[:, k] << (8 * (k % 4))
        return words
    words = np.zeros((nch, w), np.uint32)
    for k in range(ROWS):
        words |= sm[:, k] << (3 * k)
    return words


def unpack_sm_np(words: np.ndarray, spec: DtypeSpec) -> np.ndarray:
    w = words.astype(np.uint32)
    if spec.bits == 16:
        return np.stack([(w[:, k // 4] >> (8 * (k % 4))) & 0xFF for k in range(ROWS)], axis=1)
    return np.stack([(w >> (3 * k)) & 0x7 for k in range(ROWS)], axis=1)


def encode_np(x, codebook: Codebook, chunk: int) -> Encoded:
    """Exact host encoder (any number of escapes)."""
    x = np.asarray(x)
    spec = dtype_spec(x.dtype)
    chunk = check_chunk(chunk)
    if not spec.split:
        return Encoded("raw", spec.name, tuple(x.shape), chunk,
                       raw=np.ascontiguousarray(x).reshape(-1).view(spec.uint_dtype).copy(),
                       codebook_hash=codebook.hash if codebook is not None else b"")
    _check_codebook(spec, codebook)
    geo = Geometry(x.size, chunk)
    u = np.full(geo.n_pad, _filler(spec, codebook), spec.uint_dtype)
    u[: x.size] = np.ascontiguousarray(x).reshape(-1).view(spec.uint_dtype)
    e, sm = _fields_np(u, spec)
    table = codebook.lookup_table()
    code = table[e]
    esc = code < 0
    code = np.where(esc, 0, code).astype(np.uint32)
    nch, w = geo.num_chunks, geo.lanes
    code_k = code.reshape(nch, ROWS, w)
    code_words = np.zeros((nch, w), np.uint32)
    for k in range(ROWS):
        code_words |= code_k[:, k] << (4 * k)
    gp = np.nonzero(esc)[0]
    return Encoded(
        "split", spec.name, tuple(x.shape), chunk, n_esc=int(gp.size),
        sm_words=pack_sm_np(sm.reshape(nch, ROWS, w), spec), code_words=code_words,
        counts=esc.reshape(nch, chunk).sum(axis=1).astype(np.int32),
        esc_pos=(gp % chunk).astype(np.uint16), esc_val=e[gp].astype(np.uint8),
        codebook_hash=codebook.hash)


def escape_chunks_np(counts: np.ndarray, n_esc: int) -> np.ndarray:
    counts = np.asarray(counts).astype(np.int64)
    return np.repeat(np.arange(counts.size), counts)[:n_esc]


def decode_np(enc: Encoded, codebook: Codebook) -> np.ndarray:
    """Exact host decoder."""
    spec = DTYPES[enc.dtype]
    if enc.kind == "raw":
        return np.asarray(enc.raw).view(np.dtype(spec.name)).reshape(enc.shape).copy()
    _check_codebook(spec, codebook)
    geo = enc.geometry
    nch, w = geo.num_chunks, geo.lanes
    cw = np.asarray(enc.code_words).astype(np.uint32).reshape(nch, w)
    code = np.stack([(cw >> (4 * k)) & 0xF for k in range(ROWS)], axis=1)
    e = codebook.array.astype(np.uint32)[code]
    sm = unpack_sm_np(np.asarray(enc.sm_words), spec)
    u = ((sm >> spec.man_bits) << spec.sign_shift) | (e << spec.exp_shift) | (
        sm & ((1 << spec.man_bits) - 1))
    u = u.reshape(-1)
    n_esc = int(enc.n_esc)
    if n_esc:
        ch = escape_chunks_np(enc.counts, n_esc)
        gp = ch * geo.chunk + np.asarray(enc.esc_pos)[:n_esc].astype(np.int64)
        keep = ~np.uint32(spec.exp_mask)
        u[gp] = (u[gp] & keep) | (np.asarray(enc.esc_val)[:n_esc].astype(np.uint32) << spec.exp_shift)
    return u[: enc.n].astype(spec.uint_dtype).view(np.dtype(spec.name)).reshape(enc.shape)


# ----------------------------------------------------------------------------------------------
# jnp (jittable; static escape capacity)
# ----------------------------------------------------------------------------------------------
def to_bits(x: jax.Array, spec: DtypeSpec, cb: Codebook, geo: Geometry) -> jax.Array:
    """Flattened, padded uint16/uint8 view [n_pad]."""
    udt = jnp.uint16 if spec.bits == 16 else jnp.uint8
    u = jax.lax.bitcast_convert_type(x.reshape(-1), udt)
    pad = geo.n_pad - geo.n
    if pad:
        u = jnp.concatenate([u, jnp.full((pad,), _filler(spec, cb), udt)])
    return u


def code_of(e: jax.Array, cb: Codebook):
    """(code uint32, escaped bool) of exponents e via 16 compares (no gather)."""
    code = jnp.zeros(e.shape, jnp.uint32)
    hit = e == cb.exponents[0]
    for j in range(1, 16):
        m = e == cb.exponents[j]
        code = jnp.where(m, jnp.uint32(j), code)
        hit = hit | m
    return code, ~hit


def exp_of(code: jax.Array, cb: Codebook) -> jax.Array:
    """16-entry lookup written as a binary tree of selects on the code bits."""
    level = [jnp.uint32(e) for e in cb.exponents]
    for b in range(4):
        bit = ((code >> b) & 1) == 1
        level = [jnp.where(bit, level[2 * j + 1], level[2 * j]) for j in range(len(level) // 2)]
    return jnp.broadcast_to(level[0], code.shape).astype(jnp.uint32)


def dense_encode_jnp(u: jax.Array, spec: DtypeSpec, cb: Codebook, geo: Geometry):
    """Dense streams and per-chunk escape counts from the padded bits u[n_pad]."""
    nch, w = geo.num_chunks, geo.lanes
    v = u.reshape(nch, ROWS, w).astype(jnp.uint32)
    e = (v >> spec.exp_shift) & ((1 << spec.exp_bits) - 1)
    sm = ((v >> spec.sign_shift) << spec.man_bits) | (v & ((1 << spec.man_bits) - 1))
    code, esc = code_of(e, cb)
    shifts = jnp.arange(ROWS, dtype=jnp.uint32)
    code_words = jnp.sum(code << (4 * shifts)[None, :, None], axis=1, dtype=jnp.uint32)
    if spec.bits == 16:
        smr = sm.reshape(nch, 2, 4, w)
        sm_words = jnp.sum(smr << (8 * jnp.arange(4, dtype=jnp.uint32))[None, None, :, None],
                           axis=2, dtype=jnp.uint32)
    else:
        sm_words = jnp.sum(sm << (3 * shifts)[None, :, None], axis=1, dtype=jnp.uint32)
    counts = jnp.sum(esc, axis=(1, 2), dtype=jnp.int32)
    return sm_words, code_words, counts, e, esc


@functools.partial(jax.jit, static_argnames=("cb", "chunk", "capacity"))
def encode_jnp_arrays(x, cb: Codebook, chunk: int, capacity: int):
    """-> (sm_words, code_words, counts, esc_pos int32[cap], esc_val int32[cap], n_esc int32)."""
    spec = dtype_spec(x.dtype)
    geo = Geometry(x.size, chunk)
    u = to_bits(x, spec, cb, geo)
    sm_words, code_words, counts, e, esc = dense_encode_jnp(u, spec, cb, geo)
    n_esc = jnp.sum(counts)
    (gp,) = jnp.nonzero(esc.reshape(-1), size=capacity, fill_value=0)
    pos = (gp % chunk).astype(jnp.int32)
    val = e.reshape(-1)[gp].astype(jnp.int32)
    valid = jnp.arange(capacity) < n_esc
    return (sm_words, code_words, counts, jnp.where(valid, pos, 0), jnp.where(valid, val, 0), n_esc)


def dense_decode_jnp(sm_words, code_words, spec: DtypeSpec, cb: Codebook, geo: Geometry):
    """Bits [n_pad] (uint32) with code-0 exponents at escapes."""
    nch, w = geo.num_chunks, geo.lanes
    cw = code_words.astype(jnp.uint32).reshape(nch, 1, w)
    code = (cw >> (4 * jnp.arange(ROWS, dtype=jnp.uint32))[None, :, None]) & 0xF
    e = exp_of(code, cb)
    smw = sm_words.astype(jnp.uint32)
    if spec.bits == 16:
        smw = smw.reshape(nch, 2, 1, w)
        sm = ((smw >> (8 * jnp.arange(4, dtype=jnp.uint32))[None, None, :, None]) & 0xFF)
        sm = sm.reshape(nch, ROWS, w)
    else:
        sm = (smw.reshape(nch, 1, w) >> (3 * jnp.arange(ROWS, dtype=jnp.uint32))[None, :, None]) & 0x7
    u = ((sm >> spec.man_bits) << spec.sign_shift) | (e << spec.exp_shift) | (
        sm & ((1 << spec.man_bits) - 1))
    return u.reshape(-1)


def escape_chunk_ids(counts, cap: int):
    """Chunk index of every escape slot s < sum(counts) (garbage beyond): the largest chunk whose
    first slot is <= s. A scatter-max of chunk ids at each chunk's first slot, then a running max."""
    counts = counts.astype(jnp.int32)
    nch = counts.shape[0]
    excl = jnp.cumsum(counts) - counts
    first = jnp.zeros((cap,), jnp.int32).at[excl].max(jnp.arange(nch, dtype=jnp.int32), mode="drop")
    return jax.lax.cummax(first)


def apply_escapes_jnp(u, counts, esc_pos, esc_val, n_esc, sm_words, spec: DtypeSpec, chunk: int):
    """Write the escaped elements into u[n_pad] (uint32 or the element uint type), in place.

    The new value is rebuilt from the sm stream (not read back from u), so XLA can update u in place
    instead of copying it.
    """
    cap = esc_pos.shape[0]
    if cap == 0:
        return u
    n_pad = u.shape[0]
    w = chunk // ROWS
    ch = escape_chunk_ids(counts, cap)
    p = esc_pos.astype(jnp.int32)
    k, i = p // w, p % w
    s = jnp.arange(cap, dtype=jnp.int32)
    valid = s < n_esc
    smw = sm_words.reshape(-1)
    if spec.bits == 16:
        word = smw[jnp.where(valid, (ch * 2 + k // 4) * w + i, 0)].astype(jnp.uint32)
        sm = (word >> (8 * (k % 4)).astype(jnp.uint32)) & 0xFF
    else:
        word = smw[jnp.where(valid, ch * w + i, 0)].astype(jnp.uint32)
        sm = (word >> (3 * k).astype(jnp.uint32)) & 0x7
    new = ((sm >> spec.man_bits) << spec.sign_shift) | (esc_val.astype(jnp.uint32) << spec.exp_shift) | (
        sm & ((1 << spec.man_bits) - 1))
    idx = jnp.where(valid, ch * chunk + p, n_pad)
    return u.at[idx].set(new.astype(u.dtype), mode="drop", unique_indices=True, indices_are_sorted=True)


def from_bits(u, spec: DtypeSpec, shape, n: int):
    udt = jnp.uint16 if spec.bits == 16 else jnp.uint8
    dt = jnp.dtype(spec.name)
    return jax.lax.bitcast_convert_type(u[:n].astype(udt), dt).reshape(shape)
