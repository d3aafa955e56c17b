"""The speculative-decoding metrics: engine totals (Engine.stats()) become Prometheus counters by increments, with
vLLM-like names; a new engine's totals (lower than the last seen) count from zero."""
from serving.metrics import ServerMetrics


def _value(m, name):
    for line in m.text().splitlines():
        if line.startswith(name + '{model_name="m"} '):
            return float(line.split()[1])
    raise KeyError(name)


def test_spec_counters_follow_engine_totals():
    m = ServerMetrics(model_name="m")
    m.update_engine({"spec_draft_tokens": 12, "spec_accepted_tokens": 9, "spec_emitted_tokens": 13,
                     "spec_verify_entries": 4, "spec_acceptance_rate": 0.75, "spec_tokens_per_step": 3.25,
                     "spec_draft_pages_used": 18})
    m.update_engine({"spec_draft_tokens": 20, "spec_accepted_tokens": 12})
    assert _value(m, "tbjax_spec_decode_num_draft_tokens_total") == 20
    assert _value(m, "tbjax_spec_decode_num_accepted_tokens_total") == 12
    assert _value(m, "tbjax_spec_decode_num_emitted_tokens_total") == 13
    assert _value(m, "tbjax_spec_decode_num_drafts_total") == 4
    assert _value(m, "tbjax_spec_decode_acceptance_rate") == 0.75
    assert _value(m, "tbjax_spec_decode_tokens_per_step") == 3.25
    assert _value(m, "tbjax_spec_decode_draft_kv_pages_used") == 18
    m.update_engine({"spec_draft_tokens": 5})          # a restarted engine: its own total counts on top
    assert _value(m, "tbjax_spec_decode_num_draft_tokens_total") == 25
    m.close()
