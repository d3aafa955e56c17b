"""Radix prefix cache: matching, dedup on insert, locks, LRU eviction of unreferenced pages only.

A random-operation test plays "users" (sequences) that match, extend and release prefixes and checks
after every operation that each page's refcount equals the block tables holding it plus one if cached.
"""

import random

import pytest
from hypothesis import given, settings, strategies as st

from tbjax.engine.page_allocator import PageAllocator
from tbjax.engine.prefix_cache import PrefixCache

G = 2


def _seq_with_pages(cache, alloc, tokens):
    """A user that computed ``tokens`` from scratch (pages allocated, then inserted, lock kept)."""
    pages = alloc.allocate(-(-len(tokens) // G))
    node = cache.insert(cache.root, tokens, pages)
    if node is not cache.root:
        cache.lock(node)
    return node, pages


def _release(cache, alloc, node, pages):
    if node is not cache.root:
        cache.unlock(node)
    alloc.decref_all(pages)


def test_match_full_pages_only_and_max_pages():
    alloc = PageAllocator(16, G)
    cache = PrefixCache(alloc)
    node, pages = _seq_with_pages(cache, alloc, [1, 2, 3, 4, 5])  # 2 full pages + partial
    assert cache.num_nodes == 2
    m = cache.match([1, 2, 3, 4, 5, 6])
    assert m.pages == pages[:2] and m.node is node and m.node.depth == 2
    assert cache.match([1, 2, 3, 9]).pages == pages[:1]
    assert cache.match([2, 1]).pages == []
    assert cache.match([1, 2, 3]).pages == pages[:1]  # the partial page [3] is never a key
    # a fully cached prompt keeps its last token to recompute: max_pages = (len - 1) // G
    assert cache.match([1, 2, 3, 4], max_pages=(4 - 1) // G).pages == pages[:1]
    cache.check()


def test_insert_dedups_to_cached_page_and_frees_copy():
    alloc = PageAllocator(16, G)
    cache = PrefixCache(alloc)
    n1, p1 = _seq_with_pages(cache, alloc, [7, 7, 8, 8])
    own = alloc.allocate(3)  # second user computed the same 2 pages itself + a tail
    bt = list(own)
    n2 = cache.insert(cache.root, [7, 7, 8, 8, 9], bt)
    cache.lock(n2)
    assert n2 is n1 and bt[:2] == p1[:2] and bt[2] == own[2]
    assert alloc.is_free(own[0]) and alloc.is_free(own[1])
    assert alloc.refcount(p1[0]) == 3  # cache + two users
    cache.check()
    _release(cache, alloc, n1, p1)
    _release(cache, alloc, n2, bt)
    assert alloc.num_used == 2 and cache.num_evictable == 2
    assert cache.clear() == 2 and alloc.num_free == alloc.num_usable


def test_lru_eviction_order_and_locked_pages_survive():
    alloc = PageAllocator(32, G)
    cache = PrefixCache(alloc)
    users = {name: _seq_with_pages(cache, alloc, toks)
             for name, toks in [("a", [1, 1, 2, 2]), ("b", [1, 1, 3, 3]), ("c", [4, 4]), ("d", [5, 5])]}
    for name in ["c", "a", "b"]:  # release order = LRU order: c oldest, then a, then b
        _release(cache, alloc, *users[name])
    # d is still held: its page must survive any eviction
    assert cache.num_evictable == 4  # [1,1], [2,2], [3,3], [4,4]
    page = {n: cache.match(t).pages for n, t in [("a", [1, 1, 2, 2]), ("b", [1, 1, 3, 3]), ("c", [4, 4])]}
    fresh = alloc.allocate(1)  # a newer unlocked page: must not be evicted before the older ones
    cache.insert(cache.root, [6, 6], fresh)
    alloc.decref(fresh[0])
    assert cache.evict(1) == 1 and alloc.is_free(page["c"][0])
    assert cache.evict(1) == 1 and alloc.is_free(page["a"][1])  # a's leaf; [1,1] still has child b
    assert not alloc.is_free(page["a"][0])
    assert cache.evict(2) == 2  # b's leaf, then the shared [1,1]
    assert not alloc.is_free(fresh[0])
    assert cache.evict(10) == 1 and alloc.is_free(fresh[0])
    assert cache.num_nodes == 1 and cache.num_evictable == 0 and cache.evict(5) == 0
    d_node, d_pages = users["d"]
    assert alloc.refcount(d_pages[0]) == 2 and d_node.alive
    cache.check()


def test_lock_errors_and_hit_counters():
    alloc = PageAllocator(8, G)
    cache = PrefixCache(alloc)
    node, pages = _seq_with_pages(cache, alloc, [1, 2, 3, 4])
    _release(cache, alloc, node, pages)
    with pytest.raises(ValueError, match="holds no lock"):
        cache.unlock(node)
    cache.evict(10)
    with pytest.raises(ValueError, match="not a live node"):
        cache.lock(node)
    cache.record_query(10, 4)
    cache.record_query(6, 0)
    assert cache.hit_rate == pytest.approx(4 / 16) and cache.num_hit_queries == 1
    with pytest.raises(ValueError, match="hit_tokens"):
        cache.record_query(3, 4)


def test_move_lock_rejects_non_descendant():
    alloc = PageAllocator(16, G)
    cache = PrefixCache(alloc)
    a, pa = _seq_with_pages(cache, alloc, [1, 1, 2, 2])
    b, pb = _seq_with_pages(cache, alloc, [3, 3, 4, 4])
    before = cache.num_evictable
    with pytest.raises(ValueError, match="not a descendant"):
        cache.move_lock(a, b)
    assert cache.num_evictable == before
    cache.check()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_pages=st.integers(4, 24))
def test_random_users_refcounts_and_eviction(seed, num_pages):
    rng = random.Random(seed)
    alloc = PageAllocator(num_pages, G)
    cache = PrefixCache(alloc)
    prefixes = [[rng.randint(0, 2) for _ in range(rng.randint(0, 8))] for _ in range(3)]
    users = []  # dicts: tokens, computed, pages (block table), node

    def check():
        alloc.check()
        cache.check()
        held = {}
        for u in users:
            for p in u["pages"]:
                held[p] = held.get(p, 0) + 1
            assert u["node"].path_pages() == u["pages"][:u["node"].depth]
        cached = cache.cached_pages()
        for p in range(1, num_pages):
            assert alloc.refcount(p) == held.get(p, 0) + (p in cached)

    for _ in range(60):
        op = rng.random()
        if op < 0.35:  # a new user: match, lock, allocate the rest (evicting if needed)
            tokens = rng.choice(prefixes) + [rng.randint(0, 2) for _ in range(rng.randint(1, 5))]
            m = cache.match(tokens, max_pages=(len(tokens) - 1) // G)
            need = -(-len(tokens) // G) - m.num_pages
            if need > alloc.num_free + cache.num_evictable - cache.num_unlocked_on_path(m.node):
                continue
            if m.num_pages:
                cache.lock(m.node)
            for p in m.pages:
                alloc.incref(p)
            short = need - alloc.num_free
            if short > 0:
                assert cache.evict(short) == short
            pages = m.pages + alloc.allocate(need)
            users.append(dict(tokens=tokens, computed=m.num_pages * G, pages=pages, node=m.node))
        elif op < 0.6 and users:  # a user computes more tokens and caches its full pages
            u = rng.choice(users)
            u["computed"] = rng.randint(u["computed"], len(u["tokens"]))
            old = u["node"]
            new = cache.insert(old, u["tokens"][:u["computed"]], u["pages"])
            if new is not old:
                if old is cache.root:
                    cache.lock(new)
                else:
                    cache.move_lock(old, new)
                u["node"] = new
        elif op < 0.85 and users:  # a user ends
            u = users.pop(rng.randrange(len(users)))
            _release(cache, alloc, u["node"], u["pages"])
        else:  # evict: only pages no user holds, and they become free
            held = {p for u in users for p in u["pages"]}
            before = cache.cached_pages()
            k = rng.randint(0, 4)
            freed = cache.evict(k)
            gone = before - cache.cached_pages()
            assert len(gone) == freed <= k and not (gone & held)
            assert all(alloc.is_free(p) for p in gone)
        check()
    while users:
        u = users.pop()
        _release(cache, alloc, u["node"], u["pages"])
        check()
    assert cache.num_evictable == cache.num_nodes
    cache.clear()
    assert cache.num_nodes == 0 and alloc.num_free == alloc.num_usable
