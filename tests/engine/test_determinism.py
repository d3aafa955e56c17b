"""Batch invariance on the real default model (bfloat16, the CPU default): a greedy and a seeded request give the
same tokens alone and under concurrent load (other requests of other lengths arriving before and after it, so its
steps land in other token buckets, next to other prefill chunks and decodes). Reference: the request run alone."""
import numpy as np
import pytest

from tbjax.engine.engine import Engine, EngineConfig
from tbjax.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine():
    from tbjax.weights import load_model
    spec, params, tok = load_model(None, progress=False)           # the CPU default dtype: bfloat16
    return Engine(spec, params, tok, EngineConfig(num_pages=128, max_num_seqs=8, max_num_batched_tokens=64)), tok


def _run(eng, reqs):
    """reqs: (id, prompt ids, params, step at which it arrives) -> id -> tokens."""
    out = {r[0]: [] for r in reqs}
    pend, step = sorted(reqs, key=lambda r: r[3]), 0
    while pend or eng.has_unfinished():
        while pend and pend[0][3] <= step:
            rid, ids, p, _ = pend.pop(0)
            eng.add_request(rid, ids, p)
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        step += 1
    return out


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
