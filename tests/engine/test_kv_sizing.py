"""KV pool sizing from free device memory: the page count must not move with a few MB of start-up noise (it fixes the
step programs' shapes, so a different count at the next start is a program-cache miss and a full recompile)."""
import json
import os

import pytest

from tbjax.engine.kv_cache import auto_num_pages, page_bytes, stable_page_count
from tbjax.spec import ModelSpec

GIB = 1 << 30
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "data", "configs")


def _spec(name):
    with open(os.path.join(CONFIGS, name)) as f:
        return ModelSpec.from_hf_config(json.load(f))


class _FakeGPU:
    platform = "gpu"

    def __init__(self, limit, in_use):
        self.limit, self.in_use = limit, in_use

    def memory_stats(self):
        return {"bytes_limit": self.limit, "bytes_in_use": self.in_use}


@pytest.mark.parametrize("pages", [0, 1, 2, 127, 128, 129, 1000, 4095, 4096, 65537, 184_467, 10**7 + 3])
def test_stable_page_count_bounds(pages):
    got = stable_page_count(pages)
    if pages < 128:
        assert got == max(2, pages)
        return
    # brute force: the largest power of two <= pages / 64, and the count a multiple of it, at most pages
    step = max(s for s in (2 ** i for i in range(40)) if s <= pages / 64)
    assert got % step == 0
    assert pages - step < got <= pages
    assert got >= pages * (1 - 1 / 64)


def test_auto_num_pages_same_count_under_startup_noise():
    spec = _spec("smollm2-135m-instruct.json")
    per_page = page_bytes(spec, 16, "bfloat16")
    params = 270 * (1 << 20)
    counts = set()
    # an 80 GB card, 1.0 GB in use, +- up to 40 MB of temporaries not yet freed
    for extra_mb in range(-40, 41, 8):
        dev = _FakeGPU(80 * GIB, GIB + extra_mb * (1 << 20))
        counts.add(auto_num_pages(spec, 16, "bfloat16", params, device=dev))
    assert len(counts) == 1, counts
    (n,) = counts
    # independent of the code: what fits in 85% of the free memory less the activation headroom, at most 1/64 less
    exact = (int((80 * GIB - GIB - 40 * (1 << 20)) * 0.85) - 2 * params // spec.n_layers) // per_page
    assert exact * (1 - 1 / 64) <= n <= exact + 64


def test_auto_num_pages_cpu_is_fixed():
    class CPU:
        platform = "cpu"
    assert auto_num_pages(_spec("llama-3.1-8b.json"), 16, "bfloat16", 16 * GIB, device=CPU()) == 16384 // 16 + 1
