"""Every engine implements the declared interfaces (tbjax/engine/api.py, serving/engine_api.py) that callers use
instead of probing: the members exist with the protocol's parameters, and the values they report agree with the
engine's configuration worked out by hand (a sequence's KV room, readiness before and after warm-up, prefill-only)."""
import inspect

import jax
import pytest

from engine_helpers import byte_tokenizer, tiny_model
from serving.engine_api import EngineHandle
from serving.engine_loop import EngineLoop, EngineStopped
from serving.engine_proc import EngineProcess
from serving.fake_engine import FakeEngine
from serving.router import Router
from tbjax.engine import Engine, EngineConfig
from tbjax.engine.api import KVExporter, KVImporter, PromptScorer, StepEngine
from tbjax.prefill_pipeline import PipelinePrefillEngine
from tbjax.sampling import SamplingParams


def _members(proto):
    return [n for n, v in vars(proto).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))]


def _params_cover(impl, proto, name):
    """The implementation's method takes every named parameter of the protocol's (extra keyword-only ones allowed)."""
    want = [p for p in inspect.signature(getattr(proto, name)).parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"]
    have = inspect.signature(getattr(type(impl), name)).parameters
    return all(p.name in have for p in want)


def _check(impl, proto):
    assert isinstance(impl, proto), f"{type(impl).__name__} is not a {proto.__name__}"
    for name in _members(proto):
        missing = object()
        attr = inspect.getattr_static(type(impl), name, missing)
        if isinstance(vars(proto)[name], property):
            assert attr is not missing or name in vars(impl), f"{type(impl).__name__}.{name} missing"
        else:
            assert callable(getattr(impl, name)) and _params_cover(impl, proto, name), f"{type(impl).__name__}.{name}"


@pytest.fixture(scope="module")
def tiny():
    spec, params = tiny_model()
    return spec, params, byte_tokenizer()


def test_engine_is_a_step_engine_exporter_and_importer(tiny):
    spec, params, tok = tiny
    eng = Engine(spec, params, tok, EngineConfig(num_pages=40, page_size=8, max_num_seqs=2, max_num_batched_tokens=16,
                                                 max_model_len=256))
    for proto in (StepEngine, KVExporter, KVImporter):
        _check(eng, proto)
    assert not isinstance(eng, PromptScorer)
    assert eng.prefill_only is False and eng.max_model_len == 256
    assert eng.kv_tokens_per_sequence == (40 - 1) * 8          # one null page per rank, 8 tokens a page
    assert eng.ready is False
    info = eng.warmup()
    assert eng.ready is True and info["programs"] >= 1


def test_fake_engine_is_a_step_engine_and_prompt_scorer():
    eng = FakeEngine(num_pages=64, page_size=4, max_model_len=128)
    for proto in (StepEngine, PromptScorer):
        _check(eng, proto)
    assert eng.kv_tokens_per_sequence == 63 * 4 and eng.max_model_len == 128 and eng.prefill_only is False
    assert eng.ready is False and eng.warmup()["programs"] >= 1 and eng.ready is True


def test_pipeline_prefill_engine_is_a_prefill_only_step_engine(tiny):
    spec, params, tok = tiny
    eng = PipelinePrefillEngine(spec, params, tok, jax.devices()[:2], page_size=8, chunk_tokens=16, max_model_len=64)
    for proto in (StepEngine, KVExporter):
        _check(eng, proto)
    assert not isinstance(eng, KVImporter)
    assert eng.prefill_only is True and eng.kv_tokens_per_sequence is None
    assert eng.ready is False
    assert eng.warmup()["programs"] == 2 and eng.ready is True and not eng.has_unfinished()
    with pytest.raises(ValueError, match="prefill_only"):
        eng.add_request("x", [1, 2, 3], SamplingParams.greedy(2))


def test_engine_handles_implement_the_handle_interface():
    loop = EngineLoop(FakeEngine())
    proc = EngineProcess.__new__(EngineProcess)    # the class's members, without starting a child process
    router = Router(["127.0.0.1:1"], ["127.0.0.1:2"])
    for h in (loop, router):
        _check(h, EngineHandle)
    for name in _members(EngineHandle):
        assert hasattr(EngineProcess, name) or name in ("engine", "warmup_info"), name
        if callable(vars(EngineHandle)[name]):
            assert _params_cover(proc, EngineHandle, name), name
    assert loop.engine is not None and router.engine is None and router.warmup_info is None
    assert router.ready and router.wait_ready(0) is True
    with pytest.raises(EngineStopped, match="no engine"):
        router.call(lambda e: e).result(1)
    router.stop()
    assert not router.alive
