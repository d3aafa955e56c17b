"""Shared by the benchmark scripts: the run's identity in every JSON (one ``commit`` field), and compile time read
directly from JAX's own duration events.

Every script writes its JSON through ``write_json``, which stamps ``commit`` (``git rev-parse --short HEAD`` of the
tree the script runs from, else ``$TBJAX_COMMIT`` for copies without ``.git``, e.g. a ``git archive`` on the GPU
machine), ``date`` and ``host`` unless the result already has them."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LEGACY_COMMIT_KEYS = ("git_commit", "git", "sha")

_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "backend"}


def git_commit() -> str:
    """``$TBJAX_COMMIT`` when set (the device machine's copy of the tree is not the checkout: a stale git directory
    there named an older commit), else the short commit of this tree's checkout, else "unknown"."""
    if os.environ.get("TBJAX_COMMIT"):
        return os.environ["TBJAX_COMMIT"]
    try:
        c = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                           timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        c = ""
    return c or "unknown"


def run_info() -> dict:
    """commit, date, host and python of this run."""
    return {"commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
            "python": platform.python_version()}


def write_json(path: str, result) -> None:
    """Write ``result`` (a dict, or a list that becomes ``{"rows": ...}``) with the run's identity fields."""
    out = {"rows": result} if isinstance(result, list) else result
    if isinstance(out, dict):
        for k in _LEGACY_COMMIT_KEYS:
            out.pop(k, None)
        for k, v in run_info().items():
            out.setdefault(k, v)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)


def compile_timer() -> dict:
    """A dict {trace, lower, backend} of seconds that JAX keeps adding to as it compiles (or loads from cache)."""
    import jax

    acc = {"trace": 0.0, "lower": 0.0, "backend": 0.0}

    def _listen(event, duration, **_):
        if event in _EVENTS:
            acc[_EVENTS[event]] += duration
    jax.monitoring.register_event_duration_secs_listener(_listen)
    return acc


def run_json_worker(cmd, timeout: float, mark: str, *, cwd=None, env=None, stderr_on_success: bool = False) -> dict:
    """Run a worker process; return the last JSON it printed after `mark` (partial results survive a timeout or a
    crash), with worker_status, worker_wall_s and stderr_tail (on failure; also on success with
    `stderr_on_success`, its last lines)."""
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
    try:
        out, err = p.communicate(timeout=max(timeout, 1))
        status = f"exit {p.returncode}"
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        status = f"killed after {timeout:.0f}s (its time limit)"
    last = {}
    for line in out.splitlines():
        if line.startswith(mark):
            last = json.loads(line[len(mark):])
    last["worker_status"] = status
    last["worker_wall_s"] = time.time() - t0
    if p.returncode:
        last["stderr_tail"] = err[-3000:]
    elif stderr_on_success:
        last["stderr_tail"] = "\n".join(err.splitlines()[-12:])[-1500:]
    return last


def forward_argv(ap: argparse.ArgumentParser, args: argparse.Namespace, skip=()) -> list:
    """The command-line options that reproduce `args` under `ap` (every option, so a worker process started with
    them sees what the orchestrator was given), leaving out the destinations in `skip` and options at None."""
    out = []
    for a in ap._actions:
        if not a.option_strings or a.dest in skip or a.dest == "help":
            continue
        v = getattr(args, a.dest)
        if a.nargs == 0:                                  # store_true / store_false
            if v != a.default:
                out.append(a.option_strings[0])
        elif v is not None:
            out += [a.option_strings[0], str(v)]
    return out


def add_options(ap: argparse.ArgumentParser, options: dict, type=None) -> None:
    """``ap.add_argument(name, type=type, default=default)`` for each name -> default of `options`, in order."""
    for name, default in options.items():
        ap.add_argument(name, type=type, default=default)


def json_saver(out, name: str, result: dict):
    """A ``save()`` that writes `result` to `out` (when given) and to ``$OUT/<name>`` (when ``$OUT`` is set)."""
    paths = [out] if out else []
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], name))

    def save():
        for p in paths:
            write_json(p, result)
    return save


def torch_copy_script(iters: int, *, prefix: str = "", fill_random: bool = False) -> str:
    """Python source for a subprocess: the median of `iters` CUDA-event-timed torch copies of a 2 GiB uint8 buffer
    (`fill_random`: filled with random bytes first), printed as one JSON line after `prefix`."""
    fill = "x.random_(0, 255)\n" if fill_random else ""
    return (
        "\nimport json, torch\n"
        "x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=\"cuda\"); y = torch.empty_like(x)\n"
        f"{fill}"
        "for _ in range(3): y.copy_(x)\n"
        "torch.cuda.synchronize()\n"
        "a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)\n"
        "ts = []\n"
        f"for _ in range({iters}):\n"
        "    a.record(); y.copy_(x); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))\n"
        "ts.sort(); ms = ts[len(ts) // 2]\n"
        f"print({prefix!r} + json.dumps({{\"torch_copy_TBps\": 2 * x.numel() / (ms * 1e-3) / 1e12, "
        "\"bytes\": x.numel(), \"ms\": ms}))\n")


def cuda_copy_seconds(dst, src, *, warmup: int, reps: int, inner: int) -> list:
    """Seconds per ``dst.copy_(src)`` (torch CUDA tensors): `warmup` untimed copies, then `reps` CUDA-event timings
    of `inner` back-to-back copies each."""
    import torch

    for _ in range(warmup):
        dst.copy_(src)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(inner):
            dst.copy_(src)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / inner)
    return ts
