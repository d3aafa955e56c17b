"""Moving whole KV pages between the device pools and the host: the engine half of prefill/decode disaggregation.

A prefill engine gathers a finished prompt's pages out of its pools (``gather_pages``) so they can travel; a
decode engine scatters received pages into pages it reserved (``scatter_pages``). Both are one jitted program
over all layers (one device round trip per request, not one per layer or page), and the number of pages is
padded to a power of two so that steady state compiles nothing new. Padding ids point at the null page
(page 0), whose contents are never read, so scattering zeros there is harmless.

Pools are the engine's ``caches``: a list over layers of ``(pages_PGKH, scales_PK | None)``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NULL_PAGE = 0


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


@jax.jit
def _gather(caches, ids_B):
    return [(pages[ids_B], None if scales is None else scales[ids_B]) for pages, scales in caches]


def _scatter_impl(caches, ids_B, new):
    out = []
    for (pages, scales), (p_new, s_new) in zip(caches, new):
        pages = pages.at[ids_B].set(p_new.astype(pages.dtype))
        if scales is not None:
            scales = scales.at[ids_B].set(s_new.astype(scales.dtype))
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
    ids_B = np.full(_bucket(n), NULL_PAGE, np.int32)
    ids_B[:n] = ids
    got = jax.device_get(_gather(caches, ids_B))
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
    B = _bucket(n)
    ids_B = np.full(B, NULL_PAGE, np.int32)
    ids_B[:n] = ids
    new = []
    for l, ((pages, scales), p) in enumerate(zip(caches, layer_pages)):
        p = np.asarray(p)
        want = (n, *pages.shape[1:])
        if p.shape != want:
            raise ValueError(f"layer {l}: pages have shape {p.shape}, expected {want}")
        if p.dtype != pages.dtype:
            raise ValueError(f"layer {l}: pages are {p.dtype}, the pool is {pages.dtype}")
        pad = np.zeros((B, *pages.shape[1:]), p.dtype)
        pad[:n] = p
        s_pad = None
        if fp8:
            s = np.asarray(layer_scales[l], np.float32)
            if s.shape != (n, *scales.shape[1:]):
                raise ValueError(f"layer {l}: scales have shape {s.shape}, expected {(n, *scales.shape[1:])}")
            s_pad = np.zeros((B, *scales.shape[1:]), np.float32)
            s_pad[:n] = s
        new.append((pad, s_pad))
    return _scatter(caches, ids_B, new)


__all__ = ["gather_pages", "scatter_pages"]
