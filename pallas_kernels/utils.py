"""Small integer helpers every layer may import (pallas_kernels and sharding sit below tbjax and serving).

One spelling each of two idioms the code base used to write out by hand: rounding up to a multiple or a power of
two, and checking that a value is a real int (bool is an int to Python, never to us).
"""
from __future__ import annotations


def round_up(n: int, m: int) -> int:
    """The smallest multiple of m that is >= n (m > 0)."""
    return -(-int(n) // m) * m


def next_pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two >= max(n, lo); 1 for n <= 1 with the default lo."""
    n = max(int(n), lo, 1)
    return 1 << (n - 1).bit_length()


def prev_pow2(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (int(n).bit_length() - 1)


def is_int(v) -> bool:
    """An int and not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def check_int(what: str, v, lo: int | None = None, hi: int | None = None, exc: type[Exception] = ValueError) -> int:
    """v itself when it is an int (not a bool) within [lo, hi] (either bound may be None); else raises `exc`
    naming `what`."""
    if not is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = ("" if lo is None and hi is None else f" in [{'-inf' if lo is None else lo}, "
               f"{'inf' if hi is None else hi}]")
        raise exc(f"{what} must be an int{rng}, got {v!r}")
    return v
