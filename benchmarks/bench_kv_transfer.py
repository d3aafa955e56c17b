"""KV transfer throughput between two processes on one host (GB/s of raw KV moved, prefill device -> decode device),
through the real transfer service (serving/kv_transfer.py: announce, late reservation, chunks, checksums), with the
copy ceiling measured in the same run.

    python benchmarks/bench_kv_transfer.py --out kv.json [--pages 2048 --grpc-pages 256 --reps 3]

This process is the prefill side: it holds ``--pages`` random KV-like pages (SmolLM2-135M layout by default,
[L=30, page 16, 2K=6, H=64] bf16 = 360 KiB a page) on its default device. For each receiver copier it starts a
second process (the decode side: a device page pool + ``KVReceiver`` with a shared-memory arena) and sends the
pages to it, timing ``KVSender.send`` end to end (announce -> last chunk written into the decode pool and
acknowledged). Variants:

- ``ipc/c<N>``: device to device through the decode side's CUDA IPC staging buffer, N pages per chunk;
- ``shm/<copier>/c<N>``: the same-host data plane, N pages per chunk, copier ``cupy`` (segment pinned with
  cudaHostRegister, one DMA each way) or ``jax-pinned`` (pinned_host arrays + threaded memcpy);
- ``grpc/raw`` and ``grpc/splitzip``: the pages in the gRPC stream (``--grpc-pages`` of them; slow);
- ceilings: ``jax.device_put`` to / from ``pinned_host`` (the 52 GB/s of JAX_NOTES) and cupy memcpy between the
  device and the registered segment, on the same array, in this run; and a device->host copy in this process while
  a second process copies host->device on the same GPU (do two processes' copies overlap?), and a device-to-device
  copy (the ceiling of the IPC path).
After every transfer the decode side checksums what landed in its pool and the result must equal the sender's.
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PAGE_SHAPE = (30, 16, 6, 64)      # SmolLM2-135M: 30 layers x [page 16, 2 x 3 kv heads, head 64]
GRPC_OPTS = [("grpc.max_send_message_length", 512 << 20), ("grpc.max_receive_message_length", 512 << 20)]


# -- decode side (a separate process) ----------------------------------------------------------------------------
class DevicePagePool:
    """Pages [P, *page_shape] on the default device with a free list; write = one jitted scatter (donated)."""

    def __init__(self, num_pages, page_shape, dtype):
        import jax
        import jax.numpy as jnp

        self.jax, self.jnp = jax, jnp
        self.data = jnp.zeros((num_pages, *page_shape), dtype)
        self._free = list(range(num_pages - 1, 0, -1))      # page 0: the null page padding rows land on
        self._set = jax.jit(lambda d, ids, x: d.at[ids].set(x), donate_argnums=(0,))

    def reserve(self, n, request_id=""):
        from serving.kv_transfer import OutOfPages
        if n > len(self._free):
            raise OutOfPages(f"{n} pages wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def write(self, page_ids, pages, scales=None):
        import numpy as np
        B = pages.shape[0]
        ids = np.zeros(B, np.int32)
        ids[:len(page_ids)] = page_ids
        self.data = self._set(self.data, ids, pages)

    def free(self, page_ids):
        self._free.extend(page_ids)

    def checksum(self, page_ids):
        import numpy as np

        from tbjax.engine.kv_pages import chunk_checksums
        rows = self.data[np.asarray(page_ids, np.int32)]
        return chunk_checksums(rows, len(page_ids), len(page_ids))[0]


def receiver_main(a):
    import grpc

    from serving.kv_transfer import CODECS, KVReceiver, SplitZipCodec, kv_service_handler, register_codec
    import jax

    register_codec(SplitZipCodec())
    pool = DevicePagePool(a.pages + 1, PAGE_SHAPE, "bfloat16")
    landed = {}

    def on_ready(rid, ids, n):
        t0 = time.perf_counter()
        landed[rid] = pool.checksum(ids)
        pool.free(ids)     # the benchmark reuses the pool
        log.write(json.dumps({"id": rid, "checksum": landed[rid], "verify_s": time.perf_counter() - t0}) + "\n")
        log.flush()

    log = open(a.log, "a")

    async def main():
        nb = (a.pages + 64) * pool.data[0].nbytes
        rx = KVReceiver(pool, page_dtype="bfloat16", page_shape=PAGE_SHAPE, codecs=list(CODECS), timeout_s=120,
                        on_ready=on_ready, shm_bytes=nb, copier=a.copier, device=jax.devices()[0],
                        ipc_bytes=nb if a.copier == "cupy" else 0)
        server = grpc.aio.server(options=GRPC_OPTS)
        server.add_generic_rpc_handlers((kv_service_handler(rx),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        rx.start()
        print(f"LISTEN 127.0.0.1:{port} copier={type(rx.copier).__name__} shm={rx.arena is not None} "
              f"ipc={rx.ipc is not None}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)     # until the sender closes stdin
        print(f"receiver copier fallbacks: {getattr(rx.copier, 'fallbacks', 0)}", file=sys.stderr, flush=True)
        await rx.stop()
        await server.stop(0)
    asyncio.run(main())


def copy_helper_main(a):
    """Second process of the cross-process ceiling: host->device copies of ``--pages`` bytes for ``--seconds``,
    started when stdin says go; prints GB/s."""
    import cupy as cp

    nbytes = a.helper_bytes
    host = cp.cuda.alloc_pinned_memory(nbytes)
    dev = cp.empty(nbytes, cp.uint8)
    s = cp.cuda.Stream(non_blocking=True)
    rt = cp.cuda.runtime
    rt.memcpyAsync(dev.data.ptr, host.ptr, nbytes, rt.memcpyHostToDevice, s.ptr)
    s.synchronize()
    print("READY", flush=True)
    sys.stdin.readline()
    t0, k = time.perf_counter(), 0
    while time.perf_counter() - t0 < a.seconds:
        rt.memcpyAsync(dev.data.ptr, host.ptr, nbytes, rt.memcpyHostToDevice, s.ptr)
        s.synchronize()
        k += 1
    print(f"GBS {k * nbytes / (time.perf_counter() - t0) / 1e9}", flush=True)


def cross_process_ceiling(x, seconds=1.0):
    """D2H here while another process does H2D on the same GPU: the two rates (and alone, for comparison)."""
    import cupy as cp

    nbytes = x.nbytes
    src = cp.from_dlpack(x)
    host = cp.cuda.alloc_pinned_memory(nbytes)
    s = cp.cuda.Stream(non_blocking=True)
    rt = cp.cuda.runtime

    def d2h_for(sec):
        t0, k = time.perf_counter(), 0
        while time.perf_counter() - t0 < sec:
            rt.memcpyAsync(host.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToHost, s.ptr)
            s.synchronize()
            k += 1
        return k * nbytes / (time.perf_counter() - t0) / 1e9
    alone = d2h_for(0.3)
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--copy-helper", "--helper-bytes", str(nbytes),
                          "--seconds", str(seconds)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "READY"
    p.stdin.write("go\n")
    p.stdin.flush()
    mine = d2h_for(seconds)
    other = float(p.stdout.readline().split()[1])
    p.wait(30)
    d2d = timed(lambda: (rt.memcpyAsync(cp.empty(nbytes, cp.uint8).data.ptr, src.data.ptr, nbytes,
                                        rt.memcpyDeviceToDevice, s.ptr), s.synchronize()), 3, nbytes)
    return {"d2h_alone_gbs": alone, "d2h_while_other_process_h2d_gbs": mine, "other_process_h2d_gbs": other,
            "sum_gbs": mine + other, "cupy_d2d_gbs": d2d["gbs"]}


# -- prefill side (this process) ---------------------------------------------------------------------------------
def timed(fn, reps, nbytes):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return {"s": statistics.median(ts), "gbs": nbytes / statistics.median(ts) / 1e9, "all_s": ts}


def ceilings(pages, n, reps):
    """Device <-> host copy rates of the same bytes, in this run (the ceiling the transfer is compared to)."""
    import jax
    import numpy as np

    from serving import kv_shm

    out = {}
    x = pages[:n]
    x.block_until_ready()
    nbytes = x.nbytes
    host_sh = x.sharding.with_memory_kind("pinned_host")
    try:
        h = jax.device_put(x, host_sh)
        h.block_until_ready()
        out["jax_d2h_pinned_host"] = timed(lambda: jax.device_put(x, host_sh).block_until_ready(), reps, nbytes)
        out["jax_h2d_pinned_host"] = timed(lambda: jax.device_put(h, x.sharding).block_until_ready(), reps, nbytes)
        del h
    except Exception as e:  # noqa: BLE001
        out["jax_pinned_host_error"] = f"{type(e).__name__}: {e}"
    try:
        cp = __import__("cupy")
        seg = kv_shm.ShmMapping(f"tbjax-kv-bench-{os.getpid()}", nbytes, create=True)
        try:
            c = kv_shm.CupyCopier()
            t0 = time.perf_counter()
            c.register(seg)
            out["cupy_host_register_s"] = time.perf_counter() - t0
            src = cp.from_dlpack(x)
            dst = cp.empty(nbytes, cp.uint8)
            rt = cp.cuda.runtime

            def d2h():
                rt.memcpyAsync(seg.address, src.data.ptr, nbytes, rt.memcpyDeviceToHost, c.stream.ptr)
                c.stream.synchronize()

            def h2d():
                rt.memcpyAsync(dst.data.ptr, seg.address, nbytes, rt.memcpyHostToDevice, c.stream.ptr)
                c.stream.synchronize()
            out["cupy_d2h_shm"] = timed(d2h, reps, nbytes)
            out["cupy_h2d_shm"] = timed(h2d, reps, nbytes)
            s2 = cp.cuda.Stream(non_blocking=True)

            def both():     # the two directions at once (what a pipelined transfer needs from PCIe)
                rt.memcpyAsync(seg.address, src.data.ptr, nbytes // 2, rt.memcpyDeviceToHost, c.stream.ptr)
                rt.memcpyAsync(dst.data.ptr, seg.address + nbytes // 2, nbytes // 2, rt.memcpyHostToDevice, s2.ptr)
                c.stream.synchronize()
                s2.synchronize()
            out["cupy_d2h_h2d_concurrent_half_each"] = timed(both, reps, nbytes)
            del src, dst
            c.unregister(seg)
        finally:
            seg.close()
    except Exception as e:  # noqa: BLE001
        out["cupy_error"] = f"{type(e).__name__}: {e}"
    a = np.ones(nbytes, np.uint8)
    b = np.empty_like(a)
    out["host_memcpy_1thread"] = timed(lambda: np.copyto(b, a), reps, nbytes)
    jp = kv_shm.JaxPinnedCopier()
    out["host_memcpy_8threads"] = timed(lambda: jp._par_copy(b, a), reps, nbytes)
    return out


def start_receiver(a, copier, log):
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--receiver", "--copier", copier,
                          "--pages", str(a.pages), "--log", log], cwd=ROOT, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line.startswith("LISTEN"):
        p.kill()
        raise RuntimeError(f"receiver ({copier}) did not start: {line!r}")
    return p, line.split()[1], line.strip()


def read_checksums(log):
    out = {}
    if os.path.exists(log):
        for line in open(log):
            d = json.loads(line)
            out[d["id"]] = d["checksum"]
    return out


async def run_variant(addr, name, pages, n, chunk, reps, shm, codecs, copier, log, ipc=False):
    import grpc

    from serving.kv_transfer import KVSender
    from tbjax.engine.kv_pages import chunk_checksums

    want = chunk_checksums(pages, n, n)[0]
    res = {"variant": name, "pages": n, "chunk_pages": chunk, "raw_bytes": None, "runs": []}
    async with grpc.aio.insecure_channel(addr, options=GRPC_OPTS) as ch:
        sender = KVSender(ch, codecs=codecs, chunk_pages=chunk, timeout_s=300, shm=shm, copier=copier, ipc=ipc)
        for i in range(reps + 1):
            rid = f"{name}-{i}"
            t0 = time.perf_counter()
            st = await sender.send(rid, pages, n, num_pages=n)
            dt = time.perf_counter() - t0
            res["raw_bytes"], res["wire_bytes"], res["path"], res["codec"] = st.raw_bytes, st.wire_bytes, st.path, st.codec
            if i:
                res["runs"].append(dt)
    await asyncio.sleep(0.5)
    got = read_checksums(log)
    res["verified"] = all(got.get(f"{name}-{i}") == want for i in range(reps + 1))
    res["s"] = statistics.median(res["runs"])
    res["gbs"] = res["raw_bytes"] / res["s"] / 1e9
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=2048, help="pages moved by the shared-memory variants")
    ap.add_argument("--grpc-pages", type=int, default=256, help="pages moved by the gRPC byte-stream variants")
    ap.add_argument("--chunks", default="64,256", help="pages per chunk, comma-separated (shm variants)")
    ap.add_argument("--copiers", default="auto", help="comma-separated: cupy, jax-pinned, numpy; auto = what fits")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-grpc", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--copier", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--log", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--copy-helper", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--helper-bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=1.0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.receiver:
        return receiver_main(a)
    if a.copy_helper:
        return copy_helper_main(a)

    import jax
    import jax.numpy as jnp
    import ml_dtypes  # noqa: F401

    from serving import kv_shm
    from serving.kv_transfer import SplitZipCodec, register_codec

    register_codec(SplitZipCodec())
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    copiers = (["cupy", "jax-pinned"] if gpu else ["numpy"]) if a.copiers == "auto" else a.copiers.split(",")
    B = 1 << (a.pages - 1).bit_length()
    pages = (jax.random.normal(jax.random.key(0), (B, *PAGE_SHAPE), jnp.float32) * 0.5).astype(jnp.bfloat16)
    pages.block_until_ready()
    page_bytes = pages[0].nbytes
    res = {"device": str(dev), "device_kind": dev.device_kind, "page_shape": PAGE_SHAPE, "page_bytes": page_bytes,
           "pages": a.pages, "MB": a.pages * page_bytes / 1e6, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip(), "variants": []}
    try:
        st = os.statvfs("/dev/shm")
        res["dev_shm_free_GB"] = st.f_bavail * st.f_frsize / 1e9
    except OSError:
        pass
    res["ceiling"] = ceilings(pages, a.pages, a.reps)
    if gpu:
        try:
            res["ceiling"]["cross_process"] = cross_process_ceiling(pages[:a.pages])
        except Exception as e:  # noqa: BLE001
            res["ceiling"]["cross_process_error"] = f"{type(e).__name__}: {e}"
    for k, v in res["ceiling"].items():
        print(f"ceiling {k:<38} " + (f"{v['gbs']:7.2f} GB/s" if isinstance(v, dict) and "gbs" in v else str(v)),
              flush=True)
    log = f"/tmp/bench_kv_transfer_{os.getpid()}.jsonl"
    ks = [int(k) for k in a.chunks.split(",")]
    runs = [(c, ([(f"ipc/c{k}", a.pages, k, True, ["raw"], True) for k in ks] if c == "cupy" else [])
             + [(f"shm/{c}/c{k}", a.pages, k, True, ["raw"], False) for k in ks]) for c in copiers]
    if not a.skip_grpc:    # last: the splitzip encoder may compile for a while
        runs.append((copiers[0], [("grpc/raw", a.grpc_pages, 16, False, ["raw"], False),
                                  ("grpc/splitzip", a.grpc_pages, 16, False, ["splitzip", "raw"], False)]))
    for copier, plans in runs:
        try:
            proc, addr, line = start_receiver(a, copier, log)
        except Exception as e:  # noqa: BLE001
            res["variants"].append({"variant": f"receiver/{copier}", "error": str(e)})
            continue
        print(line, flush=True)
        try:
            sc = kv_shm.make_copier(copier)
            for name, n, c, shm, codecs, ipc in plans:
                try:
                    r = asyncio.run(run_variant(addr, name, pages, n, c, a.reps, shm, codecs, sc, log, ipc))
                    r["sender_copier_fallbacks"] = getattr(sc, "fallbacks", 0)
                except Exception as e:  # noqa: BLE001
                    r = {"variant": name, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-2000:]}
                res["variants"].append(r)
                if "error" in r:
                    print(f"{name:<24} ERROR {r['error']}", flush=True)
                else:
                    print(f"{name:<24} {r['pages']:>5} pages {r['raw_bytes'] / 1e6:9.1f} MB raw "
                          f"{r['wire_bytes'] / 1e6:9.1f} MB wire {r['s'] * 1e3:9.2f} ms {r['gbs']:7.2f} GB/s "
                          f"path={r['path']} verified={r['verified']} fallbacks={r['sender_copier_fallbacks']}",
                          flush=True)
                if a.out:     # partial results survive a timeout
                    with open(a.out, "w") as f:
                        json.dump(res, f, indent=1)
        finally:
            proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    ceil = res["ceiling"].get("cupy_d2h_shm") or res["ceiling"].get("jax_d2h_pinned_host")
    if ceil:
        for r in res["variants"]:
            if "gbs" in r:
                r["pct_of_d2h_ceiling"] = 100 * r["gbs"] / ceil["gbs"]
    leftover = [f for f in os.listdir("/dev/shm") if f.startswith("tbjax-kv-")]
    res["dev_shm_leftover"] = leftover
    print(f"leftover shm segments: {leftover}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
