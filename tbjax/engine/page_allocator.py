"""Host-side page allocator for one dp rank's KV page pool: a free list plus reference counts.

The device holds the KV pages (``kv_pages_PGKH`` per layer); this module only decides which page ids
are in use. A page is owned through references: every block table that lists it holds one, and the
prefix cache holds one for each page it keeps. A page returns to the free list exactly when its last
reference is dropped, so shared prefix pages outlive all but their last user.

Page 0 is, by default, the *null page*: it is never handed out and never counted as capacity, so the
runner can point padding block-table entries at it (writes to padding slots land there and are never
read back). Pass ``reserve_null_page=False`` to use every page.
"""

from __future__ import annotations

from typing import Iterable

from pallas_kernels.utils import is_int

__all__ = ["NULL_PAGE", "OutOfPages", "PageRefError", "PageAllocator"]

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """Raised when more pages are requested than the free list holds."""


class PageRefError(RuntimeError):
    """Raised on a reference-count misuse: freeing a free page, referencing an unallocated page, a bad id."""


class PageAllocator:
    """Free list and per-page reference counts for ``num_pages`` pages of ``page_size`` tokens."""

    def __init__(self, num_pages: int, page_size: int, *, reserve_null_page: bool = True):
        if not is_int(num_pages):
            raise TypeError(f"num_pages must be an int, got {type(num_pages).__name__}")
        if not is_int(page_size):
            raise TypeError(f"page_size must be an int, got {type(page_size).__name__}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        first = 1 if reserve_null_page else 0
        if num_pages <= first:
            raise ValueError(
                f"num_pages={num_pages} leaves no usable page"
                + (" (page 0 is the reserved null page)" if reserve_null_page else "")
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.null_page = NULL_PAGE if reserve_null_page else None
        self._first = first
        self._refcount = [0] * num_pages
        # A stack: the most recently freed page is handed out first (its slots are likely still warm).
        self._free = list(range(num_pages - 1, first - 1, -1))

    # -- capacity and use -------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        """Pages that can ever be allocated (all pages minus the null page)."""
        return self.num_pages - self._first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the usable pages can hold."""
        return self.num_usable * self.page_size

    @property
    def used_tokens(self) -> int:
        """Token slots in pages that are in use (an upper bound on tokens stored)."""
        return self.num_used * self.page_size

    # -- allocation and references ----------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages off the free list, each with reference count 1."""
        if not is_int(n) or n < 0:
            raise ValueError(f"cannot allocate {n!r} pages: need an int >= 0")
        if n > len(self._free):
            raise OutOfPages(f"requested {n} pages but only {len(self._free)} of {self.num_usable} are free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def _check_id(self, page: int) -> None:
        if not is_int(page) or not (self._first <= page < self.num_pages):
            what = " (the reserved null page)" if self.null_page is not None and page == self.null_page else ""
            raise PageRefError(f"page id {page!r}{what} is not an allocatable page of this pool "
                               f"(valid: {self._first}..{self.num_pages - 1})")

    def incref(self, page: int) -> None:
        """Add a reference to an allocated page (a second block table or the prefix cache shares it)."""
        self._check_id(page)
        if self._refcount[page] == 0:
            raise PageRefError(f"page {page} is free: cannot add a reference to it")
        self._refcount[page] += 1

    def decref(self, page: int) -> bool:
        """Drop one reference; returns True when that was the last one and the page went back to the free list."""
        self._check_id(page)
        rc = self._refcount[page]
        if rc == 0:
            raise PageRefError(f"page {page} is already free (double free)")
        self._refcount[page] = rc - 1
        if rc == 1:
            self._free.append(page)
            return True
        return False

    def decref_all(self, pages: Iterable[int]) -> int:
        """Drop one reference from each page; returns how many were freed."""
        return sum(self.decref(p) for p in pages)

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._refcount[page]

    def is_free(self, page: int) -> bool:
        return self.refcount(page) == 0

    def free_pages(self) -> list[int]:
        """A copy of the free list."""
        return list(self._free)

    def check(self) -> None:
        """Verify internal consistency (free list == pages with count 0, no duplicates); raises AssertionError."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page appears twice on the free list"
        for p in range(self._first, self.num_pages):
            rc = self._refcount[p]
            assert rc >= 0, f"page {p} has negative refcount {rc}"
            assert (rc == 0) == (p in free), f"page {p}: refcount {rc} but on free list: {p in free}"
        if self._first:
            assert NULL_PAGE not in free and self._refcount[NULL_PAGE] == 0, "null page was handed out"

    def __repr__(self) -> str:
        return (f"PageAllocator(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"free={self.num_free}, used={self.num_used})")
