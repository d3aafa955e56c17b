"""RoPE against float64 math: rotate-half rotation, and llama3 frequency scaling from its published definition."""
import math

import numpy as np
import jax.numpy as jnp

from tbjax.model.layers import apply_rope, rope_cos_sin, rope_inv_freq
from tbjax.spec import RopeSpec


def test_rotation_matches_float64_and_depends_on_relative_position():
    rope = RopeSpec(theta=10000.0, rotary_dim=32)
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 2, 32))
    k = rng.normal(size=(1, 2, 32))
    def rot64(x, p):
        inv = 1.0 / (10000.0 ** (np.arange(0, 32, 2) / 32))
        a = p * inv
        x1, x2 = x[..., :16], x[..., 16:]
        return np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)], -1)
    for p in (0, 7, 300):
        c, s = rope_cos_sin(jnp.array([p]), rope)
        got = np.asarray(apply_rope(jnp.asarray(q, jnp.float32), c, s))
        np.testing.assert_allclose(got, rot64(q, p), atol=2e-4)
    # q(m).k(n) depends on m - n only
    d1 = (rot64(q, 10) * rot64(k, 4)).sum()
    d2 = (rot64(q, 106) * rot64(k, 100)).sum()
    assert abs(d1 - d2) < 1e-9


def test_llama3_scaling_matches_definition():
    r = RopeSpec(theta=500000.0, rotary_dim=128, scaling="llama3", factor=8.0, low_freq_factor=1.0,
                 high_freq_factor=4.0, original_max_position=8192)
    got = rope_inv_freq(r)
    base = 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128))
    want = []
    for f in base:  # the per-frequency rule as published with Llama 3.1
        wl = 2 * math.pi / f
        if wl < 8192 / 4.0:
            want.append(f)
        elif wl > 8192 / 1.0:
            want.append(f / 8.0)
        else:
            sm = (8192 / wl - 1.0) / (4.0 - 1.0)
            want.append((1 - sm) * f / 8.0 + sm * f)
    np.testing.assert_allclose(got, np.array(want), rtol=1e-6)
    assert got[0] == np.float32(base[0]) and np.isclose(got[-1], base[-1] / 8)


def test_partial_rotary_passes_the_rest_through():
    rope = RopeSpec(theta=10000.0, rotary_dim=8)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 2, 16)), jnp.float32)
    c, s = rope_cos_sin(jnp.array([1, 2, 3]), rope)
    y = apply_rope(x, c, s)
    np.testing.assert_array_equal(np.asarray(y[..., 8:]), np.asarray(x[..., 8:]))
    assert not np.allclose(np.asarray(y[..., :8]), np.asarray(x[..., :8]))
