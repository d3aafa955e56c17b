"""Batch invariance on the real default model (bfloat16, the CPU default): a greedy and a seeded request give the
same tokens alone and under concurrent load (other requests of other lengths arriving before and after it, so its
steps land in other token buckets, next to other prefill chunks and decodes). Reference: the request run alone."""
import numpy as np
import pytest

from tbjax.engine.arrivals import run_arrivals
from tbjax.engine.engine import Engine, EngineConfig
from tbjax.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine():
    from tbjax.weights import load_model
    spec, params, tok = load_model(None, progress=False)           # the CPU default dtype: bfloat16
    return Engine(spec, params, tok, EngineConfig(num_pages=128, max_num_seqs=8, max_num_batched_tokens=64)), tok


def _run(eng, reqs):
    """reqs: (id, prompt ids, params, step at which it arrives) -> id -> tokens."""
    return run_arrivals(eng, reqs)[0]


def test_tokens_do_not_depend_on_concurrent_traffic(engine):
    eng, tok = engine
    target = tok.encode("The meaning of life is")
    greedy = SamplingParams(max_tokens=12, temperature=0)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    alone = {**_run(eng, [("g", target, greedy, 0)]), **_run(eng, [("s", target, seeded, 0)])}
    rng = np.random.default_rng(0)
    others = [(f"o{i}", [int(x) for x in rng.integers(10, 5000, n)], SamplingParams(max_tokens=6, temperature=0), at)
              for i, (n, at) in enumerate([(40, 0), (7, 0), (90, 2), (3, 5)])]
    loaded = _run(eng, others + [("g", target, greedy, 1), ("s", target, seeded, 2)])
    assert loaded["g"] == alone["g"]
    assert loaded["s"] == alone["s"]
