"""Small helpers every layer may import (pallas_kernels and sharding sit below tbjax and serving).

One spelling each of small idioms: rounding up to a multiple or a power of
two, checking that a value is a real int (bool is an int to Python, never to us) or a real number, the device's
kind and SM count, and the tables of tuned kernel parameters (`TuningTable`: one row per device kind, overridden for
a block of code by a context manager instead of by patching module globals).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
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


def is_number(v) -> bool:
    """An int or a float and not a bool (a JSON number)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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


def device_kind(default: str = "default") -> str:
    """`jax.Device.device_kind` of the first device ("NVIDIA H200", "TPU v5 lite", "cpu"), or `default` when there
    is no backend."""
    try:
        import jax

        return jax.devices()[0].device_kind
    except Exception:  # noqa: BLE001 - no backend: the caller's default
        return default


class TuningTable:
    """Tuned parameters of one kernel family as data: rows (frozen dataclasses of one type) keyed by device kind,
    with a "default" row for kinds not in the table.

    `current()` is the row of this process's device kind, or the row an enclosing `override(**fields)` block put in
    force (a context variable: threads and tasks see their own). Kernels read `current()` when they are traced and
    pass what they use as static arguments, so an override is never hidden by a cached trace.
    """

    def __init__(self, name: str, rows: dict):
        if "default" not in rows or len({type(r) for r in rows.values()}) != 1:
            raise ValueError(f"{name}: the rows need a 'default' and one dataclass type, got {rows!r}")
        self.rows = rows
        self._override: contextvars.ContextVar = contextvars.ContextVar(name, default=None)

    def bind(self):
        """(current, override): the two functions a family's tuning module exports."""
        return self.current, self.override

    def row(self, kind: str | None = None):
        """The table's row for `kind` (default: this process's device kind), ignoring overrides."""
        return self.rows.get(device_kind() if kind is None else kind, self.rows["default"])

    def current(self):
        o = self._override.get()
        return o if o is not None else self.row()

    @contextlib.contextmanager
    def override(self, **fields):
        """Within the block, `current()` returns the current row with `fields` replaced (unknown names raise)."""
        token = self._override.set(dataclasses.replace(self.current(), **fields))
        try:
            yield self._override.get()
        finally:
            self._override.reset(token)
