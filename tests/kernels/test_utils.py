"""pallas_kernels.utils: the shared rounding and integer-check helpers."""
import jax
import numpy as np
import pytest

import dataclasses

from pallas_kernels.utils import (TuningTable, check_int, device_kind, device_sm_count, is_int, is_number, next_pow2,
                                  prev_pow2, round_up)


def test_rounding():
    assert [next_pow2(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]
    assert next_pow2(5, 1024) == 1024 and next_pow2(2000, 1024) == 2048
    assert [prev_pow2(n) for n in (1, 2, 3, 8, 9)] == [1, 2, 2, 8, 8]
    assert [round_up(n, 8) for n in (0, 1, 8, 9)] == [0, 8, 8, 16]


def test_integer_checks():
    assert is_int(3) and not is_int(True) and not is_int(3.0) and not is_int(np.int64(3))
    assert is_int(np.int64(3), numpy=True) and not is_int(np.bool_(True), numpy=True)
    assert is_number(3) and is_number(2.5) and not is_number(True) and not is_number("3")
    assert check_int("n", 4, lo=1, hi=4) == 4
    with pytest.raises(ValueError, match=r"n must be an int in \[1, inf\], got 0"):
        check_int("n", 0, lo=1)
    with pytest.raises(TypeError, match="got True"):
        check_int("n", True, exc=TypeError)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a GPU reports its own SM count")
def test_device_sm_count_off_gpu():
    assert device_sm_count() == 132 and device_sm_count(7) == 7


@dataclasses.dataclass(frozen=True)
class _Row:
    a: int = 1
    b: str = "x"


def test_tuning_table_rows_and_scoped_override():
    t = TuningTable("t", {"default": _Row(), "other kind": _Row(a=2)})
    assert t.row() == _Row() and t.row("other kind").a == 2 and t.row("unknown").a == 1
    assert t.current() == t.row(device_kind())
    with t.override(a=5) as row:
        assert t.current() is row and row == _Row(a=5)
        with t.override(b="y"):
            assert t.current() == _Row(a=5, b="y")
        assert t.current() is row
    assert t.current() == _Row()
    with pytest.raises(TypeError):
        with t.override(c=1):
            pass
    with pytest.raises(ValueError):
        TuningTable("bad", {"x": _Row()})
