"""Sliding-window paged attention over a ring of pages (the speculative draft's KV, tbjax/engine/speculative.py):
logical page j of a sequence lives in ring slot j % R, so the pages before the window hold newer tokens. The jnp
reference, the blocked CPU path (decode and 32-row tiles) and the dispatcher's step entry must read only the window.
Reference: float64 numpy attention over the true keys and values of the window."""
import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.paged_attention import paged_attention, paged_decode_attention, step_attention

G, K, H, N, W = 4, 2, 16, 4, 8
RING = -(-W // G) + 1


def _setup(L, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((L, K, H)).astype(np.float32)
    v = rng.standard_normal((L, K, H)).astype(np.float32)
    pool = np.zeros((1 + RING, G, 2 * K, H), np.float32)
    ring = list(range(1, 1 + RING))
    for pos in range(L):                      # written in order: later pages overwrite earlier ones' slots
        page = ring[(pos // G) % RING]
        pool[page, pos % G, 0::2] = k[pos]
        pool[page, pos % G, 1::2] = v[pos]
    table = np.array([[ring[j % RING] for j in range(-(-L // G))] + [0] * 8], np.int32)
    return k, v, jnp.asarray(pool), jnp.asarray(table)


def _want(q_TNH, k, v, positions):
    out = []
    for q, p in zip(q_TNH.astype(np.float64), positions):
        lo = max(0, p - W + 1)
        kk, vv = k[lo:p + 1].astype(np.float64), v[lo:p + 1].astype(np.float64)
        rows = []
        for n in range(N):
            s = kk[:, n // (N // K)] @ q[n] / np.sqrt(H)
            w = np.exp(s - s.max())
            rows.append((w / w.sum()) @ vv[:, n // (N // K)])
        out.append(rows)
    return np.array(out)


@pytest.mark.parametrize("L", [5, 23, 61])
def test_window_over_a_ring_of_pages(L):
    k, v, pool, table = _setup(L)
    rng = np.random.default_rng(L)
    q1 = rng.standard_normal((1, N, H)).astype(np.float32)
    want = _want(q1, k, v, [L - 1])
    lens = jnp.asarray([L], jnp.int32)
    for impl in ("reference", "blocked"):
        got = paged_decode_attention(jnp.asarray(q1), pool, table, lens, sliding_window=W, impl=impl)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    # two query rows (a draft catch-up) at the end of the ring: positions L-2, L-1
    q2 = rng.standard_normal((2, N, H)).astype(np.float32)
    want2 = _want(q2, k, v, [L - 2, L - 1])
    cu = jnp.asarray([0, 2], jnp.int32)
    for impl in ("reference", "blocked"):
        got = paged_attention(jnp.asarray(q2), pool, table, lens, cu, sliding_window=W, impl=impl)
        np.testing.assert_allclose(np.asarray(got), want2, rtol=2e-5, atol=2e-5)
    got = step_attention(jnp.asarray(q2), pool, table, lens, cu, sliding_window=W)
    np.testing.assert_allclose(np.asarray(got), want2, rtol=2e-5, atol=2e-5)
