"""KV transfer throughput between two processes on one host (GB/s of raw KV moved, prefill device -> decode device),
through the real transfer service (serving/kv_transfer.py: announce, late reservation, chunks, checksums), with the
copy ceiling measured in the same run.

    python benchmarks/bench_kv_transfer.py --out kv.json [--layouts smollm2-135m,llama3-8b --tokens 1024,8192]

This process is the prefill side. For each KV layout (``smollm2-135m``: [L=30, page 16, 2K=6, H=64] bf16 = 360 KiB
a page, 23 KB a token; ``llama3-8b``: [32, 16, 16, 128] bf16 = 2 MiB a page, 131 KB a token) and each prompt
length in ``--tokens`` it holds that prompt's pages (random, KV-like) on its default device and sends them with
``KVSender.send`` to a second process (the decode side: a device page pool + ``KVReceiver`` with a shared-memory
arena and a CUDA IPC buffer), timing ``send`` end to end: the checksums queued, announce (the late reservation),
every chunk's copy and control message, the receiver's landing (one wait, one checksum program over all chunks,
compared with the sender's) and the pool write, up to the acknowledgement. Variants:

- ``ipc``: device to device through the decode side's CUDA IPC staging buffer (one chunk);
- ``shm/<copier>``: the same-host shared-memory data plane (``cupy``: segment pinned with cudaHostRegister, one DMA
  each way per chunk, all queued at once; ``jax-pinned``: pinned_host arrays + threaded memcpy), default chunking
  (about 16 chunks of 8-64 MiB), and ``shm/<copier>/<MB>`` with fixed chunks of that size (``--shm-chunk-mb``);
- ``.../1call`` (``--one-call``): announce and chunks on one ``Transfer`` call instead of Announce + PushKV;
- ``grpc/raw`` and ``grpc/splitzip``: the pages in the gRPC stream (``--grpc-tokens``; slow);
- ceilings, on the largest transfer's bytes: ``jax.device_put`` to / from ``pinned_host``, cupy memcpy between the
  device and a registered segment (each way, and both ways at once), a device->host copy here while a second process
  copies host->device, a device-to-device copy (the IPC path's ceiling), host memcpy.
After every transfer the decode side also checksums what landed in its pool, off the timed path (the pages return to
the pool only after that), and the result must equal the sender's (``verified``). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from pallas_kernels.utils import next_pow2  # noqa: E402

PAGE_SHAPE = (30, 16, 6, 64)      # SmolLM2-135M: 30 layers x [page 16, 2 x 3 kv heads, head 64]
LAYOUTS = {"smollm2-135m": PAGE_SHAPE,
           "llama3-8b": (32, 16, 16, 128),     # Llama-3.1-8B: 32 layers x [16, 2 x 8 kv heads, 128] bf16
           "tiny": (1, 16, 2, 8)}              # 512 bytes a page: the transfer's fixed costs alone
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
        self._lock = threading.Lock()

    def reserve(self, n, request_id=""):
        from serving.kv_pool import OutOfPages
        with self._lock:
            if n > len(self._free):
                raise OutOfPages(f"{n} pages wanted, {len(self._free)} free")
            return [self._free.pop() for _ in range(n)]

    def write(self, page_ids, pages, scales=None):
        import numpy as np
        B = pages.shape[0]
        ids = np.zeros(B, np.int32)
        ids[:len(page_ids)] = page_ids
        with self._lock:      # (the checker thread's gather reads self.data under the same lock)
            self.data = self._set(self.data, ids, pages)

    def free(self, page_ids):
        with self._lock:
            self._free.extend(page_ids)

    def rows(self, page_ids):
        """The pages as they are now (a gather queued on the device: later writes do not change it)."""
        import numpy as np
        with self._lock:
            return self.data[np.asarray(page_ids, np.int32)]


def receiver_main(a):
    import queue

    import grpc

    from serving.kv_codecs import CODECS, SplitZipCodec, register_codec
    from serving.kv_transfer import KVReceiver, kv_service_handler
    from tbjax.engine.kv_pages import chunk_checksums
    import jax

    register_codec(SplitZipCodec())
    page_shape = tuple(int(x) for x in a.page_shape.split(","))
    pool = DevicePagePool(2 * a.pages + 1, page_shape, "bfloat16")
    todo: queue.Queue = queue.Queue()

    holder = {}

    def on_ready(rid, ids, n):
        # the check of what landed runs off the timed path (a thread, in order: gather, checksum); the pages go back
        # to the pool only after it, so no later transfer can overwrite them before they are read (room for two)
        todo.put((rid, len(ids), ids, holder["rx"].timings.get(rid)))    # the gather happens in the checker

    def verifier():
        while True:
            item = todo.get()
            if item is None:
                return
            rid, n, ids, marks = item
            s = chunk_checksums(pool.rows(ids), n, n)[0]
            pool.free(ids)
            log.write(json.dumps({"id": rid, "checksum": s, "receiver_marks_s": marks}) + "\n")
            log.flush()
    checker = threading.Thread(target=verifier, daemon=True)
    checker.start()

    log = open(a.log, "a")

    async def main():
        nb = (a.pages + 64) * pool.data[0].nbytes
        rx = KVReceiver(pool, page_dtype="bfloat16", page_shape=page_shape, codecs=list(CODECS), timeout_s=120,
                        on_ready=on_ready, shm_bytes=nb, copier=a.copier, device=jax.devices()[0],
                        ipc_bytes=nb if a.copier == "cupy" else 0)
        holder["rx"] = rx
        server = grpc.aio.server(options=GRPC_OPTS)
        server.add_generic_rpc_handlers((kv_service_handler(rx),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        rx.start()
        print(f"LISTEN 127.0.0.1:{port} copier={type(rx.copier).__name__} shm={rx.arena is not None} "
              f"ipc={rx.ipc is not None}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)     # until the sender closes stdin
        todo.put(None)
        await asyncio.to_thread(checker.join, 60)
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


def start_receiver(copier, log, page_shape, pages):
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--receiver", "--copier", copier,
                          "--pages", str(pages), "--page-shape", ",".join(map(str, page_shape)), "--log", log],
                         cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line.startswith("LISTEN"):
        p.kill()
        raise RuntimeError(f"receiver ({copier}) did not start: {line!r}")
    return p, line.split()[1], line.strip()


def read_checksums(log, marks=None):
    out = {}
    if os.path.exists(log):
        for line in open(log):
            d = json.loads(line)
            out[d["id"]] = d["checksum"]
            if marks is not None:
                marks[d["id"]] = d.get("receiver_marks_s")
    return out


def phase_medians(res) -> dict:
    """Median ms of each phase mark: sender's (from send's start) and receiver's (from its Announce)."""
    out = {}
    snd, rcv = res.get("sender_marks_s") or [], res.get("receiver_marks_s") or []
    for side, runs in (("sender", snd), ("receiver", rcv)):
        runs = [m for m in runs if m]
        for k in (runs[0] if runs else {}):
            if not k.endswith("_at"):
                out[f"{side}:{k}"] = round(1e3 * statistics.median(m[k] for m in runs if k in m), 3)
    # both clocks are the host's monotonic clock: the receiver's Announce relative to the sender's start
    d = [r["announced_at"] - s["started_at"] for s, r in zip(snd, rcv) if s and r and "announced_at" in r]
    if d:
        out["receiver_announce_at_sender"] = round(1e3 * statistics.median(d), 3)
    return out


async def run_variant(addr, name, pages, n, reps, log, tag="", **sender_kw):
    import grpc

    from serving.kv_transfer import KVSender
    from tbjax.engine.kv_pages import chunk_checksums

    want = chunk_checksums(pages, n, n)[0]
    res = {"variant": name, "pages": n, "raw_bytes": None, "runs": [], "announce_s": [], "push_s": [],
           "sender": {k: v for k, v in sender_kw.items() if k != "copier"}}
    async with grpc.aio.insecure_channel(addr, options=GRPC_OPTS) as ch:
        sender = KVSender(ch, timeout_s=300, **sender_kw)
        for i in range(reps + 1):
            rid = f"{tag}{name}-{n}-{i}"
            t0 = time.perf_counter()
            st = await sender.send(rid, pages, n, num_pages=n)
            dt = time.perf_counter() - t0
            res["raw_bytes"], res["wire_bytes"], res["path"], res["codec"] = st.raw_bytes, st.wire_bytes, st.path, st.codec
            for _ in range(600):    # the receiver's check of this transfer (off the timed path) ends first
                if rid in read_checksums(log):
                    break
                await asyncio.sleep(0.02)
            if i:
                res["runs"].append(dt)
                res["announce_s"].append(st.announce_s)
                res["push_s"].append(st.push_s)
                res.setdefault("sender_marks_s", []).append(st.extra.get("marks_s"))
    ids = [f"{tag}{name}-{n}-{i}" for i in range(reps + 1)]   # unique in the log (tag: the layout)
    rmarks = {}
    for _ in range(600):       # the receiver checks what landed off the timed path
        got = read_checksums(log, rmarks)
        if all(i in got for i in ids):
            break
        await asyncio.sleep(0.1)
    res["receiver_marks_s"] = [rmarks.get(i) for i in ids[1:]]
    res["phases_ms"] = phase_medians(res)
    res["verified"] = all(got.get(i) == want for i in ids)
    if not res["verified"]:
        res["verify_detail"] = {"want": want, "got": {i: got.get(i) for i in ids}}
    res["s"] = statistics.median(res["runs"])
    res["gbs"] = res["raw_bytes"] / res["s"] / 1e9
    res["push_gbs"] = res["raw_bytes"] / statistics.median(res["push_s"]) / 1e9
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="smollm2-135m,llama3-8b", help=f"comma-separated, of {sorted(LAYOUTS)}")
    ap.add_argument("--tokens", default="1024,8192", help="prompt lengths whose KV is moved (page 16)")
    ap.add_argument("--grpc-tokens", type=int, default=1024, help="prompt length of the gRPC byte-stream variants "
                    "(first layout only; 0: skip them)")
    ap.add_argument("--copiers", default="auto", help="comma-separated: cupy, jax-pinned, numpy; auto = cupy on a "
                    "GPU (+ IPC), numpy on CPU")
    ap.add_argument("--shm-chunk-mb", default="", help="extra shm variants with fixed chunks of these MB")
    ap.add_argument("--no-ipc", action="store_true")
    ap.add_argument("--one-call", action="store_true",
                    help="also the same-host variants with announce and chunks on one Transfer call (``.../1call``)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--copier", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--pages", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--page-shape", default=",".join(map(str, PAGE_SHAPE)), help=argparse.SUPPRESS)
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
    from serving.kv_codecs import SplitZipCodec, register_codec

    register_codec(SplitZipCodec())
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    copiers = (["cupy"] if gpu else ["numpy"]) if a.copiers == "auto" else a.copiers.split(",")
    layouts = a.layouts.split(",")
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; choose from {sorted(LAYOUTS)}")
    tokens = [int(t) for t in a.tokens.split(",")]
    res = {"device": str(dev), "device_kind": dev.device_kind, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip(), "args": vars(a), "variants": []}
    try:
        st = os.statvfs("/dev/shm")
        res["dev_shm_free_GB"] = st.f_bavail * st.f_frsize / 1e9
    except OSError:
        pass

    def save():
        if a.out:     # partial results survive a timeout
            write_json(a.out, res)

    def make_pages(shape, n):
        B = next_pow2(n)
        x = (jax.random.normal(jax.random.key(n), (B, *shape), jnp.float32) * 0.5).astype(jnp.bfloat16)
        x.block_until_ready()
        return x

    # ceilings on the largest transfer of the run
    big = max(((LAYOUTS[l], t // 16) for l in layouts for t in tokens), key=lambda x: x[1] * int(np.prod(x[0])))
    pages = make_pages(*big)
    res["ceiling_bytes"] = big[1] * pages[0].nbytes
    res["ceiling"] = ceilings(pages, big[1], 5)
    if gpu:
        try:
            res["ceiling"]["cross_process"] = cross_process_ceiling(pages[:big[1]])
        except Exception as e:  # noqa: BLE001
            res["ceiling"]["cross_process_error"] = f"{type(e).__name__}: {e}"
    del pages
    for k, v in res["ceiling"].items():
        print(f"ceiling {k:<38} " + (f"{v['gbs']:7.2f} GB/s" if isinstance(v, dict) and "gbs" in v else str(v)),
              flush=True)
    save()
    ceil = res["ceiling"].get("cupy_d2h_shm") or res["ceiling"].get("jax_d2h_pinned_host")
    log = f"/tmp/bench_kv_transfer_{os.getpid()}.jsonl"
    print(f"{'layout':<13} {'tokens':>6} {'MB':>8} {'variant':<22} {'chunks':>6} {'ms':>8} {'GB/s':>7} {'%ceil':>6} "
          f"{'push GB/s':>9} {'path':>5} verified", flush=True)
    for li, layout in enumerate(layouts):
        shape = LAYOUTS[layout]
        ns = [t // 16 for t in tokens]
        pages = make_pages(shape, max(ns))
        for copier in copiers:
            plans = []
            for n in ns:
                if copier == "cupy" and not a.no_ipc:
                    plans.append(("ipc", n, dict(ipc=True)))
                plans.append((f"shm/{copier}", n, dict(ipc=False)))
                if a.one_call:
                    if copier == "cupy" and not a.no_ipc:
                        plans.append(("ipc/1call", n, dict(ipc=True, one_call=True)))
                    plans.append((f"shm/{copier}/1call", n, dict(ipc=False, one_call=True)))
                for mb in [int(x) for x in a.shm_chunk_mb.split(",") if x]:
                    plans.append((f"shm/{copier}/{mb}MB", n, dict(ipc=False, fast_chunk_bytes=mb << 20,
                                                                  fast_min_chunk_bytes=mb << 20)))
            if li == 0 and a.grpc_tokens and copier == copiers[0]:     # last: the splitzip encoder compiles a while
                g = a.grpc_tokens // 16
                plans += [("grpc/raw", g, dict(shm=False, codecs=["raw"])),
                          ("grpc/splitzip", g, dict(shm=False, codecs=["splitzip", "raw"]))]
            try:
                proc, addr, line = start_receiver(copier, log, shape, max(ns))
            except Exception as e:  # noqa: BLE001
                res["variants"].append({"variant": f"receiver/{copier}", "error": str(e)})
                continue
            print(line, flush=True)
            try:
                sc = kv_shm.make_copier(copier)
                for name, n, kw in plans:
                    try:
                        r = asyncio.run(run_variant(addr, name, pages, n, a.reps, log, tag=f"{layout}/", copier=sc,
                                                    chunk_pages=16 if name.startswith("grpc") else 1, **kw))
                        r["sender_copier_fallbacks"] = getattr(sc, "fallbacks", 0)
                    except Exception as e:  # noqa: BLE001
                        r = {"variant": name, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-2000:]}
                    r["layout"], r["tokens"] = layout, n * 16
                    res["variants"].append(r)
                    if "error" in r:
                        print(f"{layout:<13} {n * 16:>6} {'':>8} {name:<22} ERROR {r['error']}", flush=True)
                    else:
                        r["pct_of_d2h_ceiling"] = 100 * r["gbs"] / ceil["gbs"] if ceil else None
                        from serving.kv_transfer import KVSender
                        probe = KVSender.__new__(KVSender)
                        probe.chunk_pages, probe.fast_chunks = 1, 16
                        probe.fast_chunk_bytes = kw.get("fast_chunk_bytes", 64 << 20)
                        probe.fast_min_chunk_bytes = kw.get("fast_min_chunk_bytes", 8 << 20)
                        c = (probe.fast_chunk_pages(pages, n, ipc=r["path"] == "ipc") if r["path"] != "grpc" else 16)
                        r["chunks"] = -(-n // c)
                        pct = f"{r['pct_of_d2h_ceiling']:6.1f}" if ceil else "     -"
                        print(f"{layout:<13} {n * 16:>6} {r['raw_bytes'] / 1e6:8.1f} {name:<22} {r['chunks']:>6} "
                              f"{r['s'] * 1e3:8.2f} {r['gbs']:7.2f} {pct} {r['push_gbs']:9.2f} {r['path']:>5} "
                              f"{r['verified']}", flush=True)
                        print(f"{'':>30} phases ms: {r['phases_ms']}", flush=True)
                    save()
            finally:
                proc.stdin.close()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        del pages
    leftover = [f for f in os.listdir("/dev/shm") if f.startswith("tbjax-kv-")]
    res["dev_shm_leftover"] = leftover
    print(f"leftover shm segments: {leftover}")
    save()


if __name__ == "__main__":
    main()
