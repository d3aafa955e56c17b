"""KV transfer with a late handshake (serving/kv_transfer.py) over real loopback gRPC: pages arrive
bit-exact; pages are reserved only at Announce; bad checksums, wrong layouts, missing pages, a silent peer
and a killed sender process all free the reservation (quickly, or within the timeout) and report failure.
The same-host shared-memory path: pages bit-exact with only control messages on the wire, its checksum equal to a
numpy reference and sensitive to every bit, corruption in the segment is DATA_LOSS, a killed sender frees the
reservation and its region, the segment is unlinked when the receiver stops, and every reason not to use it
(other host, no arena, unmappable) falls back to bytes over gRPC. fp8 pools' scales travel on both paths."""
import asyncio
import contextlib
import os
import sys
import textwrap
import time

import grpc
import ml_dtypes
import numpy as np
import pytest

from serving import kv_same_host, kv_shm
from serving.kv_codecs import CODECS, SplitZipCodec, register_codec
from serving.kv_pool import ArrayPagePool
from serving.kv_transfer import KVReceiver, KVSender, TransferError, kv_service_handler
from serving.metrics import ServerMetrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE_SHAPE = (3, 4, 2, 8)     # [L, G, 2K, H], tiny
DTYPE = "bfloat16"


@contextlib.asynccontextmanager
async def receiver_server(num_pages=32, timeout_s=5.0, page_shape=PAGE_SHAPE, **kw):
    pool = ArrayPagePool(num_pages, page_shape, DTYPE)
    events = {"ready": [], "failed": []}
    metrics = ServerMetrics("decode", model_name="m")
    rx = KVReceiver(pool, page_dtype=DTYPE, page_shape=page_shape, timeout_s=timeout_s, metrics=metrics,
                    on_ready=lambda r, p, n: events["ready"].append((r, p, n)),
                    on_failed=lambda r, why: events["failed"].append((r, why)), **kw)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((kv_service_handler(rx),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    rx.start()
    try:
        yield f"127.0.0.1:{port}", pool, rx, events, metrics
    finally:
        await rx.stop()
        await server.stop(0)


def random_pages(n, rng):
    bits = rng.integers(0, 1 << 16, size=(n, *PAGE_SHAPE), dtype=np.uint16)   # any bit pattern, NaNs included
    return bits.view(ml_dtypes.bfloat16)


async def _wait(cond, timeout):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            return False
        await asyncio.sleep(0.01)
    return True


@pytest.mark.parametrize("n_pages,chunk_pages", [(1, 1), (7, 3), (20, 16)])
def test_roundtrip_bit_exact_and_late_reservation(n_pages, chunk_pages):
    rng = np.random.default_rng()
    pages = random_pages(n_pages, rng)

    async def main():
        async with receiver_server() as (addr, pool, rx, ev, metrics), grpc.aio.insecure_channel(addr) as ch:
            pool.data.view(np.uint16)[:] = 0xFFFF     # poison
            assert pool.num_free == 32 and rx.num_open == 0     # nothing reserved before the announce
            st = await KVSender(ch, chunk_pages=chunk_pages).send("req-1", pages, num_tokens=n_pages * 4 - 1)
            assert st.pages == n_pages and st.raw_bytes == st.wire_bytes == pages.nbytes
            (rid, ids, ntok), = ev["ready"]
            assert rid == "req-1" and ntok == n_pages * 4 - 1 and len(set(ids)) == n_pages
            assert np.array_equal(pool.data[ids].view(np.uint16), pages.view(np.uint16))
            assert pool.num_free == 32 - n_pages     # handed over to the decode side, not freed
            assert rx.num_open == 0 and not ev["failed"]
            assert metrics.transfer_raw._value.get() == pages.nbytes
    asyncio.run(main())


def test_splitzip_codec_negotiated_lossless_and_smaller():
    register_codec(SplitZipCodec(impl="numpy"))
    rng = np.random.default_rng()
    shape = (4, 16, 2, 64)                                   # 16 KiB pages: framing overhead is small
    pages = (rng.standard_normal((12, *shape)) * 0.5).astype(ml_dtypes.bfloat16)   # KV-like magnitudes

    async def main():
        async with receiver_server(codecs=("splitzip", "raw"), page_shape=shape) as (addr, pool, rx, ev, metrics), \
                grpc.aio.insecure_channel(addr) as ch:
            pool.data.view(np.uint16)[:] = 0xFFFF
            st = await KVSender(ch, codecs=("splitzip", "raw"), chunk_pages=6).send("z", pages)
            assert st.codec == "splitzip" and st.raw_bytes == pages.nbytes
            assert st.wire_bytes < 0.9 * st.raw_bytes        # bf16 ceiling is 3/4 of raw, plus framing
            (_, ids, _), = ev["ready"]
            assert np.array_equal(pool.data[ids].view(np.uint16), pages.view(np.uint16))
            assert metrics.transfer_wire._value.get() == st.wire_bytes
            # a receiver without splitzip: the sender falls back to raw
        async with receiver_server(page_shape=shape) as (addr, pool, rx, ev, _), grpc.aio.insecure_channel(addr) as ch:
            st = await KVSender(ch, codecs=("splitzip", "raw")).send("z2", pages)
            assert st.codec == "raw" and st.wire_bytes == pages.nbytes
    try:
        asyncio.run(main())
    finally:
        CODECS.pop("splitzip", None)


def test_bad_checksum_frees_reservation():
    class Corrupting(KVSender):
        def chunks(self, *a):
            for i, c in enumerate(super().chunks(*a)):
                if i == 1:
                    c.payload = bytes([c.payload[0] ^ 1]) + c.payload[1:]
                yield c

    async def main():
        async with receiver_server() as (addr, pool, rx, ev, _), grpc.aio.insecure_channel(addr) as ch:
            with pytest.raises(TransferError) as e:
                await Corrupting(ch, chunk_pages=2).send("r", random_pages(6, np.random.default_rng()))
            assert e.value.code == grpc.StatusCode.DATA_LOSS and "checksum" in e.value.message
            assert pool.num_free == 32 and rx.num_open == 0 and ev["failed"][0][0] == "r"
    asyncio.run(main())


def test_missing_pages_and_refusals():
    class Skipping(KVSender):
        def chunks(self, *a):
            cs = list(super().chunks(*a))
            yield from cs[:1] + cs[2:]

    async def main():
        async with receiver_server(num_pages=8) as (addr, pool, rx, ev, _), grpc.aio.insecure_channel(addr) as ch:
            rng = np.random.default_rng()
            with pytest.raises(TransferError) as e:
                await Skipping(ch, chunk_pages=2).send("r1", random_pages(6, rng))
            assert e.value.code == grpc.StatusCode.DATA_LOSS and "missing" in e.value.message
            with pytest.raises(TransferError) as e:       # more than the pool holds
                await KVSender(ch).send("r2", random_pages(9, rng))
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(TransferError) as e:       # another layout
                await KVSender(ch).send("r3", np.zeros((2, 3, 4, 2, 9), ml_dtypes.bfloat16))
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "layout" in e.value.message
            assert pool.num_free == 8 and rx.num_open == 0
            st = await KVSender(ch).send("r4", random_pages(8, rng))    # and the pool still works
            assert st.pages == 8 and pool.num_free == 0
    asyncio.run(main())


def test_silent_peer_reservation_lapses_within_timeout():
    async def main():
        async with receiver_server(timeout_s=0.3) as (addr, pool, rx, ev, _), grpc.aio.insecure_channel(addr) as ch:
            sender = KVSender(ch)
            from serving.proto import tbjax_kv_v1_pb2 as kvpb
            ann = await sender._announce(kvpb.AnnounceRequest(
                request_id="ghost", num_pages=5, layout=kvpb.PageLayout(dtype=DTYPE, shape=list(PAGE_SHAPE)),
                codecs=["raw"]))
            assert pool.num_free == 27 and rx.num_open == 1
            t0 = time.monotonic()
            assert await _wait(lambda: rx.num_open == 0, 2.0)
            assert 0.25 < time.monotonic() - t0 < 1.5 and pool.num_free == 32
            assert ev["failed"] == [("ghost", ev["failed"][0][1])] and "no progress" in ev["failed"][0][1]
            with pytest.raises(grpc.aio.AioRpcError) as e:     # a late push finds nothing
                await sender._push(iter(list(sender.chunks(ann.reservation_id, "raw", random_pages(5, np.random.default_rng())))))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
    asyncio.run(main())


SENDER_SCRIPT = textwrap.dedent("""
    import asyncio, os, sys, zlib
    import grpc, ml_dtypes, numpy as np
    from serving.kv_transfer import KVSender
    from serving.proto import tbjax_kv_v1_pb2 as kvpb
    addr, shape = sys.argv[1], (3, 4, 2, 8)

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            s = KVSender(ch, chunk_pages=2)
            pages = np.zeros((10, *shape), ml_dtypes.bfloat16)
            ann = await s._announce(kvpb.AnnounceRequest(request_id="doomed", num_pages=10,
                layout=kvpb.PageLayout(dtype="bfloat16", shape=list(shape)), codecs=["raw"]))
            async def gen():
                for i, c in enumerate(s.chunks(ann.reservation_id, "raw", pages)):
                    yield c
                    if i == 1:
                        print("SENT2", flush=True)
                        await asyncio.sleep(0.5)
                        os._exit(3)          # killed mid-transfer
            await s._push(gen())
    asyncio.run(main())
""")


def test_killed_sender_process_frees_reservation():
    async def main():
        async with receiver_server(timeout_s=3.0) as (addr, pool, rx, ev, _):
            p = await asyncio.create_subprocess_exec(sys.executable, "-c", SENDER_SCRIPT, addr, cwd=ROOT,
                                                     stdout=asyncio.subprocess.PIPE)
            line = await asyncio.wait_for(p.stdout.readline(), 60)
            assert line.strip() == b"SENT2"
            assert rx.num_open == 1 and pool.num_free == 22       # 10 reserved, 2 chunks in
            assert await p.wait() == 3
            t0 = time.monotonic()
            assert await _wait(lambda: rx.num_open == 0, 4.0), "reservation not freed within the timeout"
            assert pool.num_free == 32 and ev["failed"][0][0] == "doomed" and not ev["ready"]
            return time.monotonic() - t0
    freed_after = asyncio.run(main())
    assert freed_after < 3.5


# -- same-host shared-memory data plane (serving/kv_shm.py) --------------------------------------------------
def _shm_files():
    return {f for f in os.listdir("/dev/shm") if f.startswith("tbjax-kv-")}


@pytest.mark.parametrize("n_pages,chunk_pages", [(1, 1), (7, 3), (20, 16)])
def test_shm_roundtrip_bit_exact_only_control_on_the_wire(n_pages, chunk_pages):
    pages = random_pages(n_pages, np.random.default_rng())

    async def main():
        async with receiver_server(shm_bytes=1 << 20) as (addr, pool, rx, ev, metrics), \
                grpc.aio.insecure_channel(addr) as ch:
            assert rx.arena is not None and rx.arena.name in _shm_files()
            pool.data.view(np.uint16)[:] = 0xFFFF
            sent = []

            class Recording(KVSender):
                async def _shm_chunks(self, *a):
                    async for c in super()._shm_chunks(*a):
                        sent.append(c)
                        yield c
            st = await Recording(ch, chunk_pages=chunk_pages, fast_chunk_bytes=0).send("s1", pages, num_tokens=3)
            assert st.shm and st.raw_bytes == pages.nbytes and st.wire_bytes == 0
            assert len(sent) == -(-n_pages // chunk_pages) and all(c.in_shm and not c.payload for c in sent)
            (rid, ids, _), = ev["ready"]
            assert np.array_equal(pool.data[ids].view(np.uint16), pages.view(np.uint16))
            assert rx.arena.num_regions == 0 and rx.num_open == 0     # the region went back with the reservation
            assert metrics.transfer_raw._value.get() == pages.nbytes
            name = rx.arena.name
        return name
    name = asyncio.run(main())
    assert name not in _shm_files()       # the receiver unlinked its segment (others' processes may own others)


def test_shm_chunk_sizes():
    pages = random_pages(20, np.random.default_rng())           # 384 bytes a page

    async def main():
        async with receiver_server(num_pages=64, shm_bytes=1 << 20) as (addr, pool, rx, ev, _), \
                grpc.aio.insecure_channel(addr) as ch:
            sent = []

            class Recording(KVSender):
                async def _shm_chunks(self, *a):
                    async for c in super()._shm_chunks(*a):
                        sent.append(c.num_pages)
                        yield c
            st = await Recording(ch, chunk_pages=2, fast_chunk_bytes=8 * 384).send("big", pages)
            assert st.shm and sent == [8, 8, 4]                 # capped by fast_chunk_bytes, not 10 chunks of 2
            sent.clear()       # about fast_chunks chunks (20 / 4 = 5 pages -> a power of two: 4)
            st = await Recording(ch, chunk_pages=1, fast_chunk_bytes=1 << 20, fast_min_chunk_bytes=0,
                                 fast_chunks=4).send("pipelined", pages)
            assert st.shm and sent == [4] * 5
            for (_, ids, _) in ev["ready"]:
                assert np.array_equal(pool.data[ids].view(np.uint16), pages.view(np.uint16))
            st = await KVSender(ch, chunk_pages=2, shm=False, fast_chunk_bytes=7 * 384).send("grpc", pages[:10])
            assert not st.shm                                   # the byte stream keeps chunk_pages
    asyncio.run(main())


def test_shm_checksum_matches_numpy_reference_and_catches_flips():
    from tbjax.engine.kv_pages import checksum_reference, chunk_checksums
    rng = np.random.default_rng()
    pages = random_pages(11, rng)
    got = chunk_checksums(pages, 11, 4)
    assert got == [checksum_reference(pages[i:i + 4]) for i in range(0, 11, 4)]
    padded = np.concatenate([pages, random_pages(5, rng)])          # rows past n do not count
    assert chunk_checksums(padded, 11, 4) == got
    for _ in range(20):                                              # any single-bit flip changes the checksum
        bad = pages.copy()
        flat = bad.view(np.uint8).reshape(-1)
        i = int(rng.integers(flat.size))
        flat[i] ^= np.uint8(1 << int(rng.integers(8)))
        assert chunk_checksums(bad, 11, 4) != got
    swapped = pages.copy()
    swapped[[0, 1]] = swapped[[1, 0]]                                # so does moving a page
    assert chunk_checksums(swapped, 11, 4)[0] != got[0] or np.array_equal(pages[0], pages[1])


def test_shm_corruption_is_data_loss_and_frees_reservation_and_region():
    class Corrupting(KVSender):
        async def _shm_chunks(self, ann, pages, scales, n, seg, sums):
            async for c in super()._shm_chunks(ann, pages, scales, n, seg, sums):
                if c.first_page == 2:     # flip one bit of this chunk in the segment after the checksum
                    seg.buf[ann.shm_offset + 2 * pages[0].nbytes + 5] ^= 4
                yield c

    async def main():
        async with receiver_server(shm_bytes=1 << 20) as (addr, pool, rx, ev, _), \
                grpc.aio.insecure_channel(addr) as ch:
            with pytest.raises(TransferError) as e:
                await Corrupting(ch, chunk_pages=2, fast_chunk_bytes=0).send("bad", random_pages(6, np.random.default_rng()))
            assert e.value.code == grpc.StatusCode.DATA_LOSS and "checksum" in e.value.message
            assert pool.num_free == 32 and rx.num_open == 0 and rx.arena.num_regions == 0
            assert ev["failed"][0][0] == "bad"
    asyncio.run(main())


def test_shm_falls_back_to_grpc_other_host_no_arena_or_unmappable(monkeypatch):
    pages = random_pages(5, np.random.default_rng())

    async def main():
        async with receiver_server(shm_bytes=1 << 20) as (addr, pool, rx, ev, _), \
                grpc.aio.insecure_channel(addr) as ch:
            rx.host_id = "another-host/boot"                 # the peer is not on this host: bytes over gRPC
            st = await KVSender(ch).send("a", pages)
            assert not st.shm and st.wire_bytes == pages.nbytes
            rx.host_id = kv_shm.host_id()
            monkeypatch.setattr(kv_same_host, "mapping", lambda name: (_ for _ in ()).throw(OSError("no map")))
            st = await KVSender(ch, chunk_pages=2).send("b", pages)   # granted but cannot map: bytes over gRPC
            assert not st.shm and st.wire_bytes == pages.nbytes and rx.arena.num_regions == 0
            for rid, ids, _ in ev["ready"]:
                assert np.array_equal(pool.data[ids].view(np.uint16), pages.view(np.uint16)), rid
        async with receiver_server() as (addr, pool, rx, ev, _), grpc.aio.insecure_channel(addr) as ch:
            assert rx.arena is None
            st = await KVSender(ch).send("c", pages)          # no arena at all
            assert not st.shm and np.array_equal(pool.data[ev["ready"][0][1]].view(np.uint16), pages.view(np.uint16))
    asyncio.run(main())


@pytest.mark.parametrize("shm", [False, True])
def test_fp8_scales_travel_with_the_pages(shm):
    rng = np.random.default_rng()
    shape, sshape = (3, 4, 2, 8), (3, 2)
    pages = rng.integers(0, 256, size=(5, *shape), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    scales = rng.random((5, *sshape), dtype=np.float32) + 0.5

    async def main():
        pool = ArrayPagePool(16, shape, "float8_e4m3fn", scales_shape=sshape)
        rx = KVReceiver(pool, page_dtype="float8_e4m3fn", page_shape=shape, scales_shape=sshape,
                        shm_bytes=(1 << 20) if shm else 0, on_ready=lambda *a: got.append(a))
        got = []
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((kv_service_handler(rx),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        rx.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                st = await KVSender(ch, chunk_pages=2, fast_chunk_bytes=0).send("f", pages, scales=scales)
                assert st.shm == shm
                (_, ids, _), = got
                assert np.array_equal(pool.data[ids].view(np.uint8), pages.view(np.uint8))
                assert np.array_equal(pool.scales[ids], scales)
                with pytest.raises(TransferError) as e:          # pages without their scales are refused
                    await KVSender(ch).send("g", pages)
                assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "scales" in e.value.message
                assert pool.num_free == 16 - 5 and rx.num_open == 0
        finally:
            await rx.stop()
            await server.stop(0)
    asyncio.run(main())


SHM_SENDER_SCRIPT = textwrap.dedent("""
    import asyncio, os, sys
    import grpc, ml_dtypes, numpy as np
    from serving.kv_transfer import KVSender
    addr, shape = sys.argv[1], (3, 4, 2, 8)

    class Dying(KVSender):
        async def _shm_chunks(self, *a):
            i = 0
            async for c in super()._shm_chunks(*a):
                yield c
                i += 1
                if i == 2:
                    print("SENT2", flush=True)
                    await asyncio.sleep(0.5)
                    os._exit(3)          # killed mid-transfer, the segment mapped in this process

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            await Dying(ch, chunk_pages=2, fast_chunk_bytes=0).send("doomed", np.ones((10, *shape), ml_dtypes.bfloat16))
    asyncio.run(main())
""")


def test_killed_sender_process_mid_shm_transfer_frees_reservation_and_region():
    async def main():
        async with receiver_server(timeout_s=3.0, shm_bytes=1 << 20) as (addr, pool, rx, ev, _):
            p = await asyncio.create_subprocess_exec(sys.executable, "-c", SHM_SENDER_SCRIPT, addr, cwd=ROOT,
                                                     stdout=asyncio.subprocess.PIPE)
            line = await asyncio.wait_for(p.stdout.readline(), 60)
            assert line.strip() == b"SENT2"
            assert rx.num_open == 1 and rx.arena.num_regions == 1 and pool.num_free == 22
            assert await p.wait() == 3
            assert await _wait(lambda: rx.num_open == 0, 4.5), "reservation not freed within the timeout"
            assert pool.num_free == 32 and rx.arena.num_regions == 0 and not ev["ready"]
            assert ev["failed"][0][0] == "doomed"
            return rx.arena.name
    name = asyncio.run(main())
    assert name not in _shm_files()


def test_segment_of_a_killed_receiver_is_swept():
    p = __import__("subprocess").run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                     text=True)
    dead_pid = int(p.stdout)                                        # a pid that has exited
    stale = f"/dev/shm/tbjax-kv-{dead_pid}-0123456789ab"
    with open(stale, "wb") as f:
        f.write(b"x" * 4096)
    mine = f"/dev/shm/tbjax-kv-{os.getpid()}-0123456789ab"          # a live process's segment stays
    with open(mine, "wb") as f:
        f.write(b"x")
    try:
        arena = kv_shm.ShmArena(1 << 16)
        assert not os.path.exists(stale) and os.path.exists(mine)
        a, b = arena.alloc(5000), arena.alloc(100)
        assert a == 0 and b == 8192 and arena.alloc(1 << 16) is None    # page-aligned first fit; full -> None
        arena.free(a)
        with pytest.raises(RuntimeError):
            arena.free(a)
        arena.free(b)
        assert arena.alloc(1 << 16) == 0                              # freed regions merge back
        arena.close()
        assert not os.path.exists(f"/dev/shm/{arena.name}")
    finally:
        for f in (stale, mine):
            if os.path.exists(f):
                os.unlink(f)


def test_sender_unmaps_segments_of_receivers_that_went_away():
    pages = random_pages(3, np.random.default_rng())

    async def main():
        names = []
        for _ in range(2):
            async with receiver_server(shm_bytes=1 << 20) as (addr, pool, rx, ev, _), \
                    grpc.aio.insecure_channel(addr) as ch:
                assert (await KVSender(ch).send("m", pages)).shm
                names.append(rx.arena.name)
        return names
    first, second = asyncio.run(main())
    assert first != second and second in kv_same_host.MAPPINGS and first not in kv_same_host.MAPPINGS


def test_landing_program_views_bytes_and_checksums_every_chunk():
    """The GPU landing's one program (bytes -> pages + per-chunk checksums) against the numpy reference checksum;
    and a host landing with chunks of unequal sizes checks each chunk by itself."""
    import jax

    from tbjax.engine.kv_pages import checksum_reference
    pages = random_pages(7, np.random.default_rng())
    u8 = np.zeros(8 * pages[0].nbytes, np.uint8)
    u8[:pages.nbytes] = pages.view(np.uint8).reshape(-1)
    rows, ab = kv_shm._land_fn()(jax.numpy.asarray(u8), np.int32(7), X=8, dtype=DTYPE, row_shape=PAGE_SHAPE,
                                 chunk_pages=4)
    assert rows.shape == (8, *PAGE_SHAPE) and np.array_equal(np.asarray(rows)[:7].view(np.uint16), pages.view(np.uint16))
    assert kv_shm._sums_by_first(ab, 7, 4) == {0: checksum_reference(pages[:4]), 4: checksum_reference(pages[4:])}
    seg = kv_shm.ShmMapping(f"tbjax-kv-test-{os.getpid()}", pages.nbytes, create=True)
    try:
        seg.view(0, pages.nbytes)[:] = pages.view(np.uint8).reshape(-1)
        land = kv_shm.Landing(7, pages.dtype, PAGE_SHAPE, None, kv_shm.NumpyCopier())
        for first, m in [(5, 2), (0, 3), (3, 2)]:           # out of order, unequal
            land.put_shm(seg, first * pages[0].nbytes, first, m)()
        rows, sums = land.finish()
        assert np.array_equal(np.asarray(rows).view(np.uint16), pages.view(np.uint16))
        assert sums == {f: checksum_reference(pages[f:f + m]) for f, m in [(0, 3), (3, 2), (5, 2)]}
    finally:
        seg.close()


@pytest.mark.parametrize("shm", [False, True])
def test_one_call_transfer_bit_exact_refusals_and_corruption(shm):
    """Announce + chunks on one Transfer call: bit-exact on the byte path and through shared memory; a refused
    announce keeps its status; a corrupted chunk is DATA_LOSS and frees the reservation (and region)."""
    rng = np.random.default_rng()
    pages = random_pages(7, rng)

    class Corrupting(KVSender):
        async def _shm_chunks(self, ann, pages, scales, n, seg, sums):
            async for c in super()._shm_chunks(ann, pages, scales, n, seg, sums):
                if c.first_page == 3:    # one bit of this chunk, after its copy and checksum
                    seg.buf[ann.shm_offset + 3 * pages[0].nbytes + 5] ^= 4
                yield c

        def chunks(self, *a):
            for c in super().chunks(*a):
                c.payload = bytes([c.payload[0] ^ 1]) + c.payload[1:]
                yield c

    async def main():
        async with receiver_server(shm_bytes=(1 << 20) if shm else 0) as (addr, pool, rx, ev, _), \
                grpc.aio.insecure_channel(addr) as ch:
            st = await KVSender(ch, chunk_pages=3, fast_chunk_bytes=0, one_call=True).send("ok", pages, num_tokens=5)
            assert st.shm == shm and st.raw_bytes == pages.nbytes
            (rid, ids, ntok), = ev["ready"]
            assert (rid, ntok) == ("ok", 5) and np.array_equal(pool.data[ids].view(np.uint16), pages.view(np.uint16))
            pool.free(ids)
            with pytest.raises(TransferError) as e:       # more pages than the pool has
                await KVSender(ch, one_call=True).send("big", random_pages(40, rng))
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(TransferError) as e:
                await Corrupting(ch, chunk_pages=3, fast_chunk_bytes=0, one_call=True).send("bad", pages)
            # DATA_LOSS even while the sender is still streaming chunks: the receiver drains the rest before ending
            # the call (else grpcio's client reports INTERNAL "Internal error from Core": grpc/grpc#36066)
            assert e.value.code == grpc.StatusCode.DATA_LOSS and "checksum" in e.value.message
            assert ev["failed"][-1][0] == "bad" and "checksum" in ev["failed"][-1][1]
            assert pool.num_free == 32 and rx.num_open == 0
            assert rx.arena is None or rx.arena.num_regions == 0
    asyncio.run(main())
