"""Where received KV pages go: the ``PagePool`` interface of a transfer's decode side (reserve / write / free).

``ArrayPagePool`` is a numpy store for tests and CPU workers; the engine's KV cache implements the same three methods
through its engine thread (``serving/pd_worker.py``), where ``reserve`` and ``write`` may be coroutines.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from .kv_codecs import np_dtype

__all__ = ["OutOfPages", "PagePool", "ArrayPagePool"]


class OutOfPages(RuntimeError):
    pass


class PagePool(Protocol):
    # reserve and write may also be coroutines (a pool behind an engine thread)
    def reserve(self, n: int, request_id: str = "") -> list[int]: ...   # raises OutOfPages when it cannot

    # pages: [>= len(page_ids), *page_shape] (rows past len(page_ids) are padding); scales likewise or None
    def write(self, page_ids: Sequence[int], pages, scales=None) -> None: ...

    def free(self, page_ids: Sequence[int]) -> None: ...


class ArrayPagePool:
    """A numpy page store ``[P, *page_shape]`` with a free list (tests, CPU workers)."""

    def __init__(self, num_pages: int, page_shape: Sequence[int], dtype="float32", scales_shape=None):
        self.dtype = np_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
        self.data = np.zeros((num_pages, *page_shape), self.dtype)
        self.scales = None if scales_shape is None else np.zeros((num_pages, *scales_shape), np.float32)
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_pages(self) -> int:
        return self.data.shape[0]

    def reserve(self, n: int, request_id: str = "") -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"{n} pages wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def write(self, page_ids, pages, scales=None) -> None:
        ids = np.asarray(page_ids)
        self.data[ids] = np.asarray(pages)[:len(ids)]
        if scales is not None:
            if self.scales is None:
                raise ValueError("this pool keeps no scales")
            self.scales[ids] = np.asarray(scales)[:len(ids)]

    def free(self, page_ids) -> None:
        dup = set(page_ids) & set(self._free)
        if dup:
            raise RuntimeError(f"double free of pages {sorted(dup)[:5]}")
        self._free.extend(page_ids)
