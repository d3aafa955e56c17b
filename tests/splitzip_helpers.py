"""Shared inputs for the SplitZip tests: a printed, reproducible random seed and KV-like bf16 data."""
import os
import secrets

import ml_dtypes
import numpy as np
import pytest

BF16 = ml_dtypes.bfloat16


@pytest.fixture
def rng():
    seed = int(os.environ.get("SPLITZIP_SEED", secrets.randbits(32)))
    print(f"seed {seed} (rerun with SPLITZIP_SEED={seed})")
    return np.random.default_rng(seed)


def kv_like(rng, n, head_dim=64):
    t = -(-n // head_dim)
    sc = np.exp2(rng.uniform(-3, 1, head_dim))
    st = np.exp2(rng.uniform(-1, 1, (t, 1)))
    return (rng.standard_normal((t, head_dim)) * sc * st).astype(BF16).reshape(-1)[:n]
