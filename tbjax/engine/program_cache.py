"""Step programs saved whole (serialized executables), so that a warm start loads them instead of tracing, lowering
and compiling them again.

Why: JAX's persistent compilation cache (tbjax/compile_cache.py) skips only the backend compile; it is keyed by the
lowered program, so every start still traces and lowers each step program (H200, Llama-8B shapes: ~20 s of a 26 s
warm start for 9 programs). Here the key is everything the program depends on (tbjax's own source, the JAX version,
the device kind, the mesh, the abstract arguments with their shardings, the static step settings, XLA flags), and a
hit is one deserialization. A file that does not load is deleted and the program is compiled as usual.

In-process sharing (always on): `shared_get` / `shared_put` keep the last few compiled step programs of this process
under the same keys (which hold the device ids), so a second engine with the same settings on the same devices (an
`LLM` made again in a notebook, tests) runs the first one's executables instead of compiling them again. The
parameters and KV pools are arguments of the programs, never constants in them.

Saving to disk is on by default on accelerators and off on CPU (TBJAX_PROGRAM_CACHE=1 forces it on, =0 off): on the
H200 a warm start that loaded the saved programs was ready in 10.8 s instead of 19.3 s (benchmarks/RESULTS.md); on
XLA:CPU a process that loaded saved programs and then compiled a new one failed running a step ("Function
wrapped_iota not found", jax 0.11.2), while loading a complete set, or compiling a corrupt file's program again,
worked. Only single-device meshes: deserializing an executable for
a subset of the process's devices aborts inside XLA ("num_shards == xla_hlo_sharding.num_devices()"); meshes keep
JAX's persistent cache. The programs live beside JAX's cache (`<jax cache dir>/tbjax-programs`) and follow its switch
(TBJAX_COMPILE_CACHE=0: off).
"""
from __future__ import annotations

import collections
import functools
import hashlib
import logging
import os
import pickle
import threading

import jax

log = logging.getLogger(__name__)
_PACKAGES = ("tbjax", "pallas_kernels", "sharding")


_SHARED_MAX = 64                 # compiled programs kept per process (a served model has ~15)
_shared: collections.OrderedDict = collections.OrderedDict()
_shared_lock = threading.Lock()


def shared_get(key: str):
    """This process's compiled program under `key`, or None."""
    with _shared_lock:
        exe = _shared.get(key)
        if exe is not None:
            _shared.move_to_end(key)
        return exe


def shared_put(key: str, exe) -> None:
    with _shared_lock:
        _shared[key] = exe
        _shared.move_to_end(key)
        while len(_shared) > _SHARED_MAX:
            _shared.popitem(last=False)


def shared_clear() -> None:
    """Forget this process's shared programs (the next engine compiles its own)."""
    with _shared_lock:
        _shared.clear()


def cache_dir() -> str | None:
    """Where programs are saved, or None when caching is off (no JAX cache dir configured, or it is disabled)."""
    if not enabled() or os.environ.get("TBJAX_COMPILE_CACHE") == "0" or not jax.config.jax_enable_compilation_cache:
        return None
    base = jax.config.jax_compilation_cache_dir
    return os.path.join(base, "tbjax-programs") if base else None


def enabled() -> bool:
    """TBJAX_PROGRAM_CACHE: "1" on, "0" off, unset or "auto": on unless the default backend is the CPU."""
    v = os.environ.get("TBJAX_PROGRAM_CACHE", "auto").strip().lower()
    if v not in ("0", "1", "auto", ""):
        raise ValueError(f"TBJAX_PROGRAM_CACHE must be 0, 1 or auto, got {v!r}")
    return v == "1" or (v in ("auto", "") and jax.default_backend() != "cpu")


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 over tbjax's, pallas_kernels' and sharding's Python sources (a code change is a new key)."""
    h = hashlib.sha256()
    # the packages are siblings of tbjax (a checkout or site-packages); found by path, not by import, so that a
    # same-named folder earlier on sys.path (tests/sharding under pytest) is not taken for one
    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for pkg in _PACKAGES:
        root = os.path.join(top, pkg)
        for d, _, files in sorted(os.walk(root)):
            for f in sorted(files):
                if f.endswith(".py"):
                    with open(os.path.join(d, f), "rb") as fh:
                        h.update(f.encode() + b"\0" + fh.read())
    return h.hexdigest()


def program_key(*parts) -> str:
    import jaxlib
    h = hashlib.sha256()
    for p in (source_hash(), jax.__version__, jaxlib.__version__, os.environ.get("XLA_FLAGS", ""), *parts):
        h.update(repr(p).encode() + b"\0")
    return h.hexdigest()[:40]


def load(key: str):
    """The executable saved under `key`, or None."""
    d = cache_dir()
    if d is None:
        return None
    path = os.path.join(d, key + ".bin")
    if not os.path.exists(path):
        return None
    from jax.experimental import serialize_executable as se
    _register_custom_calls()
    try:
        with open(path, "rb") as f:
            return se.deserialize_and_load(*pickle.load(f))
    except Exception as e:  # noqa: BLE001 - a bad or stale file is recompiled, never fatal
        log.warning("saved step program %s did not load (%s); compiling it", path, e)
        try:
            os.remove(path)
        except OSError:
            pass
        return None


def _register_custom_calls() -> None:
    """Register the FFI targets a saved program may call before it is loaded: XLA resolves a custom call's handler
    when the executable loads, and tbjax's CPU kernels register theirs only when first traced (a quantized model's
    first saved program failed to load, and was compiled again, for that)."""
    if jax.default_backend() == "cpu":
        from tbjax.model import cpu_qgemv
        cpu_qgemv.available()


def save(key: str, compiled) -> bool:
    d = cache_dir()
    if d is None:
        return False
    from jax.experimental import serialize_executable as se
    try:
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".{key}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(se.serialize(compiled), f)
        os.replace(tmp, os.path.join(d, key + ".bin"))      # atomic: readers see a whole file or none
        return True
    except Exception as e:  # noqa: BLE001 - caching is an optimization
        log.warning("could not save step program %s: %s", key, e)
        return False
