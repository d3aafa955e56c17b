"""CPU custom calls for quantized weights at decode batch sizes (tbjax/model/cpu_kernels/qgemv.cc), built on first
use with the system C++ compiler and registered through XLA's FFI.

Why: XLA:CPU runs `dot(x, dequantize(w))` as a dequantize loop that writes a bf16 copy of the weight and a dot that
reads it back, so int4 weights cost more memory traffic than bf16 ones at batch 1. The kernels read the codes once
and accumulate in float32. Built once per source hash into $TBJAX_KERNEL_CACHE (default ~/.cache/tbjax/kernels);
when no compiler is found or the build fails, `available()` is False and the model uses the XLA path
(tbjax/model/linear.py), which computes the same products.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

SRC = os.path.join(os.path.dirname(__file__), "cpu_kernels", "qgemv.cc")
MAX_T = 8                 # the kernels' largest token count; larger steps run in chunks of MAX_T rows
_lock = threading.Lock()
_state: dict = {}


def _build() -> str | None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        return None
    src = open(SRC, "rb").read()
    flags = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-w"]
    key = hashlib.sha256(src + " ".join([cxx, *flags, jax.__version__]).encode()).hexdigest()[:16]
    cache = os.environ.get("TBJAX_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tbjax", "kernels")
    out = os.path.join(cache, f"qgemv_{key}.so")
    if os.path.isfile(out):
        return out
    os.makedirs(cache, exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"
    cmd = [cxx, *flags, "-I", jax.ffi.include_dir(), SRC, "-o", tmp]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        log.warning("CPU quantized-matmul kernels did not build (XLA path used instead): %s", r.stderr[-2000:])
        return None
    os.replace(tmp, out)
    return out


def available() -> bool:
    """Whether the kernels are built and registered (builds them on the first call); TBJAX_CPU_QGEMV=0 turns off."""
    if os.environ.get("TBJAX_CPU_QGEMV", "1") == "0":
        return False
    with _lock:
        if "ok" not in _state:
            ok = False
            try:
                path = _build()
                if path is not None:
                    lib = ctypes.cdll.LoadLibrary(path)
                    jax.ffi.register_ffi_target("tbjax_qgemv_cols", jax.ffi.pycapsule(lib.TbjaxQgemvCols),
                                                platform="cpu")
                    jax.ffi.register_ffi_target("tbjax_qgemv_rows", jax.ffi.pycapsule(lib.TbjaxQgemvRows),
                                                platform="cpu")
                    _state["lib"] = lib
                    ok = True
            except Exception as e:       # a broken toolchain must not break model loading
                log.warning("CPU quantized-matmul kernels unavailable (XLA path used instead): %s", e)
            _state["ok"] = ok
        return _state["ok"]


def _require():
    if not available():
        raise RuntimeError("the CPU quantized-matmul kernels are not available (no C++ compiler, a failed build, or "
                           "TBJAX_CPU_QGEMV=0)")


def _zero_arg(w):
    return w.zero if w.zero is not None else jnp.zeros((1,), w.scale.dtype)


def takes_cols(x_TD, w) -> bool:
    """Whether qgemv_cols computes x @ w for this [D, ...] QuantizedWeight (int8 / int4, groups along D only)."""
    return (jax.default_backend() == "cpu" and w.fmt in ("int8", "int4") and x_TD.shape[0] >= 1
            and w.ndim >= 2 and all(b == 1 for b in w.block[1:]) and w.shape[0] % w.block[0] == 0
            and (w.fmt == "int8" or w.shape[-1] % 2 == 0) and available())


def takes_rows(x_TD, w) -> bool:
    """Whether qgemv_rows computes x @ w.T for this [V, D] QuantizedWeight (a tied embedding as the head)."""
    return (jax.default_backend() == "cpu" and w.fmt in ("int8", "int4") and x_TD.shape[0] >= 1
            and w.ndim == 2 and w.block[0] == 1 and w.shape[1] % w.block[1] == 0
            and (w.fmt == "int8" or (w.shape[1] % 2 == 0 and (w.shape[1] // 2) % w.block[1] == 0)) and available())


def _in_chunks(fn, x_TD, w):
    """fn(x, w) for up to MAX_T rows; more rows go through it MAX_T at a time (zero rows pad the last chunk). Every
    output row is then computed by the same kernel code whatever the step's token count: a row's value does not
    depend on the bucket it ran in (batch invariance), where XLA's dot past MAX_T rows would round it differently."""
    T = x_TD.shape[0]
    if T <= MAX_T:
        return fn(x_TD, w)
    n = -(-T // MAX_T)
    xp = jnp.pad(x_TD, ((0, n * MAX_T - T), (0, 0))).reshape(n, MAX_T, x_TD.shape[1])
    y = jax.lax.map(lambda xc: fn(xc, w), xp)
    return y.reshape(n * MAX_T, y.shape[-1])[:T]


def qgemv_cols(x_TD, w):
    """float32 [T, prod(w.shape[1:])] = x @ w (see ``_one_cols``), MAX_T rows per kernel call."""
    return _in_chunks(_one_cols, x_TD, w)


def qgemv_rows(x_TD, w):
    """float32 [T, V] = x @ w.T (see ``_one_rows``), MAX_T rows per kernel call."""
    return _in_chunks(_one_rows, x_TD, w)


def _one_cols(x_TD, w):
    """float32 [T, prod(w.shape[1:])] = x @ w for a QuantizedWeight [D, ...] with groups of w.block[0] along D.
    A view into a stack (w.index) hands the kernel the whole stack and the index: no slice is copied."""
    _require()
    D = w.shape[0]
    N = int(np.prod(w.shape[1:]))
    G = D // w.block[0]
    seg = w.shape[-1] // 2 if w.fmt == "int4" else 0
    q = w.q.reshape(-1, D, N // 2 if w.fmt == "int4" else N)
    s = w.scale.reshape(-1, G, N)
    z = w.zero.reshape(-1, G, N) if w.zero is not None else jnp.zeros((1, 1, 1), w.scale.dtype)
    call = jax.ffi.ffi_call("tbjax_qgemv_cols", jax.ShapeDtypeStruct((x_TD.shape[0], N), jnp.float32))
    return call(x_TD.astype(jnp.float32), q, s, z, group=np.int64(w.block[0]), seg=np.int64(max(seg, 1)),
                has_zero=w.zero is not None, layer=np.int64(w.index or 0))


def _one_rows(x_TD, w):
    """float32 [T, V] = x @ w.T for a QuantizedWeight [V, D] with groups of w.block[1] along D."""
    _require()
    w = w.materialize()
    z = _zero_arg(w)
    z = z if w.zero is not None else z.reshape(1, 1)
    call = jax.ffi.ffi_call("tbjax_qgemv_rows", jax.ShapeDtypeStruct((x_TD.shape[0], w.shape[0]), jnp.float32))
    return call(x_TD.astype(jnp.float32), w.q, w.scale, z, group=np.int64(w.block[1]), has_zero=w.zero is not None)
