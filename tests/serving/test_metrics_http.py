"""The metrics endpoint (serving/metrics.py): only /metrics answers 200, and the prefix cache's query / hit
counters follow the engine's totals (a total that went down is a new engine, counted from 0)."""
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.metrics import ServerMetrics


def _values(text):
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_only_the_metrics_path_answers():
    m = ServerMetrics()
    port = m.start_http("127.0.0.1", 0)
    try:
        for path in ("/metrics", "/metrics?name[]=tbjax_ready"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                assert r.status == 200 and "tbjax_ready" in r.read().decode()
        for path in ("/", "/health", "/metricsx", "/v1/models"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10)
            assert e.value.code == 404, path
    finally:
        m.stop_http()


def test_prefix_cache_counters_follow_the_engine_totals():
    m = ServerMetrics()
    steps = [(100, 40), (250, 130), (250, 130), (30, 10)]      # cumulative (queried, hit); the last: a new engine
    want_q = want_h = 0
    last = (0, 0)
    for q, h in steps:
        m.update_engine({"prefix_query_tokens": q, "prefix_hit_tokens": h, "prefix_hit_rate": h / q})
        dq, dh = (q - last[0], h - last[1]) if q >= last[0] else (q, h)
        want_q, want_h, last = want_q + dq, want_h + dh, (q, h)
        v = _values(m.text())
        assert (v["tbjax_prefix_cache_queries_total"], v["tbjax_prefix_cache_hits_total"]) == (want_q, want_h)
        assert v["tbjax_prefix_cache_hit_rate"] == pytest.approx(h / q)
    assert (want_q, want_h) == (280, 140)
