"""Prometheus metrics of one server: latencies (TTFT, TPOT, ITL, per phase), queues, engine state, KV transfer.

Each server owns its own ``CollectorRegistry`` (so several servers, e.g. in tests or one per role, never
clash) and exposes it over HTTP on a separate port, loopback by default. Names follow Prometheus
conventions (``tbjax_`` prefix, base units: seconds, bytes). Every sample carries the label ``model_name``, the
served model's name (what ``/v1/models`` and ``ModelInfo`` report), as vLLM's do, besides the metric's own labels
(phase, outcome, code, role); the router and the prefill/decode workers label theirs the same way. The KV-transfer
counters exist in every role so that dashboards do not change when prefill/decode disaggregation is switched on;
colocated serving leaves them at zero.

Start-up: ``tbjax_ready`` is 1 once the server has compiled its programs (warm-up) and serves, 0 before and while it
drains; ``tbjax_xla_compiles_total`` / ``tbjax_xla_compile_seconds`` count every XLA compile of the server's process
(``tbjax.compile_monitor``, compiles before the metrics existed included) plus, with the engine in a child process,
the child's (they arrive with its stats). After ``tbjax_ready`` turns 1 the compile count should not move: a rise is
a program the warm-up missed (each one stalls its whole batch).
"""
from __future__ import annotations

import functools
import socket
import threading
import weakref

from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from pallas_kernels.utils import is_number

__all__ = ["ServerMetrics", "PHASES", "CHILD_COMPILES_KEY"]

# Request phases timed separately: tokenize+validate (servicer), queue (accepted -> handed to the engine),
# first_token (handed to the engine -> first token: scheduler wait + prefill), decode (first -> last token).
PHASES = ("tokenize", "queue", "first_token", "decode")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)
_COMPILE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# the key of a child engine's stats dict that carries its compiles since the last snapshot (seconds each)
CHILD_COMPILES_KEY = "xla_compile_new_s"


def _only_metrics(app):
    """The WSGI app answering ``/metrics`` only: any other path is a 404 (prometheus_client's server answers every
    path with the metrics, so a mistyped scrape path or a probe of ``/`` would look healthy)."""
    def wrapped(environ, start_response):
        if environ.get("PATH_INFO", "") in ("/metrics", "/metrics/"):
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: metrics are at /metrics\n"]
    return wrapped


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


class _ModelLabelled:
    """A metric with labels besides ``model_name``, that label bound: ``labels(phase=...)`` is the child of this
    server's model and that phase."""

    def __init__(self, metric, model_name: str):
        self._metric, self._model_name = metric, model_name

    def labels(self, **labels):
        return self._metric.labels(model_name=self._model_name, **labels)

    def collect(self):
        return self._metric.collect()


def _model_metric(cls, registry: CollectorRegistry, model_name: str, name: str, documentation: str, labelnames=(),
                  **kw):
    """A ``cls`` (Counter, Gauge, Histogram) in ``registry`` with the labels ``model_name`` and ``labelnames``,
    ``model_name`` bound: the child of ``model_name`` when there are no others, else a ``_ModelLabelled``."""
    metric = cls(name, documentation, ("model_name", *labelnames), registry=registry, **kw)
    return _ModelLabelled(metric, model_name) if labelnames else metric.labels(model_name=model_name)


class ServerMetrics:
    """All metrics of one server, in its own registry. Thread-safe (prometheus_client objects are). ``model_name``: the
    served model's name, the ``model_name`` label of every series. A metric without labels of its own is the child of
    that label (``inc`` / ``set`` / ``observe`` as usual); one with labels of its own takes them in ``labels(...)``."""

    def __init__(self, role: str = "colocated", *, model_name: str):
        self.role = role
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        counter, gauge, histogram = (functools.partial(_model_metric, cls, r, model_name)
                                     for cls in (Counter, Gauge, Histogram))
        self.ttft = histogram("tbjax_time_to_first_token_seconds", "Request arrival to first streamed token",
                              buckets=_LATENCY_BUCKETS)
        self.tpot = histogram("tbjax_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (output tokens - 1)",
                              buckets=_TOKEN_BUCKETS)
        self.itl = histogram("tbjax_inter_token_latency_seconds", "Time between consecutive streamed chunks",
                             buckets=_TOKEN_BUCKETS)
        self.e2e = histogram("tbjax_request_latency_seconds", "Request arrival to last token",
                             buckets=_LATENCY_BUCKETS)
        self.phase = histogram("tbjax_request_phase_seconds", "Time spent per request phase", ["phase"],
                               buckets=_LATENCY_BUCKETS)
        self.step = histogram("tbjax_engine_step_seconds", "Wall time of one engine step",
                              buckets=_TOKEN_BUCKETS)
        self.prompt_tokens = counter("tbjax_prompt_tokens", "Prompt tokens of accepted requests")
        self.output_tokens = counter("tbjax_generation_tokens", "Generated tokens streamed")
        self.requests = counter("tbjax_requests", "Finished requests by outcome", ["outcome"])
        self.rejected = counter("tbjax_requests_rejected", "Requests refused before the engine", ["code"])
        self.inflight = gauge("tbjax_requests_inflight", "Accepted, not finished (running + queued)")
        self.queued = gauge("tbjax_requests_queued", "Accepted, waiting in the server's queue for a running place "
                            "(over --max-concurrent-requests)")
        self.engine_inbox = gauge("tbjax_engine_inbox_size", "Commands waiting for the engine thread")
        self.running = gauge("tbjax_engine_running_requests", "Requests the engine is running")
        self.waiting = gauge("tbjax_engine_waiting_requests", "Requests waiting inside the engine")
        self.kv_used = gauge("tbjax_kv_pages_used", "KV cache pages held by requests (not counting the prefix "
                             "cache's evictable pages: with no request running this is 0, else pages leak)")
        self.kv_cached = gauge("tbjax_kv_pages_cached", "KV cache pages held only by the prefix cache (evictable: "
                               "reused by a later prompt with the same prefix, or freed when pages run short)")
        self.kv_free = gauge("tbjax_kv_pages_free", "KV cache pages free")
        self.kv_total = gauge("tbjax_kv_pages_total", "KV cache pages in all (used + cached + free)")
        self.prefix_hit = gauge("tbjax_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / "
                                "prompt tokens looked up")
        # vLLM's prefix_cache_queries / prefix_cache_hits: tokens, so that rate(hits) / rate(queries) is the hit rate
        # of any window (the gauge above is the rate since the engine started)
        self.prefix_queries = counter("tbjax_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("tbjax_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.transfer_raw = counter("tbjax_kv_transfer_raw_bytes", "KV bytes moved between workers, before the codec")
        self.transfer_wire = counter("tbjax_kv_transfer_compressed_bytes",
                                     "KV bytes moved between workers, as sent (after the codec)")
        self.info = gauge("tbjax_server_info", "Constant 1, labelled with the server's role", ["role"])
        self.info.labels(role=role).set(1)
        self.xla_compiles = counter("tbjax_xla_compiles", "XLA compiles (persistent-cache loads included) of this "
                                    "server's process and its engine process")
        self.xla_compile_seconds = histogram("tbjax_xla_compile_seconds", "Duration of each XLA compile",
                                             buckets=_COMPILE_BUCKETS)
        self.ready = gauge("tbjax_ready", "1 once every program is compiled and the server serves, else 0")
        # speculative decoding (tbjax/engine/speculative.py; zero when it is off), after vLLM's spec_decode names
        self.spec_draft_tokens = counter("tbjax_spec_decode_num_draft_tokens", "Draft tokens proposed and verified")
        self.spec_accepted_tokens = counter("tbjax_spec_decode_num_accepted_tokens",
                                            "Draft tokens the target accepted")
        self.spec_emitted_tokens = counter("tbjax_spec_decode_num_emitted_tokens",
                                           "Tokens emitted by verify steps (accepted drafts + one sampled each)")
        self.spec_drafts = counter("tbjax_spec_decode_num_drafts", "Verified draft runs (one per sequence and step)")
        self.spec_acceptance = gauge("tbjax_spec_decode_acceptance_rate", "Accepted / proposed draft tokens (since "
                                     "the engine started)")
        self.spec_tokens_per_step = gauge("tbjax_spec_decode_tokens_per_step", "Mean tokens a sequence gains per "
                                          "verify step (1 + accepted drafts)")
        self.spec_draft_pages = gauge("tbjax_spec_decode_draft_kv_pages_used", "Draft KV ring pages held (one ring "
                                      "per running sequence)")
        self._totals_last: dict[str, float] = {}
        self._http = None
        self._lock = threading.Lock()
        self._compile_listener = None
        self.watch_compiles()

    # -- XLA compiles --------------------------------------------------------------------------------------
    def observe_compile(self, seconds: float) -> None:
        self.xla_compiles.inc()
        self.xla_compile_seconds.observe(seconds)

    def watch_compiles(self) -> None:
        """Count this process's compiles (those so far, then each new one) through ``tbjax.compile_monitor``. The
        listener holds this object weakly, and ``close()`` removes it."""
        from tbjax import compile_monitor

        if self._compile_listener is not None:
            return
        ref = weakref.ref(self)

        def on_compile(seconds: float) -> None:
            m = ref()
            if m is None:
                compile_monitor.remove_listener(on_compile)
            else:
                m.observe_compile(seconds)

        self._compile_listener = compile_monitor.add_listener(on_compile, replay=True)

    def close(self) -> None:
        """Stop counting this process's compiles (the endpoint: ``stop_http``)."""
        from tbjax import compile_monitor

        fn, self._compile_listener = self._compile_listener, None
        if fn is not None:
            compile_monitor.remove_listener(fn)

    # -- engine snapshot (engine thread) -----------------------------------------------------------------
    def update_engine(self, stats: dict) -> None:
        """Copy an ``Engine.stats()`` dict into the gauges (missing keys leave a gauge as it was)."""
        stats = dict(stats)
        for sec in stats.pop(CHILD_COMPILES_KEY, None) or ():   # a child engine's new compiles
            self.observe_compile(float(sec))
        # allocator pages: used (requests' and the prefix cache's) + free; the prefix cache's evictable ones are
        # reported on their own, so that tbjax_kv_pages_used is what requests hold
        used = stats.get("pages_used", stats.get("kv_pages_used"))
        free = stats.get("pages_free")
        cached = stats.get("pages_evictable", 0)
        if is_number(used) and is_number(cached):
            stats["kv_pages_used"] = max(used - cached, 0)
            stats["kv_pages_cached"] = cached
            if is_number(free):
                stats["kv_pages_free"] = free
                stats.setdefault("kv_pages_total", used + free)
        for key, gauge in (("running", self.running), ("waiting", self.waiting),
                           ("kv_pages_used", self.kv_used), ("kv_pages_cached", self.kv_cached),
                           ("kv_pages_free", self.kv_free), ("kv_pages_total", self.kv_total),
                           ("prefix_hit_rate", self.prefix_hit), ("spec_acceptance_rate", self.spec_acceptance),
                           ("spec_tokens_per_step", self.spec_tokens_per_step),
                           ("spec_draft_pages_used", self.spec_draft_pages)):
            v = stats.get(key)
            if is_number(v):
                gauge.set(v)
        # the engine's totals -> counter increments (a total that went down: a new engine, counted from 0)
        for key, counter in (("spec_draft_tokens", self.spec_draft_tokens),
                             ("spec_accepted_tokens", self.spec_accepted_tokens),
                             ("spec_emitted_tokens", self.spec_emitted_tokens),
                             ("spec_verify_entries", self.spec_drafts),
                             ("prefix_query_tokens", self.prefix_queries), ("prefix_hit_tokens", self.prefix_hits)):
            v = stats.get(key)
            if is_number(v):
                last = self._totals_last.get(key, 0)
                counter.inc(v - last if v >= last else v)
                self._totals_last[key] = v

    # -- exposition --------------------------------------------------------------------------------------
    def start_http(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve ``/metrics`` over HTTP on (host, port); returns the bound port (useful with port 0)."""
        with self._lock:
            if self._http is not None:
                raise RuntimeError("metrics HTTP server already started")
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]     # IPv4 or IPv6 host
            server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
            httpd = make_server(host, port, _only_metrics(make_wsgi_app(self.registry)), server_class,
                                handler_class=_QuietHandler)
            thread = threading.Thread(target=httpd.serve_forever, name="tbjax-metrics-http", daemon=True)
            thread.start()
            self._http = (httpd, thread)
            return httpd.server_port

    def stop_http(self) -> None:
        with self._lock:
            if self._http is None:
                return
            httpd, thread = self._http
            self._http = None
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)

    def text(self) -> str:
        return generate_latest(self.registry).decode()
