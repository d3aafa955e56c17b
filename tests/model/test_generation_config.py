"""One set of sampling defaults (tbjax.weights.generation_config) for tbjax.LLM, python -m tbjax.generate, gRPC and
HTTP: from generation_config.json / GGUF sampling metadata / the default model's card, `--generation-config
auto|none|PATH`; a request's explicit values always win; the config's eos ids end generations. No model weights are
loaded here (stub engines, the fake engine, the default model's tokenizer only)."""
import json

import pytest

from tbjax.sampling import LIBRARY_DEFAULTS, SamplingParams
from tbjax.weights import load_generation_defaults
from tbjax.weights.generation_config import (SMOLLM2_CARD, GenerationConfigError, GenerationDefaults,
                                             from_generation_config, from_gguf_metadata)


def test_sampling_params_unset_fields_take_defaults_explicit_ones_win():
    p = SamplingParams(max_tokens=5, top_k=7)
    assert (p.temperature, p.top_p, p.min_p) == (None, None, None)
    q = p.with_defaults({"temperature": 0.2, "top_p": 0.9, "top_k": 50})
    assert (q.temperature, q.top_p, q.top_k, q.min_p) == (0.2, 0.9, 7, None)   # top_k was explicit
    assert p.temperature is None                                               # a copy
    assert SamplingParams(temperature=0.0).with_defaults({"temperature": 0.7}).temperature == 0.0   # 0 is explicit
    v = SamplingParams().validate()
    assert {k: getattr(v, k) for k in LIBRARY_DEFAULTS} == LIBRARY_DEFAULTS   # what neither sets
    assert SamplingParams.greedy(4).temperature == 0.0


def test_generation_config_fields():
    d = from_generation_config({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                "eos_token_id": [128001, 128009], "repetition_penalty": 1.05, "max_length": 4096})
    assert d.sampling() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert d.eos_token_ids == (128001, 128009) and d.ignored == ("repetition_penalty",)
    assert d.make_params(max_tokens=3).temperature == 0.6
    assert d.make_params(max_tokens=3, temperature=1.3, top_k=0).top_k == 0           # the request wins
    assert from_generation_config({"eos_token_id": 2}).sampling() == {}               # only eos: no sampling defaults
    assert from_generation_config({"eos_token_id": 2}).eos_token_ids == (2,)
    assert from_generation_config({"do_sample": False, "temperature": 0.6}).temperature == 0.0   # greedy, as asked
    assert from_generation_config({"repetition_penalty": 1.0}).ignored == ()          # neutral: nothing ignored
    for bad, field in (({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"),
                       ({"eos_token_id": [1, "x"]}, "eos_token_id"), ({"top_k": -2}, "top_k")):
        with pytest.raises(GenerationConfigError, match=field):
            from_generation_config(bad)


def test_sources_auto_none_path(tmp_path):
    d = load_generation_defaults(None)                       # the default model: its card's settings
    assert d.sampling() == SMOLLM2_CARD == {"temperature": 0.2, "top_p": 0.9}
    assert "card" in d.source
    assert load_generation_defaults(None, "none").sampling() == {}
    f = tmp_path / "gc.json"
    f.write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "eos_token_id": 5}))
    assert load_generation_defaults(None, str(f)).sampling() == {"temperature": 0.7, "top_p": 0.8}   # PATH wins
    hf = tmp_path / "hf"
    hf.mkdir()
    assert load_generation_defaults(str(hf)).sampling() == {}                       # a directory without one
    (hf / "generation_config.json").write_text(json.dumps({"temperature": 0.5, "min_p": 0.05}))
    assert load_generation_defaults(str(hf)).sampling() == {"temperature": 0.5, "min_p": 0.05}
    assert load_generation_defaults(None, str(hf)).sampling() == {"temperature": 0.5, "min_p": 0.05}  # dir as PATH
    with pytest.raises(GenerationConfigError, match="no generation config"):
        load_generation_defaults(None, str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text("{nope")
    with pytest.raises(GenerationConfigError, match="JSON"):
        load_generation_defaults(None, str(tmp_path / "broken.json"))


def test_gguf_sampling_metadata():
    d = from_gguf_metadata({"general.sampling.temp": 0.3, "general.sampling.top_k": 40,
                            "general.sampling.min_p": 0.1}, "m.gguf")
    assert d.sampling() == {"temperature": 0.3, "top_k": 40, "min_p": 0.1}
    assert from_gguf_metadata({"general.name": "x"}, "m.gguf") is None


class _RecordingEngine:
    """Stands in for tbjax.engine.Engine in LLM: records what add_request gets and finishes at once."""

    def __init__(self, spec, params, tokenizer, config):
        self.tokenizer, self.added, self._out = tokenizer, [], []

    def add_request(self, rid, ids, params):
        params.validate()
        self.added.append(params)
        from tbjax.engine.engine import RequestOutput
        self._out.append(RequestOutput(rid, [7], "x", True, "length"))

    def step(self):
        out, self._out = self._out, []
        return out

    def has_unfinished(self):
        return bool(self._out)

    def abort(self, rid):
        pass


def test_llm_applies_the_defaults_and_the_config_eos_ids(monkeypatch):
    import tbjax.llm
    from tbjax.weights import load_model_info
    monkeypatch.setattr(tbjax.llm, "Engine", _RecordingEngine)
    spec, tok = load_model_info(None)
    gd = GenerationDefaults(temperature=0.25, top_p=0.8, eos_token_ids=(0, 2), source="test")
    llm = tbjax.llm.LLM.from_parts(spec, None, tok, generation_config=gd)
    assert tok.eos_token_ids == (2, 0)                        # the GGUF's eos, then the config's extra one
    llm.generate([5, 6], SamplingParams(max_tokens=2))
    llm.generate([5, 6], SamplingParams(max_tokens=2, temperature=0.0, top_p=1.0))
    llm.generate([5, 6])
    (a, b, c) = llm.engine.added
    assert (a.temperature, a.top_p, a.top_k) == (0.25, 0.8, 0)   # unset: the model's, then the library's
    assert (b.temperature, b.top_p) == (0.0, 1.0)                # explicit wins
    assert (c.temperature, c.top_p) == (0.25, 0.8)
    assert llm.make_params(seed=3).temperature == 0.25
    assert tbjax.llm.LLM.from_parts(spec, None, tok).generation_defaults.sampling() == {}   # parts: none by default
    with pytest.raises(ValueError, match="from_parts cannot find"):
        tbjax.llm.LLM.from_parts(spec, None, tok, generation_config="auto")


def test_llm_default_model_uses_the_card(monkeypatch):
    import tbjax.llm
    import tbjax.weights
    from tbjax.weights import load_model_info
    spec, tok = load_model_info(None)
    monkeypatch.setattr(tbjax.llm, "Engine", _RecordingEngine)
    monkeypatch.setattr(tbjax.weights, "load_model", lambda *a, **k: (spec, None, tok))
    llm = tbjax.llm.LLM(warmup=False, progress=False)
    assert llm.generation_defaults.sampling() == SMOLLM2_CARD
    assert tbjax.llm.LLM(warmup=False, progress=False, generation_config="none").generation_defaults.sampling() == {}


def test_generate_cli_passes_flags_and_generation_config(monkeypatch, capsys, tmp_path):
    import tbjax.llm
    from tbjax.generate import main
    seen = {}

    class StubLLM:
        def __init__(self, model=None, **kw):
            seen["kw"] = kw

        def generate(self, prompts, params):
            seen["params"] = params
            return [type("C", (), {"text": "ok", "token_ids": [1]})() for _ in prompts]

    monkeypatch.setattr(tbjax.llm, "LLM", StubLLM)
    assert main(["hi"]) == 0
    p = seen["params"]
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (None, None, None, None)   # the model's defaults apply
    assert seen["kw"]["generation_config"] == "auto"
    assert main(["--temperature", "0", "--generation-config", "none", "hi"]) == 0
    assert seen["params"].temperature == 0.0 and seen["kw"]["generation_config"] == "none"
    capsys.readouterr()
    assert main(["--top-p", "0", "hi"]) == 2 and "top_p" in capsys.readouterr().err
