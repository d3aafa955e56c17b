"""Page allocator: free list + reference counts checked against a plain dict model under random operations."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from tbjax.engine.page_allocator import NULL_PAGE, OutOfPages, PageAllocator, PageRefError


def test_capacity_and_null_page():
    a = PageAllocator(9, 4)
    assert a.num_usable == 8 and a.capacity_tokens == 32 and a.num_free == 8 and a.num_used == 0
    pages = a.allocate(8)
    assert sorted(pages) == list(range(1, 9)) and NULL_PAGE not in pages
    assert a.num_free == 0 and a.used_tokens == 32
    with pytest.raises(OutOfPages, match="only 0 of 8"):
        a.allocate(1)
    b = PageAllocator(3, 2, reserve_null_page=False)
    assert sorted(b.allocate(3)) == [0, 1, 2]


def test_misuse_raises_clear_errors():
    a = PageAllocator(4, 2)
    (p,) = a.allocate(1)
    assert a.decref(p) is True
    with pytest.raises(PageRefError, match="double free"):
        a.decref(p)
    with pytest.raises(PageRefError, match="is free"):
        a.incref(p)
    with pytest.raises(PageRefError, match="null page"):
        a.incref(NULL_PAGE)
    with pytest.raises(PageRefError, match="not an allocatable page"):
        a.decref(17)
    with pytest.raises(ValueError, match="allocate"):
        a.allocate(-1)
    with pytest.raises(ValueError, match="no usable page"):
        PageAllocator(1, 2)
    with pytest.raises(ValueError, match="page_size"):
        PageAllocator(4, 0)


def test_shared_page_freed_by_last_reference_only():
    a = PageAllocator(5, 2)
    (p,) = a.allocate(1)
    a.incref(p)
    a.incref(p)
    assert a.refcount(p) == 3
    assert a.decref(p) is False and a.decref(p) is False
    assert not a.is_free(p) and p not in a.free_pages()
    assert a.decref(p) is True and a.is_free(p) and p in a.free_pages()
    a.check()


@settings(max_examples=60, deadline=None)
@given(num_pages=st.integers(2, 12), seed=st.integers(0, 2**32 - 1), null=st.booleans())
def test_random_operations_match_model(num_pages, seed, null):
    rng = random.Random(seed)
    a = PageAllocator(num_pages, 3, reserve_null_page=null)
    usable = set(range(1 if null else 0, num_pages))
    refs: dict[int, int] = {}  # model: page -> references held
    for _ in range(80):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(0, 4)
            if n > len(usable) - len(refs):
                with pytest.raises(OutOfPages):
                    a.allocate(n)
            else:
                got = a.allocate(n)
                assert len(set(got)) == n and not (set(got) & set(refs)) and set(got) <= usable
                refs.update({p: 1 for p in got})
        elif op < 0.6 and refs:
            p = rng.choice(sorted(refs))
            a.incref(p)
            refs[p] += 1
        elif refs:
            p = rng.choice(sorted(refs))
            freed = a.decref(p)
            refs[p] -= 1
            assert freed == (refs[p] == 0)
            if refs[p] == 0:
                del refs[p]
        a.check()
        assert a.num_used == len(refs) and set(a.free_pages()) == usable - set(refs)
        for p in usable:
            assert a.refcount(p) == refs.get(p, 0)
    for p, n in list(refs.items()):
        a.decref_all([p] * n)
    assert a.num_free == a.num_usable and set(a.free_pages()) == usable
