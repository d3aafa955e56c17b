"""Load tool for a tbjax server, over gRPC and / or the OpenAI HTTP API (in the spirit of vLLM's / JetStream's
benchmark_serving).

Sends synthetic requests (random prompt token ids, exact output lengths via ignore_eos, greedy by default) at a
Poisson request rate or with a fixed number in flight, streams every response, and reports TTFT, TPOT, ITL and
end-to-end latency percentiles (p50/p90/p99, mean) and throughput (requests/s, output and total tokens/s).

One invocation can measure the same workload (the same prompts as token ids, the same output lengths) through
several paths, one pass each, and print one row per path with the ratios between them:

- ``--protocols grpc`` (the default): ``tbjax.v1.Tbjax/Generate``, streamed; a message with token ids is a chunk.
- ``--protocols http``: ``POST /v1/completions`` with ``stream: true`` (SSE), the prompt as token ids,
  ``max_tokens``, ``ignore_eos``, ``stream_options.include_usage``; TTFT = the first SSE chunk that carries tokens
  (text, or no finish reason yet), ITL = the gaps between such chunks, the output token count = the last chunk's
  ``usage.completion_tokens`` (SSE chunks carry text, not ids), TPOT = (last - first chunk) / (tokens - 1) as for
  gRPC. The client is httpx (``import httpx``; the H200 image has it) or else httpx2 (the same API; this repo's
  venv has it), imported only when http is asked for. With ``--spawn`` the server's HTTP port is opened on a free
  port (``Server.http_url``); with ``--target`` give ``--http-target`` (``python -m tbjax.serve`` prints it:
  "OpenAI HTTP on http://HOST:PORT/v1"; default ``http://<target host>:8000``).
- ``--compare-offline`` (with ``--spawn``): the engine driven directly on this thread, no server (the ceiling).

    # against a running server (python -m tbjax.serve)
    python benchmarks/load_test.py --target 127.0.0.1:50051 --num-requests 200 --request-rate 8 \\
        --prompt-len uniform:64:256 --output-len normal:128:32 --out results.json
    # closed loop: 32 requests in flight
    python benchmarks/load_test.py --target 127.0.0.1:50051 --concurrency 32 --num-requests 256
    # start a server in this process first (the default model, or the fake engine to test the tool itself)
    python benchmarks/load_test.py --spawn model --num-requests 64 --concurrency 16
    # the same workload straight through the engine, no gRPC (the ceiling the server is compared with)
    python benchmarks/load_test.py --spawn model --offline --num-requests 64 --concurrency 16
    # both, same engine, one run: offline first, then over gRPC; prints the throughput ratio
    python benchmarks/load_test.py --spawn model --compare-offline --num-requests 64 --concurrency 16
    # offline, gRPC and HTTP, same workload, the client in its own process: one row each, http/grpc and
    # served/offline ratios
    python benchmarks/load_test.py --spawn fake --fake-step-time 0.006 --num-requests 128 --concurrency 32 \
        --protocols grpc,http --compare-offline --client-process
    # against a running server, both protocols
    python benchmarks/load_test.py --target 127.0.0.1:50051 --http-target http://127.0.0.1:8000 \
        --protocols grpc,http --num-requests 256 --concurrency 64

    # H200 (issues 15 and 16: HTTP within 5% of gRPC, served within 5% of offline): synthetic SmolLM2-135M, batch 64,
    # 256 requests, 64 in flight, the client in 4 processes of 16 streams each (one httpx process tops out near
    # 3k SSE chunks/s: ~290 us of CPU a chunk on the 2-core box; this load streams ~5-6k chunks/s). ~18.4k output
    # tokens a pass, ~4 s at the 5.3k output tok/s gRPC measured there at this load (RESULTS.md "Ready time");
    # --warmup-same runs each path once on the measured workload first (on CPU the first full pass of a path ran up
    # to 2.5x slower, whichever path it was), so every measured pass finds its prompts in the prefix cache alike
    # (without it only the passes after the first do: they reuse the offline pass's prompts). Engine warm-up
    # (~45 s cold, ~15 s with the compile cache) + 3 warm-up + 3 measured passes + client start-ups: ~90 s, inside
    # 150 s. Needs there besides the gRPC wheels (see run_serving_h200.sh): fastapi, starlette, pydantic
    # (+ pydantic-core, annotated-types, typing-inspection) and uvicorn for the server's HTTP API (not on the image);
    # the client's httpx is on the image.
    XLA_FLAGS=--xla_gpu_autotune_level=0 python3 benchmarks/load_test.py --spawn synthetic --max-num-seqs 64 \
        --num-requests 256 --concurrency 64 --prompt-len uniform:8:512 --output-len uniform:16:128 \
        --protocols grpc,http --compare-offline --client-process --client-processes 4 --warmup-same \
        --out load_http_grpc_offline.json

    # CPU proxy of an H200-rate engine: the fake engine at 8.5 ms a step (host work overlapped), batch 128,
    # the engine in a child process, the client in another process (benchmarks/RESULTS.md, issue 7)
    python benchmarks/load_test.py --spawn fake --compare-offline --num-requests 768 --concurrency 128 \
        --max-num-seqs 128 --prompt-len uniform:128:1024 --output-len uniform:64:256 --fake-step-time 0.0085 \
        --fake-overlap --fake-page-size 16 --max-model-len 1280 --max-num-batched-tokens 4096 \
        --engine-process --client-process

Length distributions: ``N`` (fixed), ``uniform:LO:HI`` (inclusive), ``normal:MEAN:STD`` (rounded, >= 1).
Besides latency and throughput, a pass run with ``--spawn`` reports the engine's steps (ms per step, output
tokens per step: a slower engine vs idle batch slots) and the CPU time per output token of each thread /
process (where the front end's time goes), and a gRPC pass the server's own latency means.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import git_commit, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# -- workload ------------------------------------------------------------------------------------------------
class Dist:
    """A length distribution: ``dist(rng) -> int >= 1``; ``str(dist)`` is its spec."""

    def __init__(self, spec: str, fn):
        self.spec, self.fn = spec, fn

    def __call__(self, rng: random.Random) -> int:
        return self.fn(rng)

    def __str__(self) -> str:
        return self.spec


def parse_dist(spec: str) -> Dist:
    """'128' | 'uniform:LO:HI' | 'normal:MEAN:STD' -> Dist."""
    return Dist(spec, _dist_fn(spec))


def _dist_fn(spec: str):
    parts = spec.split(":")
    try:
        if len(parts) == 1:
            n = int(parts[0])
            if n < 1:
                raise ValueError
            return lambda rng: n
        kind, a, b = parts[0], float(parts[1]), float(parts[2])
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"bad length distribution {spec!r}: use N, uniform:LO:HI or normal:MEAN:STD")
    if kind == "uniform":
        lo, hi = int(a), int(b)
        if not 1 <= lo <= hi:
            raise argparse.ArgumentTypeError(f"uniform:{lo}:{hi} needs 1 <= LO <= HI")
        return lambda rng: rng.randint(lo, hi)
    if kind == "normal":
        if b < 0:
            raise argparse.ArgumentTypeError("normal:MEAN:STD needs STD >= 0")
        return lambda rng: max(1, round(rng.gauss(a, b)))
    raise argparse.ArgumentTypeError(f"unknown distribution {kind!r} (fixed N, uniform, normal)")


@dataclass
class Job:
    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float          # offset from the start (open loop); 0 for closed loop


def make_workload(n: int, prompt_len, output_len, vocab_size: int, max_context: int, rate: float,
                  seed: int, min_token_id: int = 0) -> list[Job]:
    rng = random.Random(seed)
    jobs, t = [], 0.0
    for i in range(n):
        p = prompt_len(rng)
        o = output_len(rng)
        if p + o > max_context:   # keep every request servable: trim the prompt first
            p = max(1, max_context - o)
            o = min(o, max_context - p)
        ids = [rng.randrange(min_token_id, vocab_size) for _ in range(p)]
        if math.isfinite(rate):
            t += rng.expovariate(rate)
        jobs.append(Job(i, ids, o, t if math.isfinite(rate) else 0.0))
    return jobs


# -- measurement ---------------------------------------------------------------------------------------------
@dataclass
class Result:
    index: int
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    s = sorted(xs)

    def pct(q):   # linear interpolation, like numpy's default
        k = (len(s) - 1) * q
        f = math.floor(k)
        c = min(f + 1, len(s) - 1)
        return s[f] + (s[c] - s[f]) * (k - f)
    return {"n": len(s), "mean": sum(s) / len(s), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": s[-1]}


def summarize(results: list[Result], duration_s: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors,
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_token_throughput": out_tok / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration_s if duration_s > 0 else 0.0,
        "prompt_tokens": in_tok, "output_tokens": out_tok,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok if r.e2e is not None]),
    }


async def _grpc_one(stub, job: Job, args, t_start: float, sem) -> Result:
    from serving.api import pb

    if job.arrival_s:
        await asyncio.sleep(max(0.0, t_start + job.arrival_s - time.perf_counter()))
    async with sem:
        req = pb.GenerateRequest(params=pb.SamplingParams(max_tokens=job.max_tokens, temperature=args.temperature,
                                                          ignore_eos=args.ignore_eos))
        req.prompt_token_ids.ids.extend(job.prompt_token_ids)
        res = Result(job.index, False, len(job.prompt_token_ids))
        t0 = time.perf_counter()
        last = None
        try:
            async for r in stub(req, timeout=args.timeout):
                now = time.perf_counter()
                if r.token_ids:
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.output_tokens += len(r.token_ids)
                if r.finish_reason:
                    res.e2e = now - t0
                    res.ok = True
        except Exception as e:  # noqa: BLE001 - every failure is counted, by status
            code = getattr(e, "code", None)
            res.error = code().name if callable(code) else type(e).__name__
        return res


def _wait_for_go(args) -> None:
    """In a --client-process child: say it is ready (creates --ready-file), then wait for the parent's "go" line, so
    that every client process starts at once."""
    if getattr(args, "ready_file", None):
        open(args.ready_file, "w").close()
        sys.stdin.readline()


async def run_grpc(target: str, jobs: list[Job], args) -> tuple[list[Result], float]:
    import grpc

    from serving.api import method_path, pb

    channels = [grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)])
                for _ in range(args.channels)]
    stubs = [ch.unary_stream(method_path("Generate"), request_serializer=pb.GenerateRequest.SerializeToString,
                             response_deserializer=pb.GenerateResponse.FromString) for ch in channels]
    sem = asyncio.Semaphore(args.concurrency if args.concurrency else len(jobs) or 1)
    if getattr(args, "ready_file", None):    # a client process: connected before the common start
        await asyncio.wait_for(asyncio.gather(*(ch.channel_ready() for ch in channels)), 60)
    _wait_for_go(args)
    args._wall = [time.time(), None]     # this pass's start and end (epoch s): client processes' spans
    t_start = time.perf_counter()
    results = await asyncio.gather(*[_grpc_one(stubs[j.index % len(stubs)], j, args, t_start, sem) for j in jobs])
    duration = time.perf_counter() - t_start
    args._wall[1] = time.time()
    for ch in channels:
        await ch.close()
    return list(results), duration


HTTP_CLIENTS = ("httpx", "httpx2")   # the same API; httpx2 is httpx's successor (this venv), httpx the H200's


def http_client_module():
    """The async HTTP client for ``--protocols http``: httpx, else httpx2 (imported here, not at the top: a gRPC-only
    run needs neither)."""
    import importlib

    for name in HTTP_CLIENTS:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise SystemExit("--protocols http needs an async HTTP client: httpx or httpx2 (same API), neither is "
                     "importable here; pip install httpx (pure Python: with httpcore, h11, anyio, idna, certifi)")


def http_base_url(url: str) -> str:
    """'http://h:p', 'http://h:p/', 'http://h:p/v1' -> 'http://h:p' (requests go to /v1/completions)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def _http_one(client, job: Job, args, t_start: float, sem) -> Result:
    if job.arrival_s:
        await asyncio.sleep(max(0.0, t_start + job.arrival_s - time.perf_counter()))
    async with sem:
        body = {"prompt": job.prompt_token_ids, "max_tokens": job.max_tokens, "temperature": args.temperature,
                "ignore_eos": args.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
        res = Result(job.index, False, len(job.prompt_token_ids))
        t0 = time.perf_counter()
        last = None
        finished, usage = False, None
        try:
            async with asyncio.timeout(args.timeout):
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        res.error = f"HTTP_{r.status_code}"
                        return res
                    async for line in r.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        now = time.perf_counter()
                        obj = json.loads(data)
                        if "error" in obj:     # an error after the stream started: one chunk, then [DONE]
                            err = obj["error"] if isinstance(obj["error"], dict) else {}
                            res.error = f"stream error {err.get('code') or err.get('type') or '?'}"
                            return res
                        for ch in obj.get("choices") or ():
                            reason = ch.get("finish_reason")
                            # a chunk before the end always carries tokens (its text may be "" while a partial UTF-8
                            # character is held back); the last one carries tokens when it has text
                            if ch.get("text") or reason is None or last is None:
                                if last is None:
                                    res.ttft = now - t0
                                else:
                                    res.itl.append(now - last)
                                last = now
                            if reason is not None:
                                res.e2e, finished = now - t0, True
                        if obj.get("usage"):
                            usage = obj["usage"]
        except TimeoutError:
            res.error = "DEADLINE_EXCEEDED"
            return res
        except Exception as e:  # noqa: BLE001 - every failure is counted, by kind
            res.error = type(e).__name__
            return res
        if not finished:
            res.error = "no finish_reason"
        elif usage is None:
            res.error = "no usage"
        else:
            res.output_tokens = int(usage["completion_tokens"])
            res.ok = True
        return res


async def run_http(url: str, jobs: list[Job], args) -> tuple[list[Result], float]:
    """The workload over the OpenAI HTTP API (``POST /v1/completions``, SSE), one connection per request in flight."""
    httpx = http_client_module()
    n = args.concurrency if args.concurrency else len(jobs) or 1
    sem = asyncio.Semaphore(n)
    async with httpx.AsyncClient(base_url=http_base_url(url), trust_env=False,
                                 timeout=httpx.Timeout(args.timeout, connect=30.0),
                                 limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)) as client:
        if getattr(args, "ready_file", None):   # a client process: connections open before the common start
            await asyncio.wait_for(asyncio.gather(*(client.get("/health") for _ in range(n))), 60)
        _wait_for_go(args)
        args._wall = [time.time(), None]     # this pass's start and end (epoch s): client processes' spans
        t_start = time.perf_counter()
        results = await asyncio.gather(*[_http_one(client, j, args, t_start, sem) for j in jobs])
        duration = time.perf_counter() - t_start
        args._wall[1] = time.time()
    return list(results), duration


def run_offline(engine, make_params, jobs: list[Job], args) -> tuple[list[Result], float]:
    """The same workload straight through the engine on this thread (no gRPC, no streaming to clients):
    requests join when they arrive (open loop) or as slots free up (closed loop)."""
    limit = args.concurrency or len(jobs)
    pending = sorted(jobs, key=lambda j: j.arrival_s)
    live: dict[str, tuple[Result, float, list]] = {}
    results = []
    args._steps = 0   # engine steps of this pass (reported next to the throughput)
    cpu0 = _cpu_by_thread()
    t_start = time.perf_counter()
    while pending or live:
        now = time.perf_counter()
        while pending and len(live) < limit and t_start + pending[0].arrival_s <= now:
            j = pending.pop(0)
            rid = f"load-{j.index}"
            engine.add_request(rid, j.prompt_token_ids, make_params(
                max_tokens=j.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos))
            live[rid] = (Result(j.index, False, len(j.prompt_token_ids)), time.perf_counter(), [None])
        if not engine.has_unfinished():
            if pending:
                time.sleep(max(0.0, min(0.01, t_start + pending[0].arrival_s - time.perf_counter())))
            continue
        outs = engine.step()
        args._steps += 1
        now = time.perf_counter()
        for o in outs:
            res, t0, last = live[o.request_id]
            if o.new_token_ids:
                if last[0] is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last[0])
                last[0] = now
                res.output_tokens += len(o.new_token_ids)
            if o.finished:
                res.e2e, res.ok = now - t0, True
                results.append(res)
                del live[o.request_id]
    args._cpu = {k: v - cpu0.get(k, 0.0) for k, v in _cpu_by_thread().items()}
    return results, time.perf_counter() - t_start


# -- reporting -----------------------------------------------------------------------------------------------
def print_table(summary: dict, title: str) -> None:
    print(f"\n== {title} ==")
    print(f"completed {summary['completed']}  failed {summary['failed']} {summary['errors'] or ''}  "
          f"duration {summary['duration_s']:.2f} s")
    print(f"throughput: {summary['request_throughput']:.2f} req/s, {summary['output_token_throughput']:.1f} "
          f"output tok/s, {summary['total_token_throughput']:.1f} total tok/s")
    print(f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}{'n':>8}")
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        p = summary[key]
        if not p["n"]:
            print(f"{key[:-2]:<12}{'-':>10}")
            continue
        print(f"{key[:-2]:<12}" + "".join(f"{p[k] * 1e3:>10.2f}" for k in ("mean", "p50", "p90", "p99", "max"))
              + f"{p['n']:>8}")


PROTOCOLS = ("grpc", "http")


def parse_protocols(spec: str) -> list[str]:
    """'grpc' | 'http' | 'grpc,http' | 'http,grpc' -> the list, in order."""
    out = [p.strip().lower() for p in spec.split(",") if p.strip()]
    bad = [p for p in out if p not in PROTOCOLS]
    if not out or bad or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"bad --protocols {spec!r}: a comma-separated subset of "
                                         f"{', '.join(PROTOCOLS)}, each once")
    return out


def default_http_target(grpc_target: str) -> str:
    """The HTTP API next to a gRPC address: same host, port 8000 (``python -m tbjax.serve``'s default)."""
    t = grpc_target.split("///")[-1]
    if t.startswith("["):                      # [::1]:50051
        host = t[:t.index("]") + 1]
    elif t.count(":") == 1:                    # host:port
        host = t.split(":")[0]
    elif ":" in t:                             # a bare IPv6 address
        host = f"[{t}]"
    else:
        host = t
    return f"http://{host or '127.0.0.1'}:8000"


def _row(summary: dict) -> dict:
    """The comparison table's numbers of one pass (latencies in ms)."""
    def ms(key, q):
        p = summary[key]
        return p[q] * 1e3 if p.get("n") else None
    return {"completed": summary["completed"], "failed": summary["failed"], "output_tokens": summary["output_tokens"],
            "duration_s": summary["duration_s"], "req_s": summary["request_throughput"],
            "out_tok_s": summary["output_token_throughput"],
            "ttft_p50_ms": ms("ttft_s", "p50"), "ttft_p99_ms": ms("ttft_s", "p99"),
            "tpot_p50_ms": ms("tpot_s", "p50"), "tpot_p99_ms": ms("tpot_s", "p99"),
            "itl_p50_ms": ms("itl_s", "p50"), "e2e_p50_ms": ms("e2e_s", "p50")}


_RATIO_KEYS = ("out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "e2e_p50_ms")


def compare(report: dict, modes: list[str]) -> dict:
    """One row per pass and the ratios http/grpc, grpc/offline, http/offline (throughput: higher is better;
    latencies: lower is better); ``same_totals``: every pass completed the same requests with the same tokens."""
    rows = {m: _row(report[m]) for m in modes}
    ratios = {}
    for num, den in (("http", "grpc"), ("grpc", "offline"), ("http", "offline")):
        if num in rows and den in rows:
            ratios[f"{num}/{den}"] = {k: (rows[num][k] / rows[den][k] if rows[num][k] is not None and rows[den][k]
                                          else None) for k in _RATIO_KEYS}
    totals = {m: (report[m]["completed"], report[m]["prompt_tokens"], report[m]["output_tokens"]) for m in modes}
    return {"rows": rows, "ratios": ratios, "same_totals": len(set(totals.values())) == 1,
            "totals": {m: dict(zip(("completed", "prompt_tokens", "output_tokens"), t)) for m, t in totals.items()}}


def print_comparison(cmp: dict, title: str) -> None:
    cols = (("completed", "done", "{:.0f}"), ("output_tokens", "out tok", "{:.0f}"), ("duration_s", "dur s", "{:.2f}"),
            ("req_s", "req/s", "{:.2f}"), ("out_tok_s", "out tok/s", "{:.1f}"), ("ttft_p50_ms", "TTFT p50", "{:.2f}"),
            ("ttft_p99_ms", "TTFT p99", "{:.2f}"), ("tpot_p50_ms", "TPOT p50", "{:.3f}"),
            ("tpot_p99_ms", "TPOT p99", "{:.3f}"), ("itl_p50_ms", "ITL p50", "{:.3f}"),
            ("e2e_p50_ms", "E2E p50", "{:.1f}"))
    print(f"\n== {title} (latencies in ms) ==")
    print(f"{'':<14}" + "".join(f"{h:>11}" for _, h, _ in cols))
    for m, r in cmp["rows"].items():
        print(f"{m:<14}" + "".join(f"{('-' if r[k] is None else f.format(r[k])):>11}" for k, _, f in cols))
    for name, rt in cmp["ratios"].items():
        print(f"{name:<14}" + "".join(f"{('' if k not in rt else '-' if rt[k] is None else f'{rt[k]:.3f}x'):>11}"
                                       for k, _, _ in cols))
    if cmp["same_totals"]:
        print("every pass: the same requests and tokens " + str(next(iter(cmp["totals"].values()))))
    else:
        print(f"WARNING: the passes differ in what completed: {cmp['totals']}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--target", help="address of a running tbjax server")
    src.add_argument("--spawn", choices=["model", "synthetic", "fake"],
                     help="start a server in this process first: model = a real model (default: SmolLM2-135M); "
                          "synthetic = SmolLM2-135M's shapes with random weights (no model file needed); "
                          "fake = serving.fake_engine (tests the tool itself)")
    ap.add_argument("--synthetic-layers", type=int, default=None, help="with --spawn synthetic: override n_layers")
    ap.add_argument("--model", default=None, help="with --spawn model: the model path (default model otherwise)")
    ap.add_argument("--offline", action="store_true", help="with --spawn: drive the engine directly, no gRPC")
    ap.add_argument("--compare-offline", action="store_true",
                    help="with --spawn: run the workload offline first, then over each of --protocols, same engine, "
                         "and report them side by side")
    ap.add_argument("--protocols", type=parse_protocols, default=["grpc"],
                    help="comma-separated, measured in this order, the same workload each: grpc (Generate), http "
                         "(POST /v1/completions, SSE; needs httpx or httpx2). Default: grpc")
    ap.add_argument("--http-target", default=None,
                    help="with --target and --protocols http: the server's HTTP base URL (serve prints it; default "
                         "http://<target host>:8000)")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all at once)")
    ap.add_argument("--concurrency", type=int, default=0, help="max requests in flight (0: no limit)")
    ap.add_argument("--prompt-len", type=parse_dist, default=parse_dist("uniform:32:128"))
    ap.add_argument("--output-len", type=parse_dist, default=parse_dist("uniform:16:64"))
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="let eos end requests early (output lengths then vary)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--channels", type=int, default=1, help="gRPC channels to spread requests over")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, seconds")
    ap.add_argument("--warmup", type=int, default=2, help="requests sent (and not counted) before measuring")
    ap.add_argument("--warmup-same", action="store_true",
                    help="warm up with the measured workload itself (every shape bucket compiled before measuring)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="with --spawn: engine batch slots")
    ap.add_argument("--num-pages", type=int, default=None, help="with --spawn: KV pages")
    ap.add_argument("--fake-step-time", type=float, default=0.0,
                    help="with --spawn fake: the device's seconds per step (sleeps, GIL free)")
    ap.add_argument("--fake-overlap", action="store_true",
                    help="with --spawn fake: the step's host work runs inside --fake-step-time (a step lasts max(step "
                         "time, host work), as in an engine that prepares step N+1 while the device runs step N); "
                         "default: host work + step time")
    ap.add_argument("--fake-page-size", type=int, default=None, help="with --spawn fake: KV page size (default 4)")
    ap.add_argument("--max-model-len", type=int, default=None, help="with --spawn fake: context limit (default 512)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="with --spawn fake: token budget per step (default 512)")
    ap.add_argument("--layer-buffers", default=None, choices=["stacked", "split", "auto"],
                    help="with --spawn model/synthetic: EngineConfig.layer_buffers (split: faster compiles)")
    ap.add_argument("--pad-batch", action="store_true",
                    help="with --spawn model/synthetic: every step padded to the full batch bucket (max-num-seqs), so "
                         "fewer shape buckets compile (both paths run the same programs)")
    ap.add_argument("--engine-process", action="store_true",
                    help="with --spawn: the gRPC passes' server runs its engine in a child process "
                         "(serving.engine_proc: off the server's GIL), built there with the same configuration (the "
                         "offline pass runs this process's engine: same workload, same engine code); one child for "
                         "all gRPC passes, so its compiled programs carry over from the warm-up")
    ap.add_argument("--event-loop", default="asyncio", choices=["asyncio", "uvloop"],
                    help="the event loop of the server (with --spawn) and of this tool's gRPC client")
    ap.add_argument("--client-process", action="store_true",
                    help="with --spawn: the client (gRPC or HTTP) runs in a second process (the server's process then "
                         "holds only "
                         "the server and the engine, as in deployment; in one process the client's Python work shares "
                         "the server's GIL)")
    ap.add_argument("--client-processes", type=int, default=1,
                    help="with --client-process: this many client processes, the requests dealt round robin and "
                         "--concurrency split between them (one Python client tops out at a few thousand streamed "
                         "chunks/s: httpx ~290 us of CPU a chunk on the 2-core box, gRPC ~80)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--jobs-file", help=argparse.SUPPRESS)       # --client-process child: the workload to send
    ap.add_argument("--results-file", help=argparse.SUPPRESS)    # --client-process child: where its results go
    ap.add_argument("--ready-file", help=argparse.SUPPRESS)      # --client-process child: created when it is ready
    return ap


def _cpu_by_thread(child_pid: int | None = None) -> dict:
    """CPU seconds (user + system) so far of this process's threads, grouped by Python thread name ("tbjax-grpc" =
    the server's asyncio loop, "tbjax-engine", "MainThread", "asyncio_*" = to_thread workers; threads Python does
    not know, e.g. gRPC's core pollers: "native"), plus the engine child process when given (Linux /proc)."""
    import threading

    tick = os.sysconf("SC_CLK_TCK")

    def cpu(path):
        try:
            with open(path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            return 0.0
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        name = names.get(int(tid), "native")
        name = "to_thread workers" if name.startswith("asyncio_") else name
        out[name] = out.get(name, 0.0) + cpu(f"/proc/self/task/{tid}/stat")
    if child_pid:
        out["engine process"] = cpu(f"/proc/{child_pid}/stat")
    return out


def _server_hists(metrics) -> dict:
    """(sum, count) of the server's own latency histograms, from its Prometheus metrics: where a request's time
    goes inside the server (tokenize = arrival to validated, queue = to admitted by the engine, first_token =
    admitted to the first token handed to gRPC) vs what the client sees."""
    sums, counts = {}, {}
    for hist, prefix in ((metrics.ttft, "ttft"), (metrics.phase, ""), (metrics.itl, "itl")):
        for fam in hist.collect():
            for smp in fam.samples:
                key = prefix or smp.labels.get("phase", "?")
                if smp.name.endswith("_sum"):
                    sums[key] = smp.value
                elif smp.name.endswith("_count"):
                    counts[key] = smp.value
    return {k: (sums[k], counts.get(k, 0.0)) for k in sums}


def _means_ms(before: dict, after: dict) -> dict:
    """Mean (ms) of what the histograms took in between two ``_server_hists`` snapshots."""
    out = {}
    for k, (s1, c1) in after.items():
        s0, c0 = before.get(k, (0.0, 0.0))
        if c1 > c0:
            out[k] = (s1 - s0) / (c1 - c0) * 1e3
    return out


def _client_process(a, tgt: str, job_list: list[Job], protocol: str = "grpc",
                    http_url: str | None = None) -> tuple[list[Result], float]:
    """Send ``job_list`` to ``tgt`` (gRPC) or ``http_url`` (HTTP) from ``--client-processes`` child processes (this
    script with --target), the jobs dealt round robin and the concurrency split between them; all start together
    (each says it is ready, then all get "go"), so the pass lasts from the first start to the last end. Their raw
    results come back."""
    import dataclasses
    import tempfile

    n = max(1, min(a.client_processes, len(job_list), a.concurrency or len(job_list)))
    with tempfile.TemporaryDirectory(prefix="tbjax-load-") as d:
        procs = []
        try:
            for k in range(n):
                jf, rf, ready = (os.path.join(d, f"{what}-{k}") for what in ("jobs.json", "results.json", "ready"))
                with open(jf, "w") as f:
                    json.dump([dataclasses.astuple(j) for j in job_list[k::n]], f)
                conc = a.concurrency // n + (k < a.concurrency % n) if a.concurrency else 0
                cmd = [sys.executable, os.path.abspath(__file__), "--target", tgt, "--jobs-file", jf,
                       "--results-file", rf, "--ready-file", ready,
                       "--num-requests", str(len(job_list[k::n])), "--concurrency", str(conc),
                       "--request-rate", str(a.request_rate), "--temperature", str(a.temperature),
                       "--timeout", str(a.timeout), "--channels", str(a.channels), "--warmup", "0",
                       "--event-loop", a.event_loop, "--protocols", protocol] \
                    + ([] if a.ignore_eos else ["--no-ignore-eos"]) + (["--http-target", http_url] if http_url else [])
                log = open(os.path.join(d, f"log-{k}"), "w+")
                procs.append((subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=log,
                                               stderr=subprocess.STDOUT, text=True), log, rf, ready))

            def failed(p, log, why):
                log.seek(0)
                return RuntimeError(f"client process {why} ({p.returncode}): {log.read()[-2000:]}")
            deadline = time.monotonic() + 300
            for p, log, _, ready in procs:       # imports, connection set-up: not measured
                while not os.path.exists(ready):
                    if p.poll() is not None:
                        raise failed(p, log, "failed before it was ready")
                    if time.monotonic() > deadline:
                        raise failed(p, log, "not ready in 300 s")
                    time.sleep(0.005)
            for p, *_ in procs:
                p.stdin.write("go\n")
                p.stdin.close()
            results, starts, ends, cpu = [], [], [], 0.0
            for p, log, rf, _ in procs:
                if p.wait() != 0:
                    raise failed(p, log, "failed")
                with open(rf) as f:
                    out = json.load(f)
                results += [Result(**r) for r in out["results"]]
                cpu += out.get("cpu_s") or 0.0
                starts.append(out["wall"][0])
                ends.append(out["wall"][1])
        finally:
            for p, log, *_ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                log.close()
    a._client_pass_cpu = cpu      # CPU seconds of the client processes during the pass (all their threads)
    return sorted(results, key=lambda r: r.index), max(ends) - min(starts)


from serving.synthetic import synthetic_served_model  # noqa: E402  (moved to serving/; kept importable here)


def _fake_engine_kwargs(a) -> dict:
    kw = {k: v for k, v in (("max_num_seqs", a.max_num_seqs), ("num_pages", a.num_pages),
                            ("page_size", a.fake_page_size), ("max_model_len", a.max_model_len),
                            ("max_num_batched_tokens", a.max_num_batched_tokens)) if v is not None}
    if a.num_pages is None:   # enough pages for every slot at the full context: no preemption
        ps, mml, seqs = a.fake_page_size or 4, a.max_model_len or 512, a.max_num_seqs or 64
        kw["num_pages"] = max(512, seqs * -(-mml // ps) + 1)
    return dict(kw, step_time_s=a.fake_step_time, overlap=a.fake_overlap)


def _jax_engine_in_child(spawn: str, model_path, synthetic_layers, kw: dict, pad_batch: bool):
    """--engine-process with --spawn model/synthetic: runs in the child (module level, so it pickles)."""
    if spawn == "synthetic":
        from serving.synthetic import synthetic_served_model
        eng = synthetic_served_model(synthetic_layers, **kw).engine
    else:
        import tbjax
        eng = tbjax.LLM(model_path, progress=False, **kw).engine
    runner = getattr(eng, "runner", None)
    if pad_batch and runner is not None:
        runner.min_seqs = runner.max_num_seqs
    return eng


def _num_compiled(engine):
    """In the engine's process: programs its runner has compiled (None for the fake engine)."""
    return getattr(getattr(engine, "runner", None), "num_compiled", None)


def _engine_factory(a):
    import functools
    if a.spawn == "fake":
        from serving.fake_engine import FakeEngine
        return functools.partial(FakeEngine, **_fake_engine_kwargs(a))
    kw = {k: v for k, v in (("max_num_seqs", a.max_num_seqs), ("num_pages", a.num_pages),
                            ("layer_buffers", a.layer_buffers)) if v is not None}
    return functools.partial(_jax_engine_in_child, a.spawn, a.model, a.synthetic_layers, kw, a.pad_batch)


def _spawn_model(a):
    from serving.model import ServedModel, model_name_for_path
    if a.spawn == "synthetic":
        kw = {k: v for k, v in (("max_num_seqs", a.max_num_seqs), ("num_pages", a.num_pages),
                                ("layer_buffers", a.layer_buffers)) if v is not None}
        return synthetic_served_model(a.synthetic_layers, **kw)
    if a.spawn == "fake":
        from serving.fake_engine import fake_served_model
        return fake_served_model(**_fake_engine_kwargs(a))
    import tbjax
    kw = {k: v for k, v in (("max_num_seqs", a.max_num_seqs), ("num_pages", a.num_pages),
                            ("layer_buffers", a.layer_buffers)) if v is not None}
    return ServedModel.from_llm(tbjax.LLM(a.model, progress=False, **kw), name=model_name_for_path(a.model))


def _check_http_server_deps() -> None:
    """--spawn with --protocols http: the server's HTTP API needs fastapi and uvicorn (said before the model loads)."""
    missing = []
    for name in ("fastapi", "uvicorn"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SystemExit(f"--protocols http with --spawn: the server's HTTP API (serving/http_api.py) needs "
                         f"{' and '.join(missing)} (with starlette and pydantic), not importable here")


def main(argv=None) -> dict:
    a = build_parser().parse_args(argv)
    if (a.offline or a.compare_offline) and not a.spawn:
        raise SystemExit("--offline / --compare-offline need --spawn (the engine must be in this process)")
    if a.num_requests < 1:
        raise SystemExit("--num-requests must be >= 1")
    fake_only = [f for f, v in (("--fake-overlap", a.fake_overlap), ("--fake-page-size", a.fake_page_size),
                                ("--max-model-len", a.max_model_len), ("--fake-step-time", a.fake_step_time),
                                ("--max-num-batched-tokens", a.max_num_batched_tokens)) if v]
    if a.engine_process and not a.spawn:
        raise SystemExit("--engine-process needs --spawn")
    if a.engine_process and a.spawn != "fake":   # two JAX processes share the device: no up-front grab, and each
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # sizes its KV pool from its own half
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")   # (the offline engine stays alive here)
    if fake_only and a.spawn != "fake":
        raise SystemExit(f"{', '.join(fake_only)}: only with --spawn fake")
    if a.client_processes < 1:
        raise SystemExit("--client-processes must be >= 1")
    if a.client_processes > 1:
        a.client_process = True
    if a.http_target and a.spawn:
        raise SystemExit("--http-target is for --target (a spawned server's HTTP port is found by itself)")
    protocols = [] if a.offline else list(a.protocols)
    if "http" in protocols:
        http_client_module()           # fail before the model loads, not after
        if a.spawn:
            _check_http_server_deps()
        if a.target and not a.http_target:
            a.http_target = default_http_target(a.target)
    model = None
    if a.spawn:
        model = _spawn_model(a)
        runner = getattr(model.engine, "runner", None)
        if a.pad_batch and runner is not None:
            runner.min_seqs = runner.max_num_seqs
        if (a.offline or a.compare_offline) and not getattr(model.engine, "ready", True):
            # every step program compiled before the offline passes (the server's warm-up would do it for the served
            # ones): no measured pass compiles
            t0 = time.perf_counter()
            model.engine.warmup()
            print(f"engine warm-up (compiles every step program): {time.perf_counter() - t0:.1f} s", flush=True)
        vocab, ctx = model.vocab_size, model.max_context
    else:
        from serving.client import Client
        with Client(a.target, timeout=30) as c:
            info = c.model_info()
        vocab, ctx = info["vocab_size"], info["max_context"]
    if a.jobs_file:
        with open(a.jobs_file) as f:
            jobs = [Job(*j) for j in json.load(f)]
    else:
        jobs = make_workload(a.num_requests, a.prompt_len, a.output_len, vocab, ctx, a.request_rate, a.seed)
    if a.warmup_same:
        warm = [Job(j.index, j.prompt_token_ids, j.max_tokens, 0.0) for j in jobs]
    else:
        warm = make_workload(a.warmup, a.prompt_len, a.output_len, vocab, ctx, float("inf"), a.seed + 1) if a.warmup else []
    runs = {}
    report = {"config": {k: (str(v) if isinstance(v, Dist) else v) for k, v in vars(a).items()},
              "commit": git_commit(), "host": platform.node(), "python": platform.python_version()}
    if "http" in protocols:
        report["http_client"] = f"{http_client_module().__name__} {getattr(http_client_module(), '__version__', '?')}"

    kept = {}   # --engine-process: the one server (and engine child) of every served pass

    def compiled():
        n = _num_compiled(getattr(model, "engine", None))
        if n is not None and "server" in kept:   # the child's programs too
            try:
                c = kept["server"].server.engine_loop.call(_num_compiled).result(60)
                n += c or 0
            except Exception:  # noqa: BLE001 - the count is a diagnostic
                pass
        return n

    def write_out():
        if a.out:     # partial results survive a timeout
            write_json(a.out, report)

    def record(mode, results, duration, label):
        runs[mode] = (results, duration, label)
        summary = summarize(results, duration)
        if a.spawn:   # engine steps during the pass: a slower step rate vs idle slots (fewer tokens per step)
            steps = getattr(a, "_steps", 0)
            summary["engine_steps"] = steps
            summary["engine_ms_per_step"] = duration / steps * 1e3 if steps else None
            summary["output_tokens_per_step"] = summary["output_tokens"] / steps if steps else None
            cpu = {k: v for k, v in sorted(getattr(a, "_cpu", {}).items(), key=lambda kv: -kv[1]) if v > 0}
            summary["cpu_s"] = cpu
            if mode != "offline":
                summary["server_mean_ms"] = getattr(a, "_server_ms", {})
            summary["cpu_us_per_output_token"] = {k: v / max(summary["output_tokens"], 1) * 1e6
                                                  for k, v in cpu.items()}
        print_table(summary, f"{label}: {a.num_requests} requests, rate {a.request_rate}, "
                             f"concurrency {a.concurrency or 'unlimited'}")
        if summary.get("engine_steps"):
            print(f"engine: {summary['engine_steps']} steps, {summary['engine_ms_per_step']:.2f} ms per step, "
                  f"{summary['output_tokens_per_step']:.1f} output tokens per step")
            print("CPU us per output token: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                          summary["cpu_us_per_output_token"].items()))
        if summary.get("server_mean_ms"):
            print("server-side means (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in summary["server_mean_ms"].items()))
        report[mode] = summary
        write_out()

    def served_pass(job_list, protocol):
        server = kept.get("server")
        if a.spawn and server is None:
            from serving.limits import Limits
            from serving.server import ServerThread
            n = max(a.num_requests, a.warmup, 1)
            kw = {"engine_factory": _engine_factory(a)} if a.engine_process else {}
            # the HTTP API on a free port whenever http is measured (for the gRPC pass too: the same server both ways)
            server = ServerThread(model, limits=Limits(max_concurrent_requests=n, max_queued_requests=n,
                                                       max_tokens=ctx), metrics_port=None,
                                  http_port=0 if "http" in protocols else None,
                                  event_loop=a.event_loop, **kw).start(timeout=900)
            if a.engine_process:
                kept["server"] = server
        if server is not None:
            tgt, url = server.address, server.server.http_url
        else:
            tgt, url = a.target, a.http_target
        if protocol == "http" and url is None:
            raise RuntimeError("the server has no HTTP API (http_url is None)")
        try:
            steps0 = server.server.engine_loop.num_steps if server is not None else 0
            child_pid = getattr(server.server.engine_loop, "pid", None) if server is not None else None
            cpu0, kids0 = _cpu_by_thread(child_pid), resource.getrusage(resource.RUSAGE_CHILDREN)
            hist0 = _server_hists(server.server.metrics) if server is not None else {}
            if a.client_process and server is not None:
                res, dur = _client_process(a, tgt, job_list, protocol, url if protocol == "http" else None)
            else:
                from serving.server import new_event_loop
                coro = run_grpc(tgt, job_list, a) if protocol == "grpc" else run_http(url, job_list, a)
                ru0 = resource.getrusage(resource.RUSAGE_SELF)
                res, dur = asyncio.run(coro, loop_factory=lambda: new_event_loop(a.event_loop))
                ru1 = resource.getrusage(resource.RUSAGE_SELF)
                a._pass_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
            cpu1, kids1 = _cpu_by_thread(child_pid), resource.getrusage(resource.RUSAGE_CHILDREN)
            a._steps = server.server.engine_loop.num_steps - steps0 if server is not None else 0
            a._server_ms = _means_ms(hist0, _server_hists(server.server.metrics)) if server is not None else {}
            a._cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}
            if a.client_process and server is not None:   # the clients' whole lives (imports too), and the pass
                a._cpu["client process"] = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
                a._cpu["client process (pass only)"] = a._client_pass_cpu
        finally:
            if server is not None and "server" not in kept:
                server.stop()   # hands the engine back to this thread
        if a.results_file:
            import dataclasses
            with open(a.results_file, "w") as f:
                json.dump({"results": [dataclasses.asdict(r) for r in res], "duration_s": dur,
                           "wall": getattr(a, "_wall", None), "cpu_s": getattr(a, "_pass_cpu", None)}, f)
        where = f"gRPC {tgt}" if protocol == "grpc" else f"HTTP {http_base_url(url)}/v1/completions (SSE)"
        clients = "another process" if a.client_processes == 1 else f"{a.client_processes} other processes"
        return res, dur, where + (f" (client in {clients})" if a.client_process and a.spawn else "") \
            + (" (engine in a child process)" if a.engine_process else "")

    # warm up every path first (compiles shape buckets, opens connections), then measure: no pass pays for another's
    t0 = time.perf_counter()
    if warm and (a.offline or a.compare_offline):
        run_offline(model.engine, model.make_params, warm, a)
        print(f"warm-up offline: {time.perf_counter() - t0:.1f} s, {compiled()} programs compiled", flush=True)
    for proto in protocols if warm else ():
        served_pass(warm, proto)
        print(f"warm-up {proto} done: {time.perf_counter() - t0:.1f} s, {compiled()} programs compiled", flush=True)
    report["warmup_s"], report["programs_compiled_warmup"] = time.perf_counter() - t0, compiled()

    def clean(fn, mode):
        """Run a measured pass again (up to twice) when a program compiled during it: no pass pays for a compile."""
        for attempt in range(3):
            c0 = compiled()
            out = fn()
            if compiled() == c0:
                break
            print(f"{mode}: {compiled() - c0} program(s) compiled during the pass; measuring it again", flush=True)
        report.setdefault("passes_repeated", {})[mode] = attempt
        return out

    if a.offline or a.compare_offline:
        record("offline", *clean(lambda: run_offline(model.engine, model.make_params, jobs, a), "offline"),
               "offline engine")
    try:
        for proto in protocols:
            record(proto, *clean(lambda: served_pass(jobs, proto), proto))
        report["programs_compiled"] = compiled()
    finally:
        if "server" in kept:
            kept.pop("server").stop()
    report["mode"] = "+".join(runs)
    report["summary"] = report["grpc" if "grpc" in runs else next(iter(runs))]
    if "grpc" in runs and "offline" in runs:
        ratio = report["grpc"]["output_token_throughput"] / max(report["offline"]["output_token_throughput"], 1e-9)
        report["grpc_over_offline_output_throughput"] = ratio
    if "http" in runs:
        for den in ("grpc", "offline"):
            if den in runs:
                report[f"http_over_{den}_output_throughput"] = (report["http"]["output_token_throughput"]
                                                                / max(report[den]["output_token_throughput"], 1e-9))
    if len(runs) > 1:
        report["comparison"] = compare(report, list(runs))
        print_comparison(report["comparison"],
                         f"same workload, {a.num_requests} requests, rate {a.request_rate}, concurrency "
                         f"{a.concurrency or 'unlimited'}, prompt {a.prompt_len}, output {a.output_len}, "
                         f"{'ignore_eos' if a.ignore_eos else 'eos ends'}, temperature {a.temperature}")
        for k, name in (("grpc_over_offline", "gRPC / offline"), ("http_over_grpc", "HTTP / gRPC"),
                        ("http_over_offline", "HTTP / offline")):
            if f"{k}_output_throughput" in report:
                print(f"{name} output-token throughput: {report[k + '_output_throughput']:.3f}")
    if a.out:
        write_out()
        print(f"wrote {a.out}")
    return report


if __name__ == "__main__":
    main()
