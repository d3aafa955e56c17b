"""The SplitZip public API: encode/decode tensors and lists of KV pages, picking an implementation.

Why this module exists: callers (serving/) should say what to compress, not how. `impl="auto"` picks
the Mosaic GPU kernels on GPU, the Mosaic TPU kernels on TPU, and the jnp reference elsewhere (and
for dtypes the kernels do not cover). Escape capacity is static on device; when a tensor has more
escapes than that (or more chunks needing the second pass), encode notices the reported overflow and
redoes the escape pass with room for all of them, or stores the tensor raw when splitting would not
make it smaller: never a silently cut stream.

impl: "auto" | "numpy" (exact host code) | "jnp" (XLA-fused reference) | "gpu" | "tpu" |
      "gpu_interpret" | "tpu_interpret" (the kernels run by the Pallas interpreters, on CPU).
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.utils import next_pow2

from . import escapes, framing, gpu, reference, tpu, tuning
from .codebook import Codebook
from .layout import DTYPES, ROWS, Encoded, Geometry, check_chunk, dtype_spec, payload_bytes, raw_bytes

IMPLS = ("auto", "numpy", "jnp", "gpu", "tpu", "gpu_interpret", "tpu_interpret")
KERNEL_IMPLS = ("gpu", "tpu", "gpu_interpret", "tpu_interpret")


def default_capacity(n_pad: int, tun: tuning.SplitZipTuning | None = None) -> int:
    """Escape slots on device for n_pad elements: the tuning row's share (1/512 of the elements), at least its
    minimum (1024), a power of two. `tun`: the row (default tuning.current())."""
    tun = tuning.current() if tun is None else tun
    return next_pow2(n_pad // tun.capacity_per, tun.capacity_min)


def choose_chunk(n: int, tun: tuning.SplitZipTuning | None = None) -> int:
    """Chunk size for n elements when the caller names none: the tuning row's large chunk (8192) from 2**20
    elements up, its small one (1024) below."""
    tun = tuning.current() if tun is None else tun
    return tun.chunk_large if n >= tun.chunk_large_from else tun.chunk_small


def _platform(x) -> str:
    if isinstance(x, jax.Array):
        try:
            return next(iter(x.devices())).platform
        except Exception:  # noqa: BLE001 - tracers etc.
            pass
    return jax.default_backend()


def resolve_impl(impl: str, x, dtype_name: str, op: str = "encode") -> str:
    if impl not in IMPLS:
        raise ValueError(f"splitzip: unknown impl {impl!r}; choose one of {IMPLS}")
    if impl == "auto":
        plat = _platform(x)
        if dtype_name != "bfloat16":
            return "jnp"
        if plat == "gpu":
            tun = tuning.current()
            return tun.gpu_encode if op == "encode" else tun.gpu_decode
        if plat == "tpu":
            return "tpu"
        return "jnp"
    if impl in KERNEL_IMPLS and dtype_name != "bfloat16":
        raise ValueError(f"splitzip: the {impl} kernels handle bfloat16 only; use impl='jnp' or "
                         f"'auto' for {dtype_name}")
    return impl


def _check_x(x):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"splitzip: expected an array, got {type(x).__name__}")
    return dtype_spec(x.dtype)


def _check_cb(spec, codebook):
    if not spec.split:
        return
    if codebook is None:
        raise ValueError(f"splitzip: encoding {spec.name} needs a codebook (Codebook.calibrate)")
    if not isinstance(codebook, Codebook):
        raise TypeError(f"splitzip: codebook must be a Codebook, got {type(codebook).__name__}")
    if codebook.dtype != spec.name:
        raise ValueError(f"splitzip: codebook is for {codebook.dtype}, tensor is {spec.name}")


@functools.partial(jax.jit, static_argnames=("cb", "chunk", "impl", "capacity", "cap_rows", "opts"))
def _encode_device(x, *, cb: Codebook, chunk: int, impl: str, capacity: int, cap_rows: int,
                   opts: tuple):
    spec = dtype_spec(x.dtype)
    geo = Geometry(x.size, chunk)
    nch, w = geo.num_chunks, geo.lanes
    u = reference.to_bits(x, spec, cb, geo)
    o = {**tuning.current().encode_opts(), **dict(opts)}   # encode() passes every option: no trace hides a row
    if impl == "jnp":
        sm_words, code_words, counts, e, esc = reference.dense_encode_jnp(u, spec, cb, geo)
        n_esc = jnp.sum(counts)
        (gp,) = jnp.nonzero(esc.reshape(-1), size=capacity, fill_value=0)
        live = jnp.arange(capacity) < n_esc
        pos = jnp.where(live, (gp % chunk).astype(jnp.int32), 0)
        val = jnp.where(live, e.reshape(-1)[gp].astype(jnp.int32), 0)
        status = (n_esc > capacity).astype(jnp.int32)
        return sm_words, code_words, counts, pos, val, n_esc, status, jnp.int32(0)
    u3 = u.reshape(nch, ROWS, w)
    if impl in ("gpu", "gpu_interpret"):
        slots = o["slots"]
        kern = gpu.encode_kernel(nch, w, cb, lookup=o["lookup"], slots=slots, group=o["group"],
                                 interpret=impl == "gpu_interpret")
        sm_words, code_words, stats, slot_arr = kern(u3)
        counts, lanes_hit = stats & 0xFFFF, stats >> 16
        slot_arr = slot_arr if slots else None
    else:
        kern = tpu.encode_kernel(nch, w, cb, lookup=o["lookup"],
                                 interpret=impl == "tpu_interpret")
        smw2, code_words, cnt = kern(u.reshape(nch * ROWS, w))
        sm_words = smw2.reshape(nch, 2, w)
        counts = lanes_hit = cnt[:, 0]
        slot_arr = None
    pos, val, n_esc, status, n_second = escapes.escape_stream(
        u3, counts, lanes_hit, slot_arr, cb, capacity=capacity, cap_rows=cap_rows)
    return sm_words, code_words, counts, pos, val, n_esc, status, n_second


def _raw_encoded(x, spec, chunk, codebook, on_host: bool) -> Encoded:
    if on_host or isinstance(x, np.ndarray):
        raw = np.ascontiguousarray(np.asarray(x)).reshape(-1).view(spec.uint_dtype)
    else:
        raw = jax.lax.bitcast_convert_type(jnp.asarray(x).reshape(-1),
                                           jnp.uint16 if spec.bits == 16 else jnp.uint8)
    return Encoded("raw", spec.name, tuple(x.shape), chunk, raw=raw,
                   codebook_hash=codebook.hash if codebook is not None else b"")


def encode(x, codebook: Codebook | None, impl: str = "auto", chunk: int | None = None, *,
           capacity: int | None = None, cap_rows: int | None = None, allow_raw: bool = True,
           **opts) -> Encoded:
    """Encode one tensor (bfloat16 / float8_e5m2 split; float8_e4m3fn passes through raw).

    chunk: a power of two in [1024, 32768]; None picks by size (choose_chunk).
    Returns an Encoded whose arrays live on the device for device impls (escape arrays padded to a
    static capacity; `n_esc` is exact) and on the host for impl="numpy". allow_raw=False keeps the
    split format even when it is larger than raw (tests). Kernel options (GPU; they replace the tuning row's,
    tuning.py): lookup="auto"|"range"|"chain", slots=int, group=int.
    """
    tun = tuning.current()
    spec = _check_x(x)
    n = int(np.prod(x.shape, dtype=np.int64))
    chunk = check_chunk(choose_chunk(n, tun) if chunk is None else chunk)
    _check_cb(spec, codebook)
    impl = resolve_impl(impl, x, spec.name, "encode")
    geo = Geometry(n, chunk)
    if geo.n_pad >= 2**31:
        raise ValueError(f"splitzip: {geo.n} elements is too many for one stream (< 2**31); "
                         "encode the tensor in parts")
    if not spec.split:
        return _raw_encoded(x, spec, chunk, codebook, impl == "numpy")
    if impl == "numpy":
        enc = reference.encode_np(np.asarray(x), codebook, chunk)
        if allow_raw and enc.nbytes() >= raw_bytes(spec, geo.n):
            return _raw_encoded(x, spec, chunk, codebook, True)
        return enc
    x = jnp.asarray(x)
    capacity = next_pow2(capacity, tun.capacity_min) if capacity else default_capacity(geo.n_pad, tun)
    if cap_rows is None:
        cap_rows = min(geo.num_chunks, 64)
    if impl in ("tpu", "tpu_interpret"):
        cap_rows = geo.num_chunks          # the TPU kernel lists no escapes itself
    opts_t = tuple(sorted({**tun.encode_opts(), **opts}.items()))
    for attempt in range(2):
        out = _encode_device(x, cb=codebook, chunk=chunk, impl=impl, capacity=capacity,
                             cap_rows=cap_rows, opts=opts_t)
        n_esc, status, n_second = (int(v) for v in jax.device_get(out[5:8]))
        if allow_raw and payload_bytes(spec, geo, n_esc) >= raw_bytes(spec, geo.n):
            return _raw_encoded(x, spec, chunk, codebook, False)
        if status == 0:
            break
        if attempt == 1:
            raise RuntimeError(f"splitzip: escape pass overflowed twice (status {status})")
        # Second try with room for every escape / every second-pass chunk.
        capacity = max(capacity, next_pow2(n_esc, tun.capacity_min))
        cap_rows = min(geo.num_chunks, max(cap_rows, next_pow2(n_second)))
    sm_words, code_words, counts, pos, val = out[:5]
    return Encoded("split", spec.name, tuple(x.shape), chunk, n_esc=n_esc, sm_words=sm_words,
                   code_words=code_words, counts=counts, esc_pos=pos, esc_val=val,
                   codebook_hash=codebook.hash)


@functools.partial(jax.jit, static_argnames=("cb", "dtype", "shape", "chunk", "impl", "opts"))
def _decode_device(sm_words, code_words, counts, esc_pos, esc_val, n_esc, *, cb, dtype, shape,
                   chunk, impl, opts):
    spec = DTYPES[dtype]
    geo = Geometry(int(np.prod(shape, dtype=np.int64)) if shape else 1, chunk)
    nch, w = geo.num_chunks, geo.lanes
    o = {**tuning.current().decode_opts(), **dict(opts)}   # decode() passes every option: no trace hides a row
    if impl == "jnp":
        u = reference.dense_decode_jnp(sm_words, code_words, spec, cb, geo)
    elif impl in ("gpu", "gpu_interpret"):
        kern = gpu.decode_kernel(nch, w, cb, lut=o["lut"], group=o["group"],
                                 interpret=impl == "gpu_interpret")
        u = kern(sm_words.reshape(nch, 2, w), code_words.reshape(nch, w)).reshape(-1)
    else:
        kern = tpu.decode_kernel(nch, w, cb, interpret=impl == "tpu_interpret")
        u = kern(sm_words.reshape(2 * nch, w), code_words.reshape(nch, w)).reshape(-1)
    u = reference.apply_escapes_jnp(u, counts, esc_pos, esc_val, n_esc, sm_words, spec, chunk)
    return reference.from_bits(u, spec, shape, geo.n)


def _check_enc(enc, codebook):
    if not isinstance(enc, Encoded):
        raise TypeError(f"splitzip: decode expects an Encoded, got {type(enc).__name__}")
    if enc.kind == "split":
        if codebook is None:
            raise ValueError("splitzip: decoding a split stream needs its codebook")
        if not isinstance(codebook, Codebook):
            raise TypeError(f"splitzip: codebook must be a Codebook, got {type(codebook).__name__}")
        if enc.codebook_hash and codebook.hash != enc.codebook_hash:
            raise ValueError(f"splitzip: wrong codebook: stream was encoded with "
                             f"{enc.codebook_hash.hex()}, got {codebook.hash.hex()}")
        if codebook.dtype != enc.dtype:
            raise ValueError(f"splitzip: codebook is for {codebook.dtype}, stream holds {enc.dtype}")


def decode(enc: Encoded, codebook: Codebook | None, impl: str = "auto", **opts):
    """Decode an Encoded back to its tensor (numpy for impl="numpy", else a jax.Array). GPU kernel options
    (lut="swar"|"select", group=int) replace the tuning row's (tuning.py)."""
    _check_enc(enc, codebook)
    spec = DTYPES[enc.dtype]
    impl = resolve_impl(impl, enc.code_words if enc.kind == "split" else enc.raw, enc.dtype, "decode")
    if enc.kind == "raw":
        if impl == "numpy":
            return np.asarray(enc.raw).view(np.dtype(spec.name)).reshape(enc.shape)
        raw = jnp.asarray(enc.raw)
        return jax.lax.bitcast_convert_type(raw, jnp.dtype(spec.name)).reshape(enc.shape)
    if impl == "numpy":
        return reference.decode_np(enc, codebook)
    n_esc = int(enc.n_esc)
    pos, val = enc.esc_pos, enc.esc_val
    if pos.shape[0] < max(n_esc, 1) or not isinstance(pos, jax.Array):
        cap = next_pow2(n_esc, 1024)
        p = np.zeros(cap, np.int32)
        v = np.zeros(cap, np.int32)
        p[:n_esc] = np.asarray(pos)[:n_esc]
        v[:n_esc] = np.asarray(val)[:n_esc]
        pos, val = p, v
    return _decode_device(jnp.asarray(enc.sm_words), jnp.asarray(enc.code_words),
                          jnp.asarray(enc.counts).astype(jnp.int32), jnp.asarray(pos).astype(jnp.int32),
                          jnp.asarray(val).astype(jnp.int32), jnp.int32(n_esc), cb=codebook,
                          dtype=enc.dtype, shape=tuple(enc.shape), chunk=enc.chunk, impl=impl,
                          opts=tuple(sorted({**tuning.current().decode_opts(), **opts}.items())))


# ----------------------------------------------------------------------------------------------
# KV pages <-> one framed buffer
# ----------------------------------------------------------------------------------------------
def encode_pages(pages: Sequence, codebook: Codebook | None, impl: str = "auto",
                 chunk: int | None = None, *, embed_codebook: bool = True, **opts) -> bytes:
    """Encode the pages of one layer (same dtype, any shapes) into one framed buffer."""
    if isinstance(pages, (np.ndarray, jax.Array)) or not isinstance(pages, Sequence):
        raise TypeError("splitzip: encode_pages expects a list of page arrays")
    if len(pages) == 0:
        raise ValueError("splitzip: encode_pages needs at least one page")
    dts = {np.dtype(p.dtype).name for p in pages}
    if len(dts) != 1:
        raise TypeError(f"splitzip: pages mix dtypes {sorted(dts)}")
    spec = _check_x(pages[0])
    shapes = [tuple(int(d) for d in p.shape) for p in pages]
    if all(isinstance(p, np.ndarray) for p in pages):
        flat = np.concatenate([p.reshape(-1) for p in pages])
    else:
        flat = jnp.concatenate([jnp.asarray(p).reshape(-1) for p in pages])
    enc = encode(flat, codebook if spec.split else codebook, impl, chunk, **opts)
    return framing.frame(enc, shapes, codebook if spec.split else None, embed_codebook)


def decode_pages(buf, codebook: Codebook | None = None, impl: str = "auto", **opts) -> list:
    """Inverse of encode_pages. `codebook` None uses the one embedded in the buffer (if any);
    a given codebook must match the buffer's codebook hash."""
    fr = framing.parse(buf, codebook)
    cb = codebook if codebook is not None else fr.codebook
    flat = decode(fr.enc, cb, impl, **opts)
    out = []
    off = 0
    for shp in fr.page_shapes:
        size = int(np.prod(shp, dtype=np.int64)) if shp else 1
        out.append(flat[off: off + size].reshape(shp))
        off += size
    return out
