"""Moving whole KV pages between the device pools and the host: the engine half of prefill/decode disaggregation.

A prefill engine gathers a finished prompt's pages out of its pools (``gather_pages``) so they can travel; a
decode engine scatters received pages into pages it reserved (``scatter_pages``). Both are one jitted program
over all layers (one device round trip per request, not one per layer or page), and the number of pages is
padded to a power of two so that steady state compiles nothing new. Padding ids point at the null page
(page 0), whose contents are never read, so scattering zeros there is harmless.

Pools are the engine's ``caches``: a list over layers of ``(pages_PGKH, scales_PK | None)``.

The transfer layout is one array over all layers: ``gather_pages_stacked`` leaves ``[X, L, G, 2K, H]`` (X = the
page count padded to a power of two) on the device, so a same-host transfer can DMA it straight into shared host
memory, and ``scatter_pages_stacked`` takes such an array (device or host) back. ``chunk_checksums`` is the
integrity check of that fast path: crc32 on the host runs ~1-2 GB/s, far below the ~50 GB/s the copies move, so
the pages are checksummed where they are, on the device, by a position-weighted sum of 32-bit words (per chunk:
``a = sum(w_i)``, ``b = sum(w_i * ((i * 0x9E3779B1) | 1))`` mod 2^32; the odd weights make every single-bit flip
change ``b``, the position weights catch swapped words). It is a checksum, not crc32: it detects corruption and
misplaced data, not deliberate tampering.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.utils import next_pow2

NULL_PAGE = 0


@jax.jit
def _gather(caches, ids_X):
    return [(pages[ids_X], None if scales is None else scales[ids_X]) for pages, scales in caches]


def _scatter_impl(caches, ids_X, new):
    out = []
    for (pages, scales), (p_new, s_new) in zip(caches, new):
        pages = pages.at[ids_X].set(p_new.astype(pages.dtype))
        if scales is not None:
            scales = scales.at[ids_X].set(s_new.astype(scales.dtype))
        out.append((pages, scales))
    return out


_scatter = jax.jit(_scatter_impl, donate_argnums=(0,))


def _check_ids(page_ids, num_pages: int) -> np.ndarray:
    ids = np.asarray(list(page_ids), np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"page ids must be a non-empty list of ints, got {page_ids!r}")
    bad = ids[(ids < 1) | (ids >= num_pages)]
    if bad.size:
        raise ValueError(f"page ids {bad[:5].tolist()} are outside the pool's usable pages 1..{num_pages - 1}")
    if np.unique(ids).size != ids.size:
        raise ValueError(f"page ids repeat: {ids.tolist()[:16]}")
    return ids


def gather_pages(caches, page_ids) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Host copies of ``page_ids`` from every layer: (list over layers of [n, G, 2K, H], fp8 scales [n, 2K] per
    layer or None)."""
    n_pool = caches[0][0].shape[0]
    ids = _check_ids(page_ids, n_pool)
    n = ids.size
    ids_X = np.full(next_pow2(n), NULL_PAGE, np.int32)
    ids_X[:n] = ids
    got = jax.device_get(_gather(caches, ids_X))
    pages = [np.asarray(p[:n]) for p, _ in got]
    scales = None if got[0][1] is None else [np.asarray(s[:n]) for _, s in got]
    return pages, scales


def scatter_pages(caches, page_ids, layer_pages, layer_scales=None):
    """New ``caches`` with ``layer_pages[l][i]`` (and scales) written at page ``page_ids[i]`` of layer ``l``. The
    old pools are donated: use only the returned ones."""
    n_pool = caches[0][0].shape[0]
    ids = _check_ids(page_ids, n_pool)
    n = ids.size
    if len(layer_pages) != len(caches):
        raise ValueError(f"got pages for {len(layer_pages)} layers, the pools have {len(caches)}")
    fp8 = caches[0][1] is not None
    if fp8 and (layer_scales is None or len(layer_scales) != len(caches)):
        raise ValueError("the pools are fp8: pass layer_scales (one [n, 2K] array per layer)")
    if not fp8 and layer_scales is not None:
        raise ValueError("the pools carry no scales (not fp8), but layer_scales was given")
    X = next_pow2(n)
    ids_X = np.full(X, NULL_PAGE, np.int32)
    ids_X[:n] = ids
    new = []
    for l, ((pages, scales), p) in enumerate(zip(caches, layer_pages)):
        p = np.asarray(p)
        want = (n, *pages.shape[1:])
        if p.shape != want:
            raise ValueError(f"layer {l}: pages have shape {p.shape}, expected {want}")
        if p.dtype != pages.dtype:
            raise ValueError(f"layer {l}: pages are {p.dtype}, the pool is {pages.dtype}")
        pad = np.zeros((X, *pages.shape[1:]), p.dtype)
        pad[:n] = p
        s_pad = None
        if fp8:
            s = np.asarray(layer_scales[l], np.float32)
            if s.shape != (n, *scales.shape[1:]):
                raise ValueError(f"layer {l}: scales have shape {s.shape}, expected {(n, *scales.shape[1:])}")
            s_pad = np.zeros((X, *scales.shape[1:]), np.float32)
            s_pad[:n] = s
        new.append((pad, s_pad))
    return _scatter(caches, ids_X, new)


# -- the stacked (transfer) layout -------------------------------------------------------------------------
@jax.jit
def _gather_stacked(caches, ids_X):
    pages_XLGKH = jnp.stack([pages[ids_X] for pages, _ in caches], axis=1)
    scales_XLK = None if caches[0][1] is None else jnp.stack([scales[ids_X] for _, scales in caches], axis=1)
    return pages_XLGKH, scales_XLK


def gather_pages_stacked(caches, page_ids):
    """``page_ids`` of every layer as one device array ``[X, L, G, 2K, H]`` (rows past ``len(page_ids)`` are
    padding: X is a power of two) and fp8 scales ``[X, L, 2K]`` (or None). Nothing leaves the device."""
    ids = _check_ids(page_ids, caches[0][0].shape[0])
    ids_X = np.full(next_pow2(ids.size), NULL_PAGE, np.int32)
    ids_X[:ids.size] = ids
    return _gather_stacked(caches, ids_X)


def _scatter_stacked_impl(caches, ids_X, pages_XLGKH, scales_XLK):
    out = []
    for l, (pages, scales) in enumerate(caches):
        pages = pages.at[ids_X].set(pages_XLGKH[:, l].astype(pages.dtype))
        if scales is not None:
            scales = scales.at[ids_X].set(scales_XLK[:, l].astype(scales.dtype))
        out.append((pages, scales))
    return out


_scatter_stacked = jax.jit(_scatter_stacked_impl, donate_argnums=(0,))


def _pad_rows(x, X):
    if x.shape[0] == X:
        return x
    if isinstance(x, np.ndarray):
        out = np.zeros((X, *x.shape[1:]), x.dtype)
        out[:x.shape[0]] = x
        return out
    return jnp.pad(x, [(0, X - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def scatter_pages_stacked(caches, page_ids, pages_nLGKH, scales_nLK=None):
    """New ``caches`` with ``pages_nLGKH[i, l]`` written at page ``page_ids[i]`` of layer ``l`` (fp8: scales
    ``[n, L, 2K]`` too). The array may be on the device or the host and may carry padding rows past
    ``len(page_ids)`` (ignored: they land on the null page). The old pools are donated."""
    ids = _check_ids(page_ids, caches[0][0].shape[0])
    n, L = ids.size, len(caches)
    pages0, scales0 = caches[0]
    want = (L, *pages0.shape[1:])
    if pages_nLGKH.ndim != 1 + len(want) or tuple(pages_nLGKH.shape[1:]) != want or pages_nLGKH.shape[0] < n:
        raise ValueError(f"pages have shape {tuple(pages_nLGKH.shape)}, expected [>= {n}, *{list(want)}]")
    if np.dtype(pages_nLGKH.dtype) != np.dtype(pages0.dtype):
        raise ValueError(f"pages are {pages_nLGKH.dtype}, the pool is {pages0.dtype}")
    fp8 = scales0 is not None
    if fp8 and scales_nLK is None:
        raise ValueError("the pools are fp8: pass the scales ([n, L, 2K] float32)")
    if not fp8 and scales_nLK is not None:
        raise ValueError("the pools carry no scales (not fp8), but scales were given")
    X = next_pow2(max(n, pages_nLGKH.shape[0]))
    ids_X = np.full(X, NULL_PAGE, np.int32)
    ids_X[:n] = ids
    if fp8:
        if tuple(scales_nLK.shape[1:]) != (L, *scales0.shape[1:]) or scales_nLK.shape[0] < n:
            raise ValueError(f"scales have shape {tuple(scales_nLK.shape)}, expected [>= {n}, {L}, "
                             f"{scales0.shape[1]}]")
        scales_nLK = _pad_rows(scales_nLK, X)
    return _scatter_stacked(caches, ids_X, _pad_rows(pages_nLGKH, X), scales_nLK)


# -- checksum of the fast path (on the device) ---------------------------------------------------------------
_GOLDEN = 0x9E3779B1


def _words(x):
    """Flat uint32 words of any array of 1-, 2- or 4-byte items (no copy on the device)."""
    isz = np.dtype(x.dtype).itemsize
    flat = x.reshape(-1)
    if isz == 4:
        return jax.lax.bitcast_convert_type(flat, jnp.uint32)
    if isz not in (1, 2) or flat.shape[0] % (4 // isz):
        raise ValueError(f"cannot checksum {x.dtype} x {flat.shape[0]} as 32-bit words")
    return jax.lax.bitcast_convert_type(flat.reshape(-1, 4 // isz), jnp.uint32)


@functools.partial(jax.jit, static_argnames=("chunk_pages",))
def _chunk_checksums(x, n, *, chunk_pages):
    X = x.shape[0]
    w = _words(x).reshape(X, -1)
    pw = w.shape[1]
    w = jnp.where((jnp.arange(X) < n)[:, None], w, jnp.uint32(0))
    C = -(-X // chunk_pages)
    w = jnp.pad(w, [(0, C * chunk_pages - X), (0, 0)]).reshape(C, chunk_pages * pw)
    mult = (jnp.arange(chunk_pages * pw, dtype=jnp.uint32) * jnp.uint32(_GOLDEN)) | jnp.uint32(1)
    a = jnp.sum(w, axis=1, dtype=jnp.uint32)
    b = jnp.sum(w * mult, axis=1, dtype=jnp.uint32)
    return jnp.stack([a, b], axis=1)


def chunk_checksums(pages, n: int, chunk_pages: int) -> list[int]:
    """64-bit checksums (``b << 32 | a``, see the module docstring) of the chunks ``[j*c, j*c + c)`` of the first
    ``n`` rows of ``pages`` (rows past ``n`` count as absent). Runs where ``pages`` lives (one device program)."""
    if chunk_pages < 1:
        raise ValueError(f"chunk_pages must be >= 1, got {chunk_pages}")
    ab = np.asarray(jax.device_get(_chunk_checksums(pages, np.int32(n), chunk_pages=int(chunk_pages))))
    C = -(-int(n) // chunk_pages)
    return [(int(b) << 32) | int(a) for a, b in ab[:C].astype(np.uint64)]


def checksum_reference(pages: np.ndarray) -> int:
    """The same checksum of a whole host array in plain numpy (uint64 math, reduced mod 2^32): tests' reference."""
    b = np.ascontiguousarray(pages).view(np.uint8).reshape(-1)
    w = b.view(np.uint32).astype(np.uint64)
    i = np.arange(w.size, dtype=np.uint64)
    mult = ((i * np.uint64(_GOLDEN)) % np.uint64(1 << 32)) | np.uint64(1)
    a = int(w.sum() % (1 << 32))
    bb = int(((w * mult) % np.uint64(1 << 32)).sum() % (1 << 32))
    return (bb << 32) | a


__all__ = ["gather_pages", "scatter_pages", "gather_pages_stacked", "scatter_pages_stacked", "chunk_checksums",
           "checksum_reference"]
