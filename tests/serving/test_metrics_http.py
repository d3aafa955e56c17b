"""The metrics endpoint (serving/metrics.py): only /metrics answers 200, every sample of a served model (router too)
carries the label ``model_name`` with the served name, and the prefix cache's query / hit counters follow the engine's
totals (a total that went down is a new engine, counted from 0)."""
import dataclasses
import json
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.client import Client
from serving.fake_engine import fake_served_model
from serving.metrics import ServerMetrics
from serving.server import ROLES, ServerThread

SERVED = "acme/Fake-Chat-0.5B"     # what /v1/models and ModelInfo report: the label's value


def _values(text, model_name="m"):
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.labels == {"model_name": model_name}}


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def _assert_every_sample_labelled(text: str, model_name: str) -> list:
    """Every sample line of every ``tbjax_`` family has ``model_name="<model_name>"``, in valid exposition format;
    returns the families."""
    want = f'model_name="{model_name}"'
    lines = [ln for ln in text.splitlines() if ln.startswith("tbjax_")]
    assert lines
    bare = [ln for ln in lines if want not in ln.rsplit(" ", 1)[0]]
    assert not bare, bare[:5]
    fams = [f for f in text_string_to_metric_families(text) if f.name.startswith("tbjax_")]
    samples = [s for f in fams for s in f.samples]
    assert len(samples) == len(lines)                # the parser read every line as a sample of a tbjax_ family
    assert all(s.labels.get("model_name") == model_name for s in samples), \
        [s for s in samples if s.labels.get("model_name") != model_name][:5]
    return fams


def test_only_the_metrics_path_answers():
    m = ServerMetrics(model_name="m")
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
        m.close()


def test_every_series_of_a_served_model_carries_model_name():
    """A served model after traffic (gRPC, HTTP, a refused request): every sample of /metrics (the metrics port and
    the HTTP API's) carries its served name; histograms' _bucket / _sum / _count / _created and counters' _total /
    _created included, the metrics' own labels (phase, outcome, code, role) kept."""
    model = dataclasses.replace(fake_served_model(step_time_s=0.001), name=SERVED)
    with ServerThread(model, metrics_port=0, http_port=0) as st, Client(st.address, timeout=30) as c:
        assert c.model_info()["model"] == SERVED
        with urllib.request.urlopen(st.server.http_url + "/v1/models", timeout=10) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == [SERVED]
        assert c.generate(token_ids=[5, 6], max_tokens=4, temperature=0).completion_tokens == 4
        req = urllib.request.Request(st.server.http_url + "/v1/completions",
                                     data=json.dumps({"model": "other", "prompt": [5], "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 404
        deadline = time.time() + 10          # the request is counted when its slot is released, just after the reply
        while 'outcome="length"' not in (text := _scrape(st.server.bound_metrics_port)) and time.time() < deadline:
            time.sleep(0.02)
        with urllib.request.urlopen(st.server.http_url + "/metrics", timeout=10) as r:
            _assert_every_sample_labelled(r.read().decode(), SERVED)
    fams = _assert_every_sample_labelled(text, SERVED)
    names = {s.name for f in fams for s in f.samples}
    for suffix in ("_bucket", "_sum", "_count", "_created"):
        assert f"tbjax_time_to_first_token_seconds{suffix}" in names, suffix
    assert {"tbjax_generation_tokens_total", "tbjax_generation_tokens_created", "tbjax_ready"} <= names
    labels = [s.labels for f in fams for s in f.samples]
    assert {"model_name": SERVED, "phase": "first_token"} in labels
    assert {"model_name": SERVED, "outcome": "length"} in labels
    assert {"model_name": SERVED, "code": "HTTP_404"} in labels
    assert {"model_name": SERVED, "role": "colocated"} in labels
    assert any(set(ls) == {"model_name", "le"} for ls in labels)


def test_the_router_labels_its_series_with_the_served_name():
    model = dataclasses.replace(fake_served_model(), name=SERVED)
    with ServerThread(model, role="router", metrics_port=0, prefill_workers=["127.0.0.1:1"],
                      decode_workers=["127.0.0.1:2"]) as st:
        fams = _assert_every_sample_labelled(_scrape(st.server.bound_metrics_port), SERVED)
    assert {"model_name": SERVED, "role": "router"} in [s.labels for f in fams for s in f.samples]


@pytest.mark.parametrize("role", ROLES)
def test_every_role_labels_every_series(role):
    m = ServerMetrics(role, model_name=SERVED)
    m.phase.labels(phase="queue").observe(0.01)
    m.requests.labels(outcome="ok").inc()
    m.rejected.labels(code="UNAVAILABLE").inc()
    m.transfer_raw.inc(10)
    fams = _assert_every_sample_labelled(m.text(), SERVED)
    labels = [s.labels for f in fams for s in f.samples]
    assert {"model_name": SERVED, "role": role} in labels and {"model_name": SERVED, "code": "UNAVAILABLE"} in labels
    assert _values(m.text(), SERVED)["tbjax_kv_transfer_raw_bytes_total"] == 10
    m.close()


def test_prefix_cache_counters_follow_the_engine_totals():
    m = ServerMetrics(model_name="m")
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
