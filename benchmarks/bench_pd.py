"""Prefill/decode disaggregation on one host: KV transfer throughput between two processes (GB/s of raw KV moved
prefill -> decode, codec included) and TTFT through the router vs a colocated server, same model and engine sizes.

    python benchmarks/bench_pd.py --out pd.json [--prompt-tokens 1024,4096 --reps 5 --model synthetic]

Starts four processes (colocated, prefill, decode, router) of `python -m tbjax.serve` on loopback. The transfer is
measured by calling the prefill worker's Prefill RPC directly (its `done` message carries raw/wire bytes, whether
the pages went through the decode worker's shared memory, and the seconds from the sender's announce to the decode
side's acknowledgement; the on-device export before it is not counted). `--model synthetic` serves SmolLM2-135M's
shapes with random weights (machines without the model file). Prints a table, writes JSON.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpc  # noqa: E402

from serving.client import Client  # noqa: E402
from serving.pd_worker import PD_SERVICE, dumps, loads  # noqa: E402


ENV = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}     # several processes share one GPU


ERR_DIR = os.environ.get("TMPDIR", "/tmp")


def start(role, *args):
    err = open(os.path.join(ERR_DIR, f"bench_pd_{os.getpid()}_{role}.err"), "w")    # shown if something fails
    p = subprocess.Popen([sys.executable, "-m", "tbjax.serve", "--role", role, "--port", "0", "--metrics-port", "-1",
                          *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=ENV)
    p.err_path = err.name
    return p


def show_errors(procs):
    for p in procs:
        try:
            tail = open(p.err_path).read().splitlines()[-15:]
        except OSError:
            continue
        if tail:
            print(f"--- {p.err_path} (last lines)\n" + "\n".join(tail), flush=True)


def address(p):
    m = re.search(r"on (\S+:\d+) \(gRPC tbjax.v1\)", p.stdout.readline())
    assert m, "server did not start"
    return m.group(1)


def ttft(target, ids, reps, ends=None):
    """TTFT samples (the first two requests, which may compile, dropped); ``ends`` gets the 2-token latencies."""
    out = []
    with Client(target, timeout=600) as c:
        for i in range(reps + 2):
            t0 = time.perf_counter()
            s = c.generate_stream(token_ids=ids, max_tokens=2, temperature=0, ignore_eos=True)
            next(s)
            out.append(time.perf_counter() - t0)
            try:
                list(s)
            except Exception as e:  # noqa: BLE001 - the second token needs the KV transfer: report, keep the TTFT
                print(f"second token failed: {type(e).__name__}: {e}"[:300], flush=True)
                continue
            if ends is not None and i > 1:
                ends.append(time.perf_counter() - t0)
    return out[2:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", default="1024", help="comma-separated prompt lengths")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", default=None, help="passed to the servers (default: the default model)")
    ap.add_argument("--num-pages", type=int, default=512)
    ap.add_argument("--kv-chunk-pages", type=int, default=16)
    ap.add_argument("--kv-copier", default="auto")
    ap.add_argument("--kv-shm-mb", type=int, default=256, help="decode worker's shared-memory arena (0: gRPC only)")
    ap.add_argument("--layer-buffers", default=None, help="passed to the servers (split: faster compiles)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lens = [int(x) for x in a.prompt_tokens.split(",")]
    model = ["--model", a.model] if a.model else []
    eng = [*model, "--max-num-seqs", "8", "--max-num-batched-tokens", str(max(2048, max(lens))),
           "--num-pages", str(a.num_pages), "--max-model-len", str(max(lens) + 64), "--kv-copier", a.kv_copier,
           *(["--layer-buffers", a.layer_buffers] if a.layer_buffers else [])]
    procs = [start("colocated", *eng), start("prefill", *eng, "--kv-chunk-pages", str(a.kv_chunk_pages)),
             start("decode", *eng, "--kv-shm-mb", str(a.kv_shm_mb))]
    rows = []
    t_start = time.perf_counter()
    failed = True
    try:
        col, pre, dec = (address(p) for p in procs)
        print(f"servers up after {time.perf_counter() - t_start:.1f} s", flush=True)
        procs.append(start("router", *model, "--prefill-workers", pre, "--decode-workers", dec, "--worker-timeout",
                           "600"))
        rtr = address(procs[-1])
        print(f"{'prompt':>7} {'codec':>9} {'shm':>4} {'pages':>6} {'raw MB':>8} {'wire MB':>8} {'xfer ms':>8} "
              f"{'GB/s':>6} {'TTFT col ms':>11} {'TTFT pd ms':>10} {'ratio':>6} {'2tok col':>8} {'2tok pd':>8}", flush=True)
        for n_tok in lens:
            ids = [(i * 7919) % 40000 + 100 for i in range(n_tok)]
            transfers = []
            with grpc.insecure_channel(pre) as ch:
                rpc = ch.unary_stream(f"/{PD_SERVICE}/Prefill", request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)
                for i in range(a.reps + 1):
                    params = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
                    try:
                        msgs = [loads(m) for m in rpc(dumps({"id": f"bench-{n_tok}-{i}", "prompt_token_ids": ids,
                                                             "params": params, "decode": dec}), timeout=600)]
                        transfers.append(msgs[-1]["done"])
                    except Exception as e:  # noqa: BLE001 - report and go on to the TTFT comparison
                        print(f"transfer {i} failed: {type(e).__name__}: {e}"[:300], flush=True)
            print(f"{n_tok} tokens: transfers done at {time.perf_counter() - t_start:.1f} s", flush=True)
            transfers = transfers[1:] or [{"raw_bytes": 0, "wire_bytes": 0, "seconds": float("nan"), "pages": 0,
                                           "codec": "failed"}]
            gbs = [t["raw_bytes"] / t["seconds"] / 1e9 for t in transfers]
            e_col, e_pd = [], []
            t_col, t_pd = ttft(col, ids, a.reps, e_col), ttft(rtr, ids, a.reps, e_pd)
            res = dict(prompt_tokens=n_tok, codec=transfers[0]["codec"], shm=transfers[0].get("shm", False),
                       pages=transfers[0]["pages"], raw_mb=transfers[0]["raw_bytes"] / 1e6,
                       wire_mb=transfers[0]["wire_bytes"] / 1e6,
                       transfer_s=statistics.median(t["seconds"] for t in transfers),
                       transfer_gbs=statistics.median(gbs), ttft_colocated_s=statistics.median(t_col),
                       ttft_disaggregated_s=statistics.median(t_pd),
                       ttft_ratio=statistics.median(t_pd) / statistics.median(t_col), ttft_col_all=t_col,
                       ttft_pd_all=t_pd, transfer_all=transfers, two_tokens_colocated_s=statistics.median(e_col),
                       two_tokens_disaggregated_s=statistics.median(e_pd))
            rows.append(res)
            print(f"{n_tok:>7} {res['codec']:>9} {str(res['shm']):>4} {res['pages']:>6} {res['raw_mb']:>8.2f} "
                  f"{res['wire_mb']:>8.2f} {res['transfer_s'] * 1e3:>8.2f} {res['transfer_gbs']:>6.2f} "
                  f"{res['ttft_colocated_s'] * 1e3:>11.2f} {res['ttft_disaggregated_s'] * 1e3:>10.2f} "
                  f"{res['ttft_ratio']:>6.2f} {res['two_tokens_colocated_s'] * 1e3:>8.2f} "
                  f"{res['two_tokens_disaggregated_s'] * 1e3:>8.2f}", flush=True)
        failed = False
    finally:
        if failed:
            show_errors(procs)
        for p in procs:          # SIGTERM: servers drain and the decode worker unlinks its shared memory
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if a.out:
            write_json(a.out, {"args": vars(a), "rows": rows})


if __name__ == "__main__":
    main()
