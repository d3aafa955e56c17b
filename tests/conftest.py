"""Test setup: 8 fake CPU devices, XLA:CPU compiling fast (-O0), CPU computations run inline, no persistent
compilation cache."""
import os

# XLA:CPU compiles at -O0 without LLVM's expensive passes: most of the suite's time is compiling (the default model's
# step programs, on 2 cores), and the tests check what the programs compute, not how fast. Measured on the 2-core
# box, the default model's first generate: 15 compiles in 52 s at the defaults, 24 s with these flags; same tokens.
# Subprocesses (servers) inherit them; scripts/gpu_hlo_overlap.py drops them for its GPU compiles.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 " + FAST_COMPILE_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# LLM() and `python -m tbjax.serve` compile every step program before they are ready (8-9 programs of the 30-layer
# default model: minutes on 2 CPU cores); most tests need one or two, so here the default is off. Tests about the
# warm-up turn it on themselves (explicit warmup=True / --warmup, or TBJAX_WARMUP=1); subprocesses inherit this.
os.environ.setdefault("TBJAX_WARMUP", "0")

import jax  # noqa: E402

# CPU computations run inline, not asynchronously: a Pallas GPU-interpreter kernel dispatched eagerly otherwise keeps
# running its host callbacks (jnp ops on XLA's CPU threads) while the test goes on, and on 2 cores that deadlocked
# (test_decode_matmul, 2026-11-29: the main thread's next eager op waited on the interpreter's) and is the suspect
# of three segfaults inside XLA:CPU in clean-clone runs the same day.
jax.config.update("jax_cpu_enable_async_dispatch", False)

# No persistent compilation cache inside the test process: four clean-clone runs on 2026-11-29 crashed in its path
# (SIGSEGV / abort in executable.serialize() or in the compile of _compile_and_write_cache: Pallas-interpreter
# programs with host callbacks, an 8-device shard_map forward), never reproducible alone. The servers that tests
# start in subprocesses keep tbjax's own cache (tbjax/compile_cache.py); in this process it stays off even when
# tbjax.LLM() configures a cache directory.
jax.config.update("jax_enable_compilation_cache", False)

import json  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="session")
def hf_ref():
    """transformers' own outputs on the default model (see scripts/make_hf_reference.py)."""
    with open(os.path.join(DATA, "smollm2_hf_reference.json")) as f:
        meta = json.load(f)
    return meta, dict(np.load(os.path.join(DATA, "smollm2_hf_reference.npz")))


@pytest.fixture(scope="session")
def smollm_f32():
    """(spec, params, tokenizer) of the default model in float32, loaded once per test session."""
    from tbjax.weights import load_model
    return load_model(None, dtype="float32", progress=False)


@pytest.fixture(scope="session")
def smollm_llm(smollm_f32):
    """An LLM over the default model in float32 with a small engine, shared by the tests that generate."""
    from tbjax.llm import LLM
    spec, params, tok = smollm_f32
    return LLM.from_parts(spec, params, tok, num_pages=256, max_num_seqs=8, max_num_batched_tokens=64)


_TESTS = os.path.dirname(os.path.abspath(__file__))


def _grouped_folders():
    with open(os.path.join(_TESTS, "groups.txt")) as f:
        lines = [ln.split() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    return {d for line in lines for d in line if not d.startswith("n=")}


def pytest_configure(config):
    """Every test file sits in a subsystem folder that tests/groups.txt lists: CI runs the folders named there, so a
    file anywhere else would silently never run. Checked at the start of every run, whatever it selects."""
    listed = _grouped_folders()
    stray = []
    for root, dirs, files in os.walk(_TESTS):
        dirs[:] = [d for d in dirs if d not in ("data", "__pycache__")]
        rel = os.path.relpath(root, _TESTS)
        for name in files:
            if name.startswith("test_") and name.endswith(".py") and (rel == "." or rel.split(os.sep)[0] not in listed):
                stray.append(os.path.join(rel, name))
    if stray:
        raise pytest.UsageError(
            f"test files outside the folders tests/groups.txt lists ({sorted(listed)}), which CI would never run: "
            f"{sorted(stray)}")
