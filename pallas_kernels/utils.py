"""Small helpers every layer may import (pallas_kernels and sharding sit below tbjax and serving).

One spelling each of idioms the code base used to write out by hand: rounding up to a multiple or a power of
two, checking that a value is a real int (bool is an int to Python, never to us), and the device's SM count.
"""
from __future__ import annotations

import numbers


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


def is_int(v, numpy: bool = False) -> bool:
    """An int and not a bool; with numpy=True numpy integer scalars count too."""
    if isinstance(v, bool):
        return False
    return isinstance(v, numbers.Integral) if numpy else isinstance(v, int)


def check_int(what: str, v, lo: int | None = None, hi: int | None = None, exc: type[Exception] = ValueError,
              numpy: bool = False) -> int:
    """v itself when it is an int (not a bool; numpy: numpy integers too) within [lo, hi] (either bound may be
    None); else raises `exc` naming `what`."""
    if not is_int(v, numpy) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = ("" if lo is None and hi is None else f" in [{'-inf' if lo is None else lo}, "
               f"{'inf' if hi is None else hi}]")
        raise exc(f"{what} must be an int{rng}, got {v!r}")
    return v


def device_sm_count(default: int = 132) -> int:
    """Streaming multiprocessors of the first device when it is a GPU, else `default` (the H100/H200 count)."""
    try:
        import jax

        dev = jax.devices()[0]
        if dev.platform == "gpu":
            return int(getattr(dev, "core_count", default) or default)
    except Exception:  # noqa: BLE001 - device query is best effort
        pass
    return default
