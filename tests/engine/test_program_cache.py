"""Saved step programs (tbjax/engine/program_cache.py): a second engine with the same settings loads every step
program instead of compiling it (no backend compile at all) and gives the first engine's tokens; a corrupt file is
compiled again, not fatal; a changed setting is a new key. Runs in a subprocess with its own cache directory (the
test process keeps JAX's persistent cache off: tests/conftest.py)."""
import json
import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"   # as tests/conftest.py

CHILD = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[2], "tests"))
import jax
from tbjax import compile_cache
compile_cache.enable(sys.argv[1])
from engine_helpers import byte_tokenizer, tiny_model
from tbjax.engine import Engine, EngineConfig
from tbjax.sampling import SamplingParams
n = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda ev, d, **kw: n.__setitem__(0, n[0] + 1) if ev == "/jax/core/compile/backend_compile_duration" else None)
spec, params = tiny_model()
if sys.argv[4] != "none":          # resident quantized weights (what the default model loads as)
    from tbjax.model.quant import quantize_tree
    params = quantize_tree(params, sys.argv[4])
eng = Engine(spec, params, byte_tokenizer(), EngineConfig(num_pages=32, page_size=4, max_num_seqs=4,
                                                         max_num_batched_tokens=int(sys.argv[3])))
c0 = n[0]
info = eng.warmup()
compiles = n[0] - c0
for i, p in enumerate([[5, 6, 7], [9] * 11, [1]]):
    eng.add_request(i, p, SamplingParams.greedy(6, ignore_eos=True))
out = {}
while eng.has_unfinished():
    for o in eng.step():
        out.setdefault(o.request_id, []).extend(o.new_token_ids)
print("RESULT " + json.dumps({"compiles": compiles, "loaded": info["loaded"], "compiled": info["compiled"],
                              "programs": len(eng.runner.buckets),
                              "lp_programs": len(eng.runner._top_lp_compiled),
                              "tokens": [out[i] for i in range(3)]}))
"""


def _run(cache, budget=16, weights="none"):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE_FLAGS, TBJAX_PROGRAM_CACHE="1")   # one device
    env.pop("TBJAX_COMPILE_CACHE", None)
    p = subprocess.run([sys.executable, "-c", CHILD, str(cache), ROOT, str(budget), weights], capture_output=True, text=True,
                       env=env, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), p.stderr


def test_saved_programs_load_without_compiling_and_give_the_same_tokens(tmp_path):
    first, _ = _run(tmp_path)
    assert first["compiles"] >= first["programs"] > 1
    assert first["loaded"] == 0 and first["compiled"] == first["programs"] + first["lp_programs"]
    saved = sorted((tmp_path / "tbjax-programs").glob("*.bin"))
    assert len(saved) == first["programs"] + first["lp_programs"]      # the step and top-logprobs programs
    second, _ = _run(tmp_path)
    assert second["compiles"] == 0 and second["tokens"] == first["tokens"]
    assert second["compiled"] == 0 and second["loaded"] == first["compiled"]     # what the warm-up line reports
    saved[0].write_bytes(b"not a program")            # a corrupt file: warned about, deleted, compiled again
    third, err = _run(tmp_path)
    assert third["compiles"] >= 1 and third["tokens"] == first["tokens"] and "did not load" in err
    # (a process that loads some programs and compiles others with new keys fails on XLA:CPU: program_cache.py)


def test_quantized_weights_have_program_keys_and_load(tmp_path):
    """int8 resident weights (QuantizedWeight leaves): the key is computed, the programs save, and a second engine
    loads them and gives the same tokens."""
    first, _ = _run(tmp_path, weights="int8")
    assert first["compiles"] >= first["programs"] > 1
    second, _ = _run(tmp_path, weights="int8")
    # every program loads, the first included (its CPU kernel's FFI target is registered before the load)
    assert second["compiles"] == 0 and second["tokens"] == first["tokens"]


def test_program_cache_default_follows_the_backend(tmp_path, monkeypatch):
    """Unset: off on CPU (the tests' backend), on elsewhere; "1" forces it on, "0" off, anything else is refused."""
    import jax
    import pytest
    from tbjax.engine import program_cache
    monkeypatch.delenv("TBJAX_PROGRAM_CACHE", raising=False)
    assert jax.default_backend() == "cpu" and program_cache.cache_dir() is None
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert program_cache.enabled()
    monkeypatch.setenv("TBJAX_PROGRAM_CACHE", "0")
    assert not program_cache.enabled()
    monkeypatch.setenv("TBJAX_PROGRAM_CACHE", "yes")
    with pytest.raises(ValueError, match="TBJAX_PROGRAM_CACHE"):
        program_cache.enabled()
