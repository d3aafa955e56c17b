"""`python -m tbjax.serve`'s command line is generated from one dataclass (serving/serve_config.py): every field is a
flag that sets exactly that field, the documented order of what wins holds (flag > environment > derived > default),
and the rules between settings refuse bad combinations with a message naming the flags."""
import dataclasses

import pytest

from serving.serve_config import ConfigError, ServeConfig, build_parser
from tbjax.engine import EngineConfig


def _flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _value_for(f: dataclasses.Field):
    """A non-default value of the field's type, as (argv, expected value)."""
    m = f.metadata
    if m["flag"] == "store_true":
        return [_flag(f)], True
    if m["flag"] == "bool":
        return ([f"--no-{f.name.replace('_', '-')}"], False) if f.default in (True, None) else ([_flag(f)], True)
    if m["choices"]:
        v = next(c for c in m["choices"] if c != f.default)
        return [_flag(f), v], v
    t = f.type.split("|")[0].strip()
    v = {"int": 7, "float": 2.5, "str": "x7"}[t]
    return [_flag(f), str(v)], v


def test_every_field_is_a_flag_that_sets_only_that_field(monkeypatch):
    monkeypatch.delenv("TBJAX_WARMUP", raising=False)
    ap = build_parser()
    base = ap.parse_args([])
    assert isinstance(base, ServeConfig) and base == ServeConfig()     # the flags' defaults are the fields'
    fields = dataclasses.fields(ServeConfig)
    assert len(fields) >= 50
    for f in fields:
        argv, want = _value_for(f)
        got = ap.parse_args(argv)
        assert getattr(got, f.name) == want, (f.name, argv)
        assert dataclasses.replace(got, **{f.name: getattr(base, f.name)}) == base, f.name   # nothing else moved
    help_text = ap.format_help()
    assert all(_flag(f) in help_text for f in fields)


def test_what_wins(monkeypatch):
    """1 flag > 2 environment > 3 derived > 4 default."""
    monkeypatch.setenv("TBJAX_WARMUP", "0")
    assert build_parser().parse_args([]).warmup is False                      # environment over the default
    assert build_parser().parse_args(["--warmup"]).warmup is True             # the flag over the environment
    monkeypatch.delenv("TBJAX_WARMUP")
    assert build_parser().parse_args([]).warmup is True
    monkeypatch.setenv("TBJAX_API_KEY", "env-key")
    parse = build_parser().parse_args
    assert parse([]).with_environment().api_key == "env-key"
    assert parse(["--api-key", "flag-key"]).with_environment().api_key == "flag-key"
    assert parse(["--role", "decode"]).with_environment().api_key is None  # workers take no key
    # derived: the HTTP port from --port and --role, unless given
    assert parse([]).resolved_http_port() == 8000
    assert parse(["--port", "0"]).resolved_http_port() == 0
    assert parse(["--port", "0", "--http-port", "8123"]).resolved_http_port() == 8123
    assert parse(["--http-port", "0"]).resolved_http_port() is None
    assert parse(["--role", "prefill"]).resolved_http_port() is None


def test_engine_settings_reach_engine_config_fields():
    """Every engine setting given on the command line becomes the EngineConfig field of the same meaning."""
    a = build_parser().parse_args(["--max-num-seqs", "3", "--max-num-batched-tokens", "32", "--num-pages", "9",
                                   "--page-size", "8", "--max-model-len", "256", "--kv-dtype", "fp8",
                                   "--layer-buffers", "split", "--no-overlap-scheduling", "--mesh", "dp=2",
                                   "--attn-gather", "ppermute", "--speculative", "draft=self,num_tokens=3"])
    kw = a.engine_kwargs()
    weight = kw.pop("weight_dtype", None)
    assert weight is None
    cfg = EngineConfig(**kw)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.num_pages, cfg.page_size, cfg.max_model_len) == \
        (3, 32, 9, 8, 256)
    assert cfg.kv_dtype == "fp8" and cfg.layer_buffers == "split" and cfg.overlap_scheduling is False
    assert cfg.mesh == "dp=2" and cfg.decode_layout.attn_gather == "ppermute" and cfg.speculative.num_tokens == 3
    assert build_parser().parse_args([]).engine_kwargs() == {}            # nothing given: the engine decides
    assert "speculative" not in build_parser().parse_args(["--role", "prefill", "--speculative", "draft=self"]) \
        .engine_kwargs()                                                  # a prefill worker never decodes
    with pytest.raises(ConfigError, match="--speculative"):
        build_parser().parse_args(["--speculative", "num_tokens=0"]).engine_kwargs()


@pytest.mark.parametrize("argv,msg", [
    (["--role", "router"], "--prefill-workers and --decode-workers"),
    (["--role", "split", "--fake-engine"], "--fake-engine"),
    (["--pp", "2"], "--pp must be >= 1, and > 1 only with --role prefill or split"),
    (["--role", "prefill", "--pp", "2", "--fake-engine"], "--pp pipelines the real model"),
    (["--decode-workers", "h:1"], "are for --role router"),
    (["--mesh", "xp=2"], "--mesh 'xp=2'"),
    (["--role", "prefill", "--mesh", "dp=2"], "--mesh is for the colocated or decode role"),
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--api-key", ""], "--api-key must not be empty"),
    (["--role", "decode", "--api-key", "k"], "not the decode worker"),
    (["--http-port", "70000"], "--http-port must be in 0..65535"),
    (["--role", "decode", "--http-port", "8001"], "serves no HTTP API"),
    (["--role", "prefill", "--engine-process"], "--engine-process is for the colocated role"),
    (["--model", "synthetic", "--engine-process"], "the synthetic model is for benchmarks"),
])
def test_rules_between_settings(argv, msg):
    a = build_parser().parse_args(argv)
    with pytest.raises(ConfigError) as e:
        a.check()
    assert msg in str(e.value)


def test_limits_come_from_the_limit_settings():
    lim = build_parser().parse_args(["--max-tokens-limit", "99", "--default-max-tokens", "9",
                                     "--max-concurrent-requests", "5", "--max-queued-requests", "6",
                                     "--max-message-bytes", "4096", "--max-prompt-tokens", "77",
                                     "--max-prompt-bytes", "1000"]).limits()
    assert (lim.max_tokens, lim.default_max_tokens, lim.max_concurrent_requests, lim.max_queued_requests,
            lim.max_message_bytes, lim.max_prompt_tokens, lim.max_prompt_bytes) == (99, 9, 5, 6, 4096, 77, 1000)
    with pytest.raises(ValueError, match="max_concurrent_requests"):
        build_parser().parse_args(["--max-concurrent-requests", "0"]).limits()
