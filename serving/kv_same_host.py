"""The sender's half of the same-host data planes of a KV transfer (shared memory and CUDA IPC; the receiver's
half is ``KVReceiver._land`` / ``_finish_landing``, the segments and copiers ``serving/kv_shm.py``).

On these planes the pages do not travel in the chunks: the sender copies them into the region the receiver granted
at Announce and each chunk carries a page range and a 64-bit checksum computed on the device (one program per
(rows shape, dtype, chunk size), queued before the Announce so that no reservation waits for it).
"""
from __future__ import annotations

import asyncio
import os

import numpy as np

from . import kv_shm

__all__ = ["mapping", "start_checksums", "checksums_when_ready", "read_checksums", "copier_named",
           "CHECKSUMS_COMPILED"]


MAPPINGS: dict[str, kv_shm.ShmMapping] = {}     # receivers' segments this process has mapped (sender side)


def mapping(name: str) -> kv_shm.ShmMapping:
    m = MAPPINGS.get(name)
    if m is None:
        for old, om in list(MAPPINGS.items()):     # segments of receivers that went away: unmap (frees the RAM)
            if not os.path.exists(om.path):
                om.close()
                del MAPPINGS[old]
        m = MAPPINGS[name] = kv_shm.ShmMapping(name)
    return m


def start_checksums(pages, n: int, chunk_sizes) -> dict:
    """Queue the checksum programs of ``pages``' first ``n`` rows for each chunk size (not waited for)."""
    from tbjax.engine.kv_pages import _chunk_checksums

    return {c: _chunk_checksums(pages, np.int32(n), chunk_pages=int(c)) for c in chunk_sizes}


CHECKSUMS_COMPILED: set = set()     # (rows shape, dtype, chunk pages) whose checksum program exists


async def checksums_when_ready(ab, n: int, c: int) -> list[int]:
    if not hasattr(ab, "is_ready") or ab.is_ready():
        return read_checksums(ab, n, c)
    return await asyncio.to_thread(read_checksums, ab, n, c)


def read_checksums(ab, n: int, c: int) -> list[int]:
    import jax

    ab = np.asarray(jax.device_get(ab)).astype(np.uint64)
    return [(int(b) << 32) | int(a) for a, b in ab[:-(-n // c)]]


_COPIER_CACHE: dict[str, kv_shm.HostCopier] = {}


def copier_named(name: str) -> kv_shm.HostCopier:
    c = _COPIER_CACHE.get(name)
    if c is None:
        c = _COPIER_CACHE[name] = kv_shm.make_copier(name)
    return c
