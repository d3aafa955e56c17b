"""Drive an engine through a schedule of arrivals: requests added at given steps, stepped until all finish.

Why it exists: batch-invariance checks (tests/engine/test_determinism.py on CPU, benchmarks/bench_determinism.py on
a device) compare a request run alone with the same request under traffic that arrives while it runs; both need
the same loop, and the step at which a request arrives is what places its steps beside other prefill chunks and
decodes.
"""
from __future__ import annotations

from typing import Hashable, Sequence


def run_arrivals(engine, reqs: Sequence[tuple]) -> tuple[dict, dict, int]:
    """reqs: (request id, prompt ids, SamplingParams, step at which it arrives). Adds each request once that many
    `engine.step()` calls have run and steps until nothing is unfinished. Returns (id -> generated token ids,
    id -> chosen-token logprobs (empty unless the request asked for logprobs), steps run)."""
    toks: dict[Hashable, list[int]] = {r[0]: [] for r in reqs}
    lps: dict[Hashable, list[float]] = {r[0]: [] for r in reqs}
    pend, step = sorted(reqs, key=lambda r: r[3]), 0
    while pend or engine.has_unfinished():
        while pend and pend[0][3] <= step:
            rid, ids, p, _ = pend.pop(0)
            engine.add_request(rid, ids, p)
        for o in engine.step():
            toks[o.request_id] += o.new_token_ids
            lps[o.request_id] += [lp[0] for lp in (o.logprobs or [])]
        step += 1
    return toks, lps, step


__all__ = ["run_arrivals"]
