"""Prefill/decode disaggregation on one host: KV transfer throughput between two processes (GB/s of raw KV moved
prefill -> decode, codec included) and TTFT through the router vs a colocated server, same model and engine sizes.

    python benchmarks/bench_pd.py --out pd.json [--prompt-tokens 1024 --reps 5]

Starts four processes (colocated, prefill, decode, router) of `python -m tbjax.serve` on loopback. The transfer is
measured by calling the prefill worker's Prefill RPC directly (its `done` message carries raw/wire bytes and the
seconds from export to the decode side's acknowledgement). Prints a table, writes JSON.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpc  # noqa: E402

from serving.client import Client  # noqa: E402
from serving.pd_worker import PD_SERVICE, dumps, loads  # noqa: E402


def start(role, *args):
    p = subprocess.Popen([sys.executable, "-m", "tbjax.serve", "--role", role, "--port", "0", "--metrics-port", "-1",
                          *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return p


def address(p):
    m = re.search(r"on (\S+:\d+) \(gRPC tbjax.v1\)", p.stdout.readline())
    assert m, "server did not start"
    return m.group(1)


def ttft(target, ids, reps):
    out = []
    with Client(target, timeout=600) as c:
        for i in range(reps + 1):
            t0 = time.perf_counter()
            s = c.generate_stream(token_ids=ids, max_tokens=2, temperature=0)
            next(s)
            out.append(time.perf_counter() - t0)
            list(s)
    return out[1:]     # the first compiles


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    eng = ["--max-num-seqs", "8", "--max-num-batched-tokens", "2048", "--num-pages", "512", "--kv-chunk-pages", "16"]
    procs = [start("colocated", *[x for x in eng if x != "--kv-chunk-pages" and x != "16"]),
             start("prefill", *eng), start("decode", *[x for x in eng if x not in ("--kv-chunk-pages", "16")])]
    try:
        col, pre, dec = (address(p) for p in procs)
        procs.append(start("router", "--prefill-workers", pre, "--decode-workers", dec, "--worker-timeout", "600"))
        rtr = address(procs[-1])
        ids = [(i * 7919) % 40000 + 100 for i in range(a.prompt_tokens)]
        transfers = []
        with grpc.insecure_channel(pre) as ch:
            rpc = ch.unary_stream(f"/{PD_SERVICE}/Prefill", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
            for i in range(a.reps + 1):
                params = dict(max_tokens=4, temperature=0.0)
                msgs = [loads(m) for m in rpc(dumps({"id": f"bench-{i}", "prompt_token_ids": ids, "params": params,
                                                     "decode": dec}), timeout=600)]
                transfers.append(msgs[-1]["done"])
        transfers = transfers[1:]
        gbs = [t["raw_bytes"] / t["seconds"] / 1e9 for t in transfers]
        t_col, t_pd = ttft(col, ids, a.reps), ttft(rtr, ids, a.reps)
        res = dict(prompt_tokens=a.prompt_tokens, codec=transfers[0]["codec"], pages=transfers[0]["pages"],
                   raw_mb=transfers[0]["raw_bytes"] / 1e6, wire_mb=transfers[0]["wire_bytes"] / 1e6,
                   transfer_s=statistics.median(t["seconds"] for t in transfers), transfer_gbs=statistics.median(gbs),
                   ttft_colocated_s=statistics.median(t_col), ttft_disaggregated_s=statistics.median(t_pd),
                   ttft_ratio=statistics.median(t_pd) / statistics.median(t_col), ttft_col_all=t_col, ttft_pd_all=t_pd)
        print(f"{'prompt':>7} {'codec':>9} {'pages':>6} {'raw MB':>8} {'wire MB':>8} {'xfer s':>7} {'GB/s':>6} "
              f"{'TTFT col':>9} {'TTFT pd':>8} {'ratio':>6}")
        print(f"{a.prompt_tokens:>7} {res['codec']:>9} {res['pages']:>6} {res['raw_mb']:>8.2f} {res['wire_mb']:>8.2f} "
              f"{res['transfer_s']:>7.3f} {res['transfer_gbs']:>6.3f} {res['ttft_colocated_s']:>9.3f} "
              f"{res['ttft_disaggregated_s']:>8.3f} {res['ttft_ratio']:>6.2f}")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    finally:
        for p in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
