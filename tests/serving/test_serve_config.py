"""`python -m tbjax.serve`'s command line is generated from one dataclass (serving/serve_config.py): every field is a
flag that sets exactly that field and shows its default in --help, a field that is not a full setting cannot be
added, the documented order of what wins holds (flag > environment > derived > default), and validate() refuses bad
values and bad combinations with a message naming the flags (exit 2 from the command)."""
import argparse
import dataclasses
import os
import re

import pytest

from serving import cli, serve_config
from serving.serve_config import ConfigError, ServeConfig, build_parser
from tbjax.engine import EngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
                                   "--attn-gather", "ppermute", "--speculative", "draft=self,num_tokens=3",
                                   "--deterministic"])
    kw = a.engine_kwargs()
    weight = kw.pop("weight_dtype", None)
    assert weight is None
    cfg = EngineConfig(**kw)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.num_pages, cfg.page_size, cfg.max_model_len) == \
        (3, 32, 9, 8, 256)
    assert cfg.kv_dtype == "fp8" and cfg.layer_buffers == "split" and cfg.overlap_scheduling is False
    assert cfg.mesh == "dp=2" and cfg.decode_layout.attn_gather == "ppermute" and cfg.speculative.num_tokens == 3
    assert cfg.deterministic is True
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
        a.validate()
    assert msg in str(e.value) and e.value.usage


def test_limits_come_from_the_limit_settings():
    lim = build_parser().parse_args(["--max-tokens-limit", "99", "--default-max-tokens", "9",
                                     "--max-concurrent-requests", "5", "--max-queued-requests", "6",
                                     "--max-message-bytes", "4096", "--max-prompt-tokens", "77",
                                     "--max-prompt-bytes", "1000"]).limits()
    assert (lim.max_tokens, lim.default_max_tokens, lim.max_concurrent_requests, lim.max_queued_requests,
            lim.max_message_bytes, lim.max_prompt_tokens, lim.max_prompt_bytes) == (99, 9, 5, 6, 4096, 77, 1000)
    with pytest.raises(ValueError, match="max_concurrent_requests"):
        build_parser().parse_args(["--max-concurrent-requests", "0"]).limits()


def _help_entries(ap: argparse.ArgumentParser) -> dict:
    """--help as {first flag: its whole entry on one line} (the help formatted without wrapping)."""
    ap.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100_000, max_help_position=100_000)
    entries, flag = {}, None
    for line in ap.format_help().splitlines():
        m = re.match(r"  (--[a-z-]+)", line)
        if m:
            flag = m.group(1)
            entries[flag] = line.strip()
        elif flag and line.startswith("   "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


def test_help_shows_every_field_with_its_default(monkeypatch):
    monkeypatch.delenv("TBJAX_WARMUP", raising=False)
    entries = _help_entries(build_parser())
    for f in dataclasses.fields(ServeConfig):
        m = f.metadata
        assert m["help"], f.name
        assert f.default not in (None, "") or m["shown"], f"{f.name}: say what the default means (shown=)"
        shown = m["shown"] if m["shown"] is not None else f.default
        entry = entries[_flag(f)]
        assert entry.endswith(f"{m['help']} (default: {shown})"), (f.name, entry)
        if m["choices"]:
            assert "{" + ",".join(m["choices"]) + "}" in entry, f.name
    # the engine defaults shown are the engine's own
    assert entries["--max-num-seqs"].endswith(f"(default: {EngineConfig().max_num_seqs})")
    assert entries["--page-size"].endswith(f"(default: {EngineConfig().page_size})")
    assert set(entries) == {_flag(f) for f in dataclasses.fields(ServeConfig)}   # no flag without a field


_CHOICE_FIELDS = [f for f in dataclasses.fields(ServeConfig) if f.metadata["choices"]]


@pytest.mark.parametrize("f", _CHOICE_FIELDS, ids=[f.name for f in _CHOICE_FIELDS])
def test_an_invalid_choice_exits_2_with_one_line_naming_the_flag(f, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([_flag(f), "bogus-value"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: python -m tbjax.serve")
    assert re.fullmatch(rf"python -m tbjax\.serve: error: argument {_flag(f)}: invalid choice: 'bogus-value' "
                        r"\(choose from .*\)", err[-1], re.IGNORECASE), err[-1]
    # a config built in code is held to the same choices
    with pytest.raises(ConfigError, match=f"^{_flag(f)}: invalid choice 'bogus-value'"):
        dataclasses.replace(ServeConfig(), **{f.name: "bogus-value"}).validate()


def test_bad_values_are_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--port", "eighty"])
    assert e.value.code == 2 and "error: argument --port: invalid int value: 'eighty'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["--role", "router"])             # a rule between settings: argparse's error line
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("python -m tbjax.serve: error: --role router needs "
                                                        "--prefill-workers and --decode-workers")
    # values the server's parts refuse: one line, exit 2, before anything loads
    assert cli.main(["--fake-engine", "--max-concurrent-requests", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tbjax: bad limits: ") and "max_concurrent_requests" in err and err.count("\n") == 1
    bad = tmp_path / "generation_config.json"
    bad.write_text("{not json")
    assert cli.main(["--generation-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tbjax: --generation-config: ") and err.count("\n") == 1
    assert ServeConfig(fake_engine=True, generation_config=str(bad)).validate() is None   # no model: not read


def test_a_field_that_is_not_a_full_setting_cannot_be_added():
    """The parser is the dataclass: a new field becomes a flag, and one without help, without a stated default
    (None / ""), of an unknown group or of a type no flag takes fails before any command line exists."""
    @dataclasses.dataclass
    class WithExtra(ServeConfig):
        extra_knob: int = serve_config._s(3, "a knob", "engine")

    ap = build_parser(config=WithExtra)
    assert _help_entries(ap)["--extra-knob"].endswith("a knob (default: 3)")
    got = ap.parse_args(["--extra-knob", "5"])
    assert isinstance(got, WithExtra) and got.extra_knob == 5

    with pytest.raises(TypeError, match="help"):
        serve_config._s(3, "")
    with pytest.raises(TypeError, match="shown="):
        serve_config._s(None, "a knob")

    @dataclasses.dataclass
    class Bare(ServeConfig):
        bare_knob: int = 0
    with pytest.raises(TypeError, match="Bare.bare_knob is not a setting"):
        build_parser(config=Bare)

    @dataclasses.dataclass
    class BadGroup(ServeConfig):
        knob: int = serve_config._s(0, "a knob", "nowhere")
    with pytest.raises(TypeError, match="unknown flag group 'nowhere'"):
        build_parser(config=BadGroup)

    @dataclasses.dataclass
    class BadType(ServeConfig):
        knob: list = serve_config._s((), "a knob")
    with pytest.raises(TypeError, match="int, float or str"):
        build_parser(config=BadType)


def test_what_wins_is_written_where_it_is_decided():
    """Every environment variable the settings read is named in the precedence of the module docstring and of
    docs/serving.md, next to the other levels (a new one cannot go unwritten)."""
    with open(serve_config.__file__) as f:
        env = set(re.findall(r"os\.environ\.get\(\"(\w+)\"", f.read()))
    assert env == {"TBJAX_WARMUP", "TBJAX_API_KEY"}
    with open(os.path.join(ROOT, "docs", "serving.md")) as f:
        docs = f.read()
    cli_section, doc = (" ".join(t.split()) for t in (docs[docs.index("## The CLI"):], serve_config.__doc__))
    for words in (*env, "a flag", "the environment", "derived", "default", "generation_config.json", "explicit",
                  "no configuration file"):
        assert words in doc and words in cli_section, words
