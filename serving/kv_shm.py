"""Same-host data plane of the KV transfer: pages move through a POSIX shared-memory segment, not the gRPC stream.

Why: gRPC bytes over loopback move well under 1 GB/s from Python (and ``jax.device_get`` only 1.6 GB/s on the
H200), while a DMA between the GPU and pinned host memory moves ~50 GB/s each way. So, when both workers are on
one host, the decode side owns a segment in ``/dev/shm`` (``ShmArena``: one segment, a region per open
reservation), grants a region at ``Announce``, and the prefill side copies each chunk's pages straight into it;
only control messages (the chunk's page range and checksum) travel over gRPC. The decode side copies the chunk
out of the region into its pools. Both copies go through a ``HostCopier``:

- ``numpy``: host arrays (CPU workers, tests);
- ``cupy``: the segment is pinned once (``cudaHostRegister``) and pages move by ``cudaMemcpyAsync`` between the
  JAX device buffer (shared zero-copy through DLPack) and the segment: one DMA each way, no staging;
- ``jax-pinned``: device <-> a JAX ``pinned_host`` array (DMA), then a host memcpy into / out of the segment
  (multi-threaded numpy copies): one extra host copy, no cupy needed.
``auto`` picks cupy on a GPU when it imports, else jax-pinned on a GPU, else numpy.

Device to device: when both sides are GPU processes on one host, the decode side can also export a device staging
buffer by CUDA IPC (``IpcArena``); the prefill side copies its pages device to device into it (no host memory, no PCIe
on one GPU). The decode side's ``Landing`` takes every chunk of a reservation into one device buffer (one queued copy
per chunk, one wait and one checksum program per transfer). Measured on the H200 (benchmarks/RESULTS.md, "Same-host
data planes on the H200": per-transfer landing): 1.07 GB of KV between two processes in 12.9 ms by IPC (83 GB/s),
34 ms through shared memory with the cupy copier (31 GB/s; the copies run at 55 GB/s each way, ~97 GB/s both ways at
once), 0.3 GB/s as gRPC bytes; a 134 MB transfer takes ~10 ms on either fast path: a fixed ~8-9 ms per transfer, not
the copying, bounds them.

Integrity: each chunk carries the 64-bit device-side checksum of ``tbjax.engine.kv_pages.chunk_checksums``
(computed on the prefill device before the copy, re-computed on the decode device after it), not crc32 (which
runs ~1-2 GB/s on the host). The segment is created and unlinked by the decode side only (it outlives no
receiver: ``close`` and an atexit hook unlink it; a receiver killed outright leaves its segment, which the next
arena created on the host unlinks, since its pid is in the name), so a dead prefill process leaks nothing; the
reservation's region is freed with the reservation. Regions are page aligned. Same host = same ``host_id()`` (boot id +
hostname); any failure to open or map the segment makes the sender fall back to the gRPC byte stream.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import logging
import mmap
import os
import socket
import threading
import uuid
from typing import Callable

import numpy as np

from pallas_kernels.utils import next_pow2, round_up

__all__ = ["host_id", "sweep_stale", "Regions", "ShmArena", "IpcArena", "ipc_capable", "open_ipc", "copy_to_ipc", "ShmMapping", "HostCopier", "NumpyCopier", "CupyCopier", "JaxPinnedCopier",
           "make_copier", "COPIERS", "Landing", "start_copy_to_ipc"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
ALIGN = 1 << 12


def host_id() -> str:
    """Identity of this host (and boot): two processes share /dev/shm only if these are equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


class ShmMapping:
    """A mapped /dev/shm segment (``create`` makes and owns it; otherwise it opens an existing one)."""

    def __init__(self, name: str, size: int = 0, create: bool = False):
        if "/" in name or not name:
            raise ValueError(f"bad shared-memory segment name {name!r}")
        self.name, self.path, self.owner = name, os.path.join(SHM_DIR, name), create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:     # allocate now: a full tmpfs fails here (ENOSPC), not later with SIGBUS on a write
                os.posix_fallocate(fd, 0, size)
            self.size = os.fstat(fd).st_size
            if self.size <= 0:
                raise ValueError(f"shared-memory segment {name!r} is empty")
            self.mm = mmap.mmap(fd, self.size)
        except BaseException:
            if create:
                os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self.mm, np.uint8)
        self.registered_by: set[str] = set()     # copiers that pinned it
        self._closed = False

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) outside the {self.size}-byte segment {self.name}")
        return self.buf[offset:offset + nbytes]

    @property
    def address(self) -> int:
        return self.buf.ctypes.data

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for c in list(self.registered_by):
            COPIERS_LIVE.get(c, _noop).unregister(self)
        self.buf = None
        try:
            self.mm.close()
        except BufferError:      # a view is still alive somewhere: the mapping goes when it does
            pass
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class _Noop:
    def unregister(self, seg):
        pass


_noop = _Noop()
COPIERS_LIVE: dict = {}


class Regions:
    """First-fit allocator of aligned byte regions of a buffer of ``size`` bytes (thread-safe)."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]     # (offset, size), sorted by offset
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def bytes_used(self) -> int:
        return sum(self._used.values())

    @property
    def num_regions(self) -> int:
        return len(self._used)

    def alloc(self, nbytes: int) -> int | None:
        n = round_up(max(nbytes, 1), ALIGN)
        with self._lock:
            for i, (off, size) in enumerate(self._free):
                if size >= n:
                    if size == n:
                        del self._free[i]
                    else:
                        self._free[i] = (off + n, size - n)
                    self._used[off] = n
                    return off
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            n = self._used.pop(offset, None)
            if n is None:
                raise RuntimeError(f"region at {offset} is not allocated (double free?)")
            self._free.append((offset, n))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, size in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((off, size))
            self._free = merged


class ShmArena(Regions):
    """Decode side: one segment, carved into page-aligned regions (first fit); ``alloc`` returns an offset or
    None when no region of that size is free (the transfer then goes over gRPC)."""

    def __init__(self, size: int, prefix: str = "tbjax-kv"):
        if size < ALIGN:
            raise ValueError(f"shared-memory arena of {size} bytes is too small (>= {ALIGN})")
        sweep_stale(prefix)
        self.seg = ShmMapping(f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}", round_up(size, ALIGN), create=True)
        super().__init__(self.seg.size)
        atexit.register(self.close)

    @property
    def name(self) -> str:
        return self.seg.name

    def close(self) -> None:
        self.seg.close()


class IpcArena(Regions):
    """Decode side, GPU: one device staging buffer (cudaMalloc through cupy) exported by a CUDA IPC handle, carved
    into regions like ``ShmArena``. A prefill process on this host opens the handle once and copies its pages
    device to device into a region (no host memory, no PCIe when both are on one GPU, NVLink/PCIe peer copy
    across GPUs); ``rows`` copies a region into a fresh device array for the pool."""

    def __init__(self, size: int, device):
        import cupy

        self.cp, self.device = cupy, device
        self.hw = device.local_hardware_id if device.local_hardware_id is not None else device.id
        size = round_up(size, ALIGN)
        with cupy.cuda.Device(self.hw):
            self.ptr = cupy.cuda.runtime.malloc(size)
            self.stream = cupy.cuda.Stream(non_blocking=True)
        try:
            self.handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self.ptr))
        except Exception:
            cupy.cuda.runtime.free(self.ptr)
            raise
        super().__init__(size)
        self._closed = False
        atexit.register(self.close)

    def rows(self, offset: int, n: int, dtype, row_shape):
        """Rows ``n`` at ``offset`` as a new device array ``[bucket(n), *row_shape]`` (padding rows undefined)."""
        import jax

        dtype = np.dtype(dtype)
        rb = _row_bytes(dtype, row_shape)
        if offset < 0 or offset + n * rb > self.size:
            raise ValueError(f"bytes [{offset}, {offset + n * rb}) outside the {self.size}-byte IPC buffer")
        X = next_pow2(n)
        with self.cp.cuda.Device(self.hw):
            dst = self.cp.empty(X * rb, self.cp.uint8)
            self.cp.cuda.runtime.memcpyAsync(dst.data.ptr, self.ptr + offset, n * rb,
                                             self.cp.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)
            self.stream.synchronize()
        return _view_rows(jax.dlpack.from_dlpack(dst), X, dtype, row_shape)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.cp.cuda.runtime.free(self.ptr)
            except Exception:  # noqa: BLE001 - the CUDA context may already be gone at exit
                pass


_IPC_OPEN: dict[bytes, int] = {}      # sender side: handles opened in this process -> device pointer


def ipc_capable(pages) -> bool:
    """Can this process send ``pages`` by CUDA IPC: a GPU jax array, and cupy imports."""
    if isinstance(pages, np.ndarray):
        return False
    try:
        if next(iter(pages.devices())).platform != "gpu":
            return False
        import cupy  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


def open_ipc(handle: bytes) -> int:
    """Device pointer of a receiver's IPC buffer (opened once per process and handle)."""
    ptr = _IPC_OPEN.get(handle)
    if ptr is None:
        import cupy

        ptr = _IPC_OPEN[handle] = cupy.cuda.runtime.ipcOpenMemHandle(handle, 1)   # lazy peer access
    return ptr


def copy_to_ipc(pages, first: int, n: int, dst_ptr: int, stream=None) -> None:
    """Rows ``[first, first + n)`` of a GPU jax array, device to device to ``dst_ptr`` (waits for the copy)."""
    import cupy

    pages.block_until_ready()
    src = cupy.from_dlpack(pages)
    rb = _row_bytes(pages.dtype, pages.shape[1:])
    s = stream or _ipc_stream()
    cupy.cuda.runtime.memcpyAsync(dst_ptr, src.data.ptr + first * rb, n * rb,
                                  cupy.cuda.runtime.memcpyDeviceToDevice, s.ptr)
    s.synchronize()


def start_copy_to_ipc(pages, first: int, n: int, dst_ptr: int) -> Callable[[], None]:
    """Start ``copy_to_ipc`` (``pages`` must be ready) and return a function that waits for it."""
    import cupy

    src = cupy.from_dlpack(pages)
    rb = _row_bytes(pages.dtype, pages.shape[1:])
    s = _ipc_stream()
    cupy.cuda.runtime.memcpyAsync(dst_ptr, src.data.ptr + first * rb, n * rb,
                                  cupy.cuda.runtime.memcpyDeviceToDevice, s.ptr)
    return _event_waiter(cupy, s, src)


def _event_waiter(cp, stream, keep):
    """A function that waits for what ``stream`` has queued so far (an event), with ``.ready()`` to ask without
    waiting; ``keep`` (the DLPack view of the source) stays alive until the copy is done."""
    ev = cp.cuda.Event(block=False, disable_timing=True)
    ev.record(stream)

    def wait():
        ev.synchronize()
        return keep
    wait.ready = ev.query
    return wait


_STREAMS: dict = {}


def _ipc_stream():
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    if dev not in _STREAMS:
        _STREAMS[dev] = cupy.cuda.Stream(non_blocking=True)
    return _STREAMS[dev]


def sweep_stale(prefix: str = "tbjax-kv") -> list[str]:
    """Unlink segments ``{prefix}-{pid}-*`` whose creating process is gone (a decode worker killed with SIGKILL
    cannot unlink its own); returns their names."""
    gone = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return gone
    for name in names:
        parts = name[len(prefix) + 1:].split("-") if name.startswith(prefix + "-") else []
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        try:
            os.kill(int(parts[0]), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                gone.append(name)
            except OSError:
                pass
        except (PermissionError, OverflowError):
            pass
    return gone


# -- copiers ---------------------------------------------------------------------------------------------------
class HostCopier:
    """Moves pages between where the engine keeps them and a region of a mapped segment."""

    name = "?"

    def register(self, seg: ShmMapping) -> None:
        """Prepare ``seg`` for fast copies (pin it); called once per segment and side."""

    def unregister(self, seg: ShmMapping) -> None:
        pass

    def to_shm(self, pages, first: int, n: int, seg: ShmMapping, offset: int) -> None:
        """Copy rows ``[first, first + n)`` of ``pages`` (host or device array) into the segment at ``offset``."""
        raise NotImplementedError

    def from_shm(self, seg: ShmMapping, offset: int, n: int, dtype, row_shape, device=None):
        """Rows ``n`` of ``row_shape`` from the segment at ``offset``, as an array with at least ``n`` rows
        (padding rows may follow) where the pool wants them (``device``: a jax device, or None for the host)."""
        raise NotImplementedError

    def start_to_shm(self, pages, first: int, n: int, seg: ShmMapping, offset: int) -> Callable[[], None]:
        """Start ``to_shm`` and return a function that waits for it (run that off the event loop). Copiers that
        cannot copy asynchronously do the whole copy in the returned function."""
        return lambda: self.to_shm(pages, first, n, seg, offset)


def _row_bytes(dtype, row_shape) -> int:
    return int(np.prod(row_shape)) * np.dtype(dtype).itemsize


class NumpyCopier(HostCopier):
    """Plain host copies (pages as numpy, or anything ``np.asarray`` takes)."""

    name = "numpy"

    def to_shm(self, pages, first, n, seg, offset):
        src = np.asarray(pages[first:first + n])
        dst = seg.view(offset, src.nbytes).view(src.dtype).reshape(src.shape)
        np.copyto(dst, src)

    def from_shm(self, seg, offset, n, dtype, row_shape, device=None):
        dtype = np.dtype(dtype)
        out = seg.view(offset, n * _row_bytes(dtype, row_shape)).view(dtype).reshape(n, *row_shape).copy()
        if device is not None:
            import jax
            return jax.device_put(out, device)
        return out


class CupyCopier(HostCopier):
    """cudaHostRegister the segment once, then one cudaMemcpyAsync per chunk each way (JAX <-> cupy by DLPack).
    If DLPack exchange fails on this stack, it falls back to ``jax-pinned`` copies (``fallbacks`` counts them)."""

    name = "cupy"

    def __init__(self):
        import cupy

        self.cp = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.fallbacks = 0
        self._alt: JaxPinnedCopier | None = None
        COPIERS_LIVE[self.name] = self

    def _fallback(self, what: str, e: BaseException) -> "JaxPinnedCopier":
        if self.fallbacks == 0:
            log.warning("cupy copier: %s failed (%s: %s); using jax-pinned copies", what, type(e).__name__, e)
        self.fallbacks += 1
        if self._alt is None:
            self._alt = JaxPinnedCopier()
        return self._alt

    def register(self, seg):
        if self.name in seg.registered_by:
            return
        self.cp.cuda.runtime.hostRegister(seg.address, seg.size, 0)
        seg.registered_by.add(self.name)

    def unregister(self, seg):
        if self.name in seg.registered_by:
            try:
                self.cp.cuda.runtime.hostUnregister(seg.address)
            finally:
                seg.registered_by.discard(self.name)

    def to_shm(self, pages, first, n, seg, offset):
        if isinstance(pages, np.ndarray):
            return NumpyCopier.to_shm(self, pages, first, n, seg, offset)
        rb = _row_bytes(pages.dtype, pages.shape[1:])
        seg.view(offset, n * rb)                          # bounds check
        try:
            self.register(seg)
            pages.block_until_ready()
            src = self.cp.from_dlpack(pages)              # zero-copy view of the JAX buffer
        except Exception as e:  # noqa: BLE001
            return self._fallback("device -> shm", e).to_shm(pages, first, n, seg, offset)
        self.cp.cuda.runtime.memcpyAsync(seg.address + offset, src.data.ptr + first * rb, n * rb,
                                         self.cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        self.stream.synchronize()

    def start_to_shm(self, pages, first, n, seg, offset):
        """One cudaMemcpyAsync device -> segment on this copier's stream and an event after it: copies of successive
        chunks queue back to back on the DMA engine (no gap per chunk); the returned function waits for the event.
        ``pages`` must be ready (the caller waits for it once)."""
        if isinstance(pages, np.ndarray):
            return super().start_to_shm(pages, first, n, seg, offset)
        rb = _row_bytes(pages.dtype, pages.shape[1:])
        seg.view(offset, n * rb)
        try:
            self.register(seg)
            src = self.cp.from_dlpack(pages)
        except Exception as e:  # noqa: BLE001
            alt = self._fallback("device -> shm", e)
            return lambda: alt.to_shm(pages, first, n, seg, offset)
        self.cp.cuda.runtime.memcpyAsync(seg.address + offset, src.data.ptr + first * rb, n * rb,
                                         self.cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        return _event_waiter(self.cp, self.stream, src)

    def from_shm(self, seg, offset, n, dtype, row_shape, device=None):
        import jax

        if device is None or device.platform == "cpu":
            return NumpyCopier.from_shm(self, seg, offset, n, dtype, row_shape, device)
        dtype = np.dtype(dtype)
        rb = _row_bytes(dtype, row_shape)
        seg.view(offset, n * rb)
        X = next_pow2(n)     # padded to a power of two: the pool's scatter compiles once per bucket
        try:
            self.register(seg)
            hw = device.local_hardware_id if device.local_hardware_id is not None else device.id
            with self.cp.cuda.Device(hw):
                dst = self.cp.empty(X * rb, self.cp.uint8)
                self.cp.cuda.runtime.memcpyAsync(dst.data.ptr, seg.address + offset, n * rb,
                                                 self.cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
                self.stream.synchronize()
            arr = jax.dlpack.from_dlpack(dst)             # uint8 [X * rb] on the device
        except Exception as e:  # noqa: BLE001
            return self._fallback("shm -> device", e).from_shm(seg, offset, n, dtype, row_shape, device)
        return _view_rows(arr, X, dtype, row_shape)


def _view_rows(arr_u8, X, dtype, row_shape):
    """uint8 device bytes -> [X, *row_shape] of ``dtype`` (a bitcast on the device)."""
    import jax
    import jax.numpy as jnp

    isz = np.dtype(dtype).itemsize
    if isz == 1:
        out = jax.lax.bitcast_convert_type(arr_u8, jnp.dtype(dtype))
    else:
        out = jax.lax.bitcast_convert_type(arr_u8.reshape(-1, isz), jnp.dtype(dtype))
    return out.reshape(X, *row_shape)


class JaxPinnedCopier(HostCopier):
    """Device <-> a JAX ``pinned_host`` array (DMA), then multi-threaded host memcpy <-> the segment."""

    name = "jax-pinned"

    def __init__(self, threads: int = 8):
        self.threads = threads
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kv-memcpy")

    def _par_copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
        step = max(1 << 20, -(-d.size // self.threads))
        list(self.pool.map(lambda i: np.copyto(d[i:i + step], s[i:i + step]), range(0, d.size, step)))

    def to_shm(self, pages, first, n, seg, offset):
        import jax

        if isinstance(pages, np.ndarray):
            src = np.ascontiguousarray(pages[first:first + n])
        else:
            part = pages[first:first + n]
            src = np.asarray(jax.device_put(part, part.sharding.with_memory_kind("pinned_host")))
        self._par_copy(seg.view(offset, src.nbytes), src)

    def from_shm(self, seg, offset, n, dtype, row_shape, device=None):
        import jax

        dtype = np.dtype(dtype)
        if device is None or device.platform == "cpu":
            return NumpyCopier.from_shm(self, seg, offset, n, dtype, row_shape, device)
        view = seg.view(offset, n * _row_bytes(dtype, row_shape)).view(dtype).reshape(n, *row_shape)
        # host (pageable view of the segment) -> pinned_host array -> device: JAX stages the first copy itself
        sh = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        pinned = jax.device_put(view, sh)
        return jax.device_put(pinned, sh.with_memory_kind("device"))


COPIERS = {"numpy": NumpyCopier, "cupy": CupyCopier, "jax-pinned": JaxPinnedCopier}


def make_copier(name: str = "auto") -> HostCopier:
    """A copier by name; ``auto``: cupy on a GPU if it imports, else jax-pinned on a GPU, else numpy."""
    if name == "auto":
        import jax

        if jax.devices()[0].platform == "gpu":
            try:
                return CupyCopier()
            except Exception:  # noqa: BLE001 - no cupy (or no CUDA runtime for it)
                return JaxPinnedCopier()
        return NumpyCopier()
    if name not in COPIERS:
        raise ValueError(f"unknown host copier {name!r}; choose one of {sorted(COPIERS)} or 'auto'")
    return COPIERS[name]()


# -- decode side: where a reservation's pages land -------------------------------------------------------------
_LAND_STREAMS: dict = {}


def _land_stream(cp, hw: int):
    if hw not in _LAND_STREAMS:
        with cp.cuda.Device(hw):
            _LAND_STREAMS[hw] = cp.cuda.Stream(non_blocking=True)
    return _LAND_STREAMS[hw]


def _land_fn():
    """jit: uint8 device bytes -> (rows [X, *row_shape] of dtype, per-chunk checksums): one program per transfer."""
    import functools

    import jax
    import jax.numpy as jnp

    from tbjax.engine.kv_pages import _chunk_checksums

    @functools.partial(jax.jit, static_argnames=("X", "dtype", "row_shape", "chunk_pages"))
    def land(u8, n, *, X, dtype, row_shape, chunk_pages):
        rows = _view_rows(u8, X, jnp.dtype(dtype), row_shape)
        return rows, _chunk_checksums(rows, n, chunk_pages=chunk_pages)
    return land


_LAND = None


class Landing:
    """Decode side: one reservation's pages arrive here chunk by chunk and leave once, verified, for the pool.

    On a GPU with cupy (``device`` on a GPU and either a ``CupyCopier`` or an IPC chunk) the pages land in one device
    buffer of the reservation: each chunk is one cudaMemcpyAsync (shared memory -> device, or IPC buffer -> device)
    queued on a stream when its control message arrives (no wait, no thread hop, no JAX dispatch per chunk);
    ``finish`` waits once, then one program views the bytes as pages and checksums every chunk. Elsewhere (CPU
    workers, the jax-pinned copier) each chunk is read by the copier as before and the chunks are joined at
    ``finish``. ``finish`` returns ``(rows, checksums)``: rows ``[>= n, *row_shape]`` (padding rows may follow),
    checksums ``{first_page: 64-bit}`` of each chunk, computed after landing, for the caller to compare with the
    sender's."""

    def __init__(self, n: int, dtype, row_shape, device=None, copier: HostCopier | None = None):
        self.n, self.dtype, self.row_shape = int(n), np.dtype(dtype), tuple(row_shape)
        self.rb = _row_bytes(self.dtype, self.row_shape)
        self.device, self.copier = device, copier
        self.parts: list[tuple[int, int]] = []          # (first, m) in arrival order
        self._host: list[tuple[int, int, object]] = []  # slow path: (first, m, rows)
        self._dst = None
        self.gpu = device is not None and device.platform == "gpu"
        self.hw = (device.local_hardware_id if device.local_hardware_id is not None else device.id) if self.gpu else None

    def _device_buffer(self):
        if self._dst is None:
            import cupy

            self.cp = cupy
            self.X = next_pow2(self.n)
            self.stream = _land_stream(cupy, self.hw)
            with cupy.cuda.Device(self.hw):
                self._dst = cupy.empty(self.X * self.rb, cupy.uint8)
        return self._dst

    def _async(self, src_ptr: int, first: int, m: int, kind: int) -> None:
        dst = self._device_buffer()
        with self.cp.cuda.Device(self.hw):
            self.cp.cuda.runtime.memcpyAsync(dst.data.ptr + first * self.rb, src_ptr, m * self.rb, kind,
                                             self.stream.ptr)
        self.parts.append((first, m))

    def put_shm(self, seg: ShmMapping, offset: int, first: int, m: int) -> Callable[[], None] | None:
        """Chunk rows ``[first, first + m)`` from the segment at ``offset``. Returns None when the copy is queued
        (fast path), else a function that does it (call it off the event loop)."""
        seg.view(offset, m * self.rb)
        if self.gpu and isinstance(self.copier, CupyCopier) and not self.copier.fallbacks:
            try:
                self.copier.register(seg)
                self._async(seg.address + offset, first, m, self.copier.cp.cuda.runtime.memcpyHostToDevice)
                return None
            except Exception as e:  # noqa: BLE001 - e.g. cannot pin: the copier's own (slower) reads
                log.warning("landing by cudaMemcpyAsync failed (%s: %s); per-chunk reads", type(e).__name__, e)
                if self._dst is not None:
                    raise
        self.parts.append((first, m))
        return lambda: self._host.append((first, m, self.copier.from_shm(seg, offset, m, self.dtype,
                                                                         self.row_shape, self.device)))

    def put_ipc(self, src_ptr: int, first: int, m: int) -> None:
        """Chunk rows from a device pointer (this process's IPC buffer): a device-to-device copy, queued."""
        import cupy

        self.cp = cupy
        self._async(src_ptr, first, m, cupy.cuda.runtime.memcpyDeviceToDevice)

    def finish(self):
        """Wait for the copies; ``(rows, {first: checksum64})`` (run off the event loop)."""
        firsts = sorted(self.parts)
        c = firsts[0][1]
        uniform = all(f == j * c and (m == c or f + m == self.n) for j, (f, m) in enumerate(firsts))
        if self._dst is not None:
            if self._host:
                raise RuntimeError("a reservation's chunks came by two different landings")
            global _LAND
            self.stream.synchronize()
            import jax

            if _LAND is None:
                _LAND = _land_fn()
            u8 = jax.dlpack.from_dlpack(self._dst)
            rows, ab = _LAND(u8, np.int32(self.n), X=self.X, dtype=self.dtype.name, row_shape=self.row_shape,
                             chunk_pages=c if uniform else self.X)
            if uniform:
                return rows, _sums_by_first(ab, self.n, c)
            return rows, _sums_each(rows, firsts)
        parts = sorted(self._host, key=lambda p: p[0])
        if len(parts) == 1:
            rows = parts[0][2]
        elif isinstance(parts[0][2], np.ndarray):
            rows = np.concatenate([np.asarray(r)[:m] for _, m, r in parts])
        else:
            import jax.numpy as jnp
            rows = jnp.concatenate([r[:m] for _, m, r in parts])
        if uniform:
            from tbjax.engine.kv_pages import chunk_checksums
            return rows, dict(zip([f for f, _ in firsts], chunk_checksums(rows, self.n, c)))
        return rows, _sums_each(rows, firsts)

    def abandon(self) -> None:
        """The reservation failed: let queued copies end before the buffer can be reused."""
        if self._dst is not None:
            try:
                self.stream.synchronize()
            except Exception:  # noqa: BLE001
                pass
            self._dst = None


def _sums_by_first(ab, n: int, c: int) -> dict[int, int]:
    import jax

    ab = np.asarray(jax.device_get(ab)).astype(np.uint64)
    C = -(-n // c)
    return {j * c: (int(b) << 32) | int(a) for j, (a, b) in enumerate(ab[:C])}


def _sums_each(rows, firsts) -> dict[int, int]:
    from tbjax.engine.kv_pages import chunk_checksums

    return {f: chunk_checksums(rows[f:f + m], m, m)[0] for f, m in firsts}
