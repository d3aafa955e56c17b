"""JAX persistent compilation cache, on by default in a per-user directory (TBJAX_COMPILE_CACHE=0 turns it off,
TBJAX_COMPILE_CACHE=/path moves it). A second run of the same shapes loads compiled programs instead of compiling."""
from __future__ import annotations

import os

import jax

_done = False


def enable(path: str | None = None) -> str | None:
    global _done
    env = os.environ.get("TBJAX_COMPILE_CACHE")
    if env == "0":
        return None
    if jax.config.jax_compilation_cache_dir and not path:   # someone (tests, the user) configured it already
        _done = True
        return jax.config.jax_compilation_cache_dir
    path = path or env or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tbjax", "jax")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _done = True
    return path
