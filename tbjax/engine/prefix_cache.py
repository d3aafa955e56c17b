"""Radix prefix cache over token ids for one dp rank: reuse the KV pages of full pages of a shared prefix.

Why: many requests start with the same tokens (system prompt, few-shot examples, earlier turns of a chat,
a preempted request coming back). Their KV is the same, so the pages holding it can be shared by
reference instead of recomputed.

The tree's edges are whole pages: a node is one full page of ``page_size`` token ids (its key) and the
page id that holds their KV; the path from the root spells a prefix. Only full pages are cached, so a
sequence that reuses a prefix writes its partial tail into a fresh page of its own ("copy-on-write of
the last partial page" reduces to that).

References and locks:
- The cache holds one allocator reference on every cached page. A sequence holding a cached page holds
  another (through its block table).
- A sequence *locks* the deepest cached node of its own prefix; a lock counts on that node and on every
  ancestor (``lock_ref``). So an unlocked node has only unlocked descendants, no sequence holds its page
  (its refcount is exactly 1), and all unlocked nodes can be evicted leaf first. ``num_evictable`` (the
  number of unlocked nodes) is kept up to date, so "free + evictable" pages is the rank's real headroom.
- Eviction is LRU over unlocked leaves; a node's time is refreshed whenever a lock is taken or dropped
  through it and when it is inserted.

Insertion deduplicates: when a sequence inserts a page whose tokens are already cached under another
page id, its block table is switched to the cached page and its own copy is freed, so a sequence's
block-table prefix is always exactly the page path of its locked node.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence as Seq

from .page_allocator import PageAllocator

__all__ = ["PrefixCache", "PrefixMatch", "CacheNode"]


class CacheNode:
    """One full page of the tree. ``depth`` = number of pages from the root (root: 0)."""

    __slots__ = ("key", "page", "parent", "children", "lock_ref", "last_access", "depth", "alive")

    def __init__(self, key, page, parent, depth):
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple, CacheNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.depth = depth
        self.alive = True

    def path_pages(self) -> list[int]:
        pages = []
        n = self
        while n.parent is not None:
            pages.append(n.page)
            n = n.parent
        return pages[::-1]

    def __repr__(self) -> str:
        return f"CacheNode(depth={self.depth}, page={self.page}, lock_ref={self.lock_ref})"


@dataclass(frozen=True)
class PrefixMatch:
    """Result of a lookup: the deepest matched node and the page ids along its path (root excluded)."""

    node: CacheNode
    pages: list[int]

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class PrefixCache:
    """Page-granular radix tree of cached prefixes for the pages of one ``PageAllocator``."""

    def __init__(self, allocator: PageAllocator):
        if not isinstance(allocator, PageAllocator):
            raise TypeError(f"PrefixCache needs a PageAllocator, got {type(allocator).__name__}")
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.root = CacheNode(None, None, None, 0)
        self._clock = 0
        self._heap_tie = 0
        self._heap: list = []  # (last_access, tie, node) eviction candidates, lazily invalidated
        self.num_nodes = 0
        self.num_evictable = 0
        self.num_evicted = 0
        # hit-rate counters (recorded by the caller once per admitted request)
        self.num_queries = 0
        self.num_hit_queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- lookup ---------------------------------------------------------------------------------------
    def match(self, token_ids: Seq[int], max_pages: int | None = None) -> PrefixMatch:
        """Longest cached prefix of ``token_ids`` in whole pages (at most ``max_pages``). Takes no lock."""
        g = self.page_size
        limit = len(token_ids) // g
        if max_pages is not None:
            limit = min(limit, max_pages)
        node = self.root
        pages = []
        for i in range(limit):
            child = node.children.get(tuple(token_ids[i * g:(i + 1) * g]))
            if child is None:
                break
            node = child
            pages.append(child.page)
        return PrefixMatch(node, pages)

    def record_query(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one request's lookup: ``hit_tokens`` of its ``query_tokens`` came from the cache."""
        if not 0 <= hit_tokens <= query_tokens:
            raise ValueError(f"hit_tokens={hit_tokens} must be within 0..query_tokens={query_tokens}")
        self.num_queries += 1
        self.num_hit_queries += hit_tokens > 0
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens served from the cache (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    # -- locks ----------------------------------------------------------------------------------------
    def _check_alive(self, node: CacheNode) -> None:
        if not isinstance(node, CacheNode) or not node.alive:
            raise ValueError(f"{node!r} is not a live node of this cache")

    def lock(self, node: CacheNode) -> None:
        """Pin ``node`` and its ancestors against eviction (one more user)."""
        self._check_alive(node)
        t = self._tick()
        n = node
        while n is not self.root:
            if n.lock_ref == 0:
                self.num_evictable -= 1
            n.lock_ref += 1
            n.last_access = t
            n = n.parent
            if n is None:
                raise ValueError("node does not belong to this cache")

    def unlock(self, node: CacheNode) -> None:
        """Drop one lock taken with ``lock`` (or moved there with ``move_lock``); refreshes LRU times."""
        self._check_alive(node)
        t = self._tick()
        n = node
        while n is not self.root:
            if n.lock_ref <= 0:
                raise ValueError(f"unlock of {n!r} which holds no lock")
            n.lock_ref -= 1
            n.last_access = t
            if n.lock_ref == 0:
                self.num_evictable += 1
                self._maybe_push(n)
            n = n.parent

    def move_lock(self, old: CacheNode, new: CacheNode) -> None:
        """Move a lock from ``old`` down to its descendant ``new`` (cost: the pages between them)."""
        self._check_alive(old)
        self._check_alive(new)
        if new.depth < old.depth:
            raise ValueError(f"move_lock: {new!r} is not a descendant of {old!r}")
        t = self._tick()
        n = new
        touched = []
        while n is not old:
            if n is None or n is self.root:
                for m in touched:  # undo before raising
                    m.lock_ref -= 1
                    if m.lock_ref == 0:
                        self.num_evictable += 1
                raise ValueError(f"move_lock: {new!r} is not a descendant of {old!r}")
            if n.lock_ref == 0:
                self.num_evictable -= 1
            n.lock_ref += 1
            n.last_access = t
            touched.append(n)
            n = n.parent

    def num_unlocked_on_path(self, node: CacheNode) -> int:
        """How many nodes on the root..node path are unlocked (locking ``node`` would take them off
        the evictable count). Unlocked nodes on a path are always its deepest ones."""
        self._check_alive(node)
        k = 0
        n = node
        while n is not self.root and n.lock_ref == 0:
            k += 1
            n = n.parent
        return k

    # -- insertion ------------------------------------------------------------------------------------
    def insert(self, node: CacheNode, token_ids: Seq[int], pages: list[int]) -> CacheNode:
        """Cache the full pages of ``token_ids`` below ``node`` and return the deepest node.

        ``node`` must be the node whose path is ``pages[:node.depth]`` (the caller's current lock, or the
        root); ``token_ids`` are tokens whose KV is already written; ``pages`` is the caller's block table.
        Pages ``node.depth .. len(token_ids)//page_size - 1`` are inserted. A page already cached under a
        different id is deduplicated: ``pages[i]`` is replaced (in place) by the cached id, which gains a
        reference, and the caller's own page loses one. New nodes are unlocked: lock or move the caller's
        lock onto the returned node if it keeps using the pages.
        """
        self._check_alive(node)
        g = self.page_size
        n_full = len(token_ids) // g
        if n_full > len(pages):
            raise ValueError(f"{len(token_ids)} tokens span {n_full} full pages but only {len(pages)} pages given")
        if node.depth > 0 and (node.depth > len(pages) or pages[node.depth - 1] != node.page):
            raise ValueError("insert: pages[:node.depth] is not the path of the given node")
        t = self._tick()
        alloc = self.allocator
        for i in range(node.depth, n_full):
            key = tuple(token_ids[i * g:(i + 1) * g])
            child = node.children.get(key)
            if child is None:
                page = pages[i]
                alloc.incref(page)  # the cache's own reference
                child = CacheNode(key, page, node, i + 1)
                node.children[key] = child
                self.num_nodes += 1
                self.num_evictable += 1
            elif child.page != pages[i]:
                alloc.incref(child.page)
                alloc.decref(pages[i])
                pages[i] = child.page
            child.last_access = t
            node = child
        self._maybe_push(node)
        return node

    # -- eviction -------------------------------------------------------------------------------------
    def _maybe_push(self, node: CacheNode) -> None:
        """Record ``node`` as an eviction candidate if it is an unlocked leaf (stale entries are skipped
        when popped: the entry's time must still equal the node's)."""
        if node.lock_ref == 0 and not node.children and node.alive and node is not self.root:
            self._heap_tie += 1
            heapq.heappush(self._heap, (node.last_access, self._heap_tie, node))
            if len(self._heap) > 2 * self.num_nodes + 64:
                self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = []
        for n in self.nodes():
            if n.lock_ref == 0 and not n.children:
                self._heap_tie += 1
                self._heap.append((n.last_access, self._heap_tie, n))
        heapq.heapify(self._heap)

    def evict(self, n: int) -> int:
        """Free up to ``n`` pages by dropping least recently used unlocked leaves; returns pages freed."""
        freed = 0
        alloc = self.allocator
        while freed < n and self.num_evictable > 0:
            if not self._heap:  # cannot happen while num_evictable > 0 unless bookkeeping broke
                self._rebuild_heap()
                if not self._heap:
                    raise RuntimeError("prefix cache counts evictable pages but finds no unlocked leaf")
            t, _, leaf = heapq.heappop(self._heap)
            if not leaf.alive or leaf.children or leaf.lock_ref or t != leaf.last_access:
                continue  # stale entry
            parent = leaf.parent
            del parent.children[leaf.key]
            leaf.alive = False
            leaf.parent = None
            self.num_nodes -= 1
            self.num_evictable -= 1
            self.num_evicted += 1
            if not alloc.decref(leaf.page):
                raise RuntimeError(f"evicted page {leaf.page} is still referenced outside the cache "
                                   f"(refcount {alloc.refcount(leaf.page)}): lock bookkeeping is broken")
            freed += 1
            self._maybe_push(parent)
        return freed

    def clear(self) -> int:
        """Evict every unlocked node; returns pages freed."""
        return self.evict(self.num_evictable)

    # -- introspection --------------------------------------------------------------------------------
    def nodes(self) -> list[CacheNode]:
        out = []
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def cached_pages(self) -> set[int]:
        return {n.page for n in self.nodes()}

    def check(self) -> None:
        """Verify the tree's bookkeeping (counts, lock propagation, references); raises AssertionError."""
        nodes = self.nodes()
        assert len(nodes) == self.num_nodes, f"num_nodes {self.num_nodes} != {len(nodes)}"
        unlocked = sum(n.lock_ref == 0 for n in nodes)
        assert unlocked == self.num_evictable, f"num_evictable {self.num_evictable} != {unlocked}"
        pages = [n.page for n in nodes]
        assert len(set(pages)) == len(pages), "a page is cached under two nodes"
        for n in nodes:
            assert n.alive and n.parent.children[n.key] is n
            assert len(n.key) == self.page_size and n.depth == n.parent.depth + 1
            assert n.lock_ref >= sum(c.lock_ref for c in n.children.values()), f"lock not propagated at {n!r}"
            rc = self.allocator.refcount(n.page)
            assert rc >= 1, f"cached page {n.page} has refcount {rc}"
            if n.lock_ref == 0:
                assert rc == 1, f"unlocked node {n!r} but page refcount {rc}"

    def stats(self) -> dict:
        return {
            "cached_pages": self.num_nodes,
            "evictable_pages": self.num_evictable,
            "evicted_pages": self.num_evicted,
            "queries": self.num_queries,
            "hit_queries": self.num_hit_queries,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_rate,
        }
