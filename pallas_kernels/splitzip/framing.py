"""Framed SplitZip buffers: header, codebook hash, per-stream CRC32, and strict parsing.

Why this module exists: an encoded KV transfer crosses process and machine boundaries as bytes.
The receiver must detect a truncated or corrupted buffer, or a buffer encoded with another codebook,
and say so, instead of decoding garbage. Every field is checked before any stream is used.

Frame (all integers little-endian):
  magic "SZP1" | version u8 | kind u8 (0 raw, 1 split) | dtype u8 | chunk_log2 u8 | flags u8
  (bit 0: codebook table embedded) | n_pages u32 | n u64 | n_esc u64 | codebook hash 8 bytes |
  codebook table 16 bytes (zeros unless embedded) | per page: ndim u8, dims u64 x ndim |
  n_streams u8 | per stream: length u64, crc32 u32 | header crc32 u32 | the streams, back to back.
Streams: split = sm, codes, counts (u16 per chunk), esc_pos (u16), esc_val (u8) as in layout.py;
raw = the element bits.
"""
from __future__ import annotations

import dataclasses
import struct
import zlib

import numpy as np

from .codebook import Codebook
from .layout import DTYPES, Encoded, Geometry, check_chunk, payload_bytes, raw_bytes, sm_stream_bytes

MAGIC = b"SZP1"
VERSION = 1
DTYPE_CODES = {"bfloat16": 1, "float8_e5m2": 2, "float8_e4m3fn": 3}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
_FIXED = struct.Struct("<4sBBBBBIQQ8s16s")


class FrameError(ValueError):
    """A SplitZip buffer that cannot be decoded (truncated, corrupted, wrong codebook, ...)."""


@dataclasses.dataclass
class Frame:
    enc: Encoded              # streams as numpy arrays; shape = (n,) flat
    page_shapes: list
    codebook: Codebook | None  # the embedded table, if any


def _streams_split(enc: Encoded) -> list[bytes]:
    spec = enc.spec
    geo = enc.geometry
    n_esc = int(enc.n_esc)
    smw = np.asarray(enc.sm_words).astype("<u4")
    if spec.bits == 16:
        sm = smw.reshape(-1).view(np.uint8)
    else:  # 24-bit words, 3 bytes each
        sm = smw.reshape(-1, 1).view(np.uint8).reshape(-1, 4)[:, :3].reshape(-1)
    codes = np.asarray(enc.code_words).astype("<u4").reshape(-1).view(np.uint8)
    counts = np.asarray(enc.counts).astype("<u2")
    pos = np.asarray(enc.esc_pos)[:n_esc].astype("<u2")
    val = np.asarray(enc.esc_val)[:n_esc].astype(np.uint8)
    assert sm.size == sm_stream_bytes(spec, geo) and codes.size == geo.n_pad // 2
    assert counts.size == geo.num_chunks
    return [sm.tobytes(), codes.tobytes(), counts.tobytes(), pos.tobytes(), val.tobytes()]


def frame(enc: Encoded, page_shapes, codebook: Codebook | None, embed_codebook: bool = True) -> bytes:
    """Serialize one Encoded (covering the concatenation of `page_shapes`) into bytes."""
    if enc.kind == "raw":
        streams = [np.ascontiguousarray(np.asarray(enc.raw)).astype(
            "<u2" if enc.spec.bits == 16 else np.uint8).tobytes()]
    else:
        streams = _streams_split(enc)
    cb_hash = codebook.hash if codebook is not None else b"\0" * 8
    table = codebook.to_bytes() if (codebook is not None and embed_codebook) else b"\0" * 16
    flags = 1 if (codebook is not None and embed_codebook) else 0
    head = bytearray(_FIXED.pack(MAGIC, VERSION, 0 if enc.kind == "raw" else 1,
                                 DTYPE_CODES[enc.dtype], enc.chunk.bit_length() - 1, flags,
                                 len(page_shapes), enc.n, int(enc.n_esc), cb_hash, table))
    for shp in page_shapes:
        head += struct.pack("<B", len(shp)) + struct.pack(f"<{len(shp)}Q", *shp)
    head += struct.pack("<B", len(streams))
    for s in streams:
        head += struct.pack("<QI", len(s), zlib.crc32(s))
    head += struct.pack("<I", zlib.crc32(bytes(head)))
    return bytes(head) + b"".join(streams)


class _Reader:
    def __init__(self, buf):
        self.buf = memoryview(buf)
        self.off = 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.off + size > len(self.buf):
            raise FrameError(f"splitzip: buffer truncated inside the header (need {self.off + size} "
                             f"bytes, have {len(self.buf)})")
        out = struct.unpack_from(fmt, self.buf, self.off)
        self.off += size
        return out


def parse(buf, codebook: Codebook | None = None) -> Frame:
    """Check and split a framed buffer. Raises FrameError naming what is wrong."""
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise TypeError(f"splitzip: expected bytes, got {type(buf).__name__}")
    r = _Reader(buf)
    (magic, version, kind, dcode, clog2, flags, n_pages, n, n_esc, cb_hash, table) = r.take("<4sBBBBBIQQ8s16s")
    if magic != MAGIC:
        raise FrameError(f"splitzip: not a SplitZip buffer (magic {bytes(magic)!r})")
    if version != VERSION:
        raise FrameError(f"splitzip: unsupported frame version {version}")
    shapes = []
    for _ in range(n_pages):
        (nd,) = r.take("<B")
        shapes.append(tuple(r.take(f"<{nd}Q")) if nd else ())
    (n_streams,) = r.take("<B")
    lens = [r.take("<QI") for _ in range(n_streams)]
    head_end = r.off
    (head_crc,) = r.take("<I")
    if zlib.crc32(bytes(r.buf[:head_end])) != head_crc:
        raise FrameError("splitzip: header checksum mismatch (corrupted header)")
    if dcode not in DTYPE_NAMES:
        raise FrameError(f"splitzip: unknown dtype code {dcode}")
    dtype = DTYPE_NAMES[dcode]
    spec = DTYPES[dtype]
    try:
        chunk = check_chunk(1 << clog2)
    except ValueError as e:
        raise FrameError(str(e)) from None
    if sum(int(np.prod(s, dtype=np.int64)) for s in shapes) != n:
        raise FrameError("splitzip: page shapes do not add up to the element count")
    geo = Geometry(n, chunk)
    if kind == 0:
        want = [raw_bytes(spec, n)]
    elif kind == 1:
        if not spec.split:
            raise FrameError(f"splitzip: {dtype} cannot be split-coded")
        want = [sm_stream_bytes(spec, geo), geo.n_pad // 2, 2 * geo.num_chunks, 2 * n_esc, n_esc]
        assert sum(want) == payload_bytes(spec, geo, n_esc)
    else:
        raise FrameError(f"splitzip: unknown kind {kind}")
    if [ln for ln, _ in lens] != want:
        raise FrameError(f"splitzip: stream lengths {[ln for ln, _ in lens]} do not match the header "
                         f"(expected {want})")
    total = r.off + sum(want)
    if len(r.buf) < total:
        raise FrameError(f"splitzip: buffer truncated: {len(r.buf)} bytes, frame needs {total}")
    if len(r.buf) > total:
        raise FrameError(f"splitzip: {len(r.buf) - total} trailing bytes after the frame")
    streams = []
    off = r.off
    names = ["raw"] if kind == 0 else ["sm", "codes", "counts", "esc_pos", "esc_val"]
    for (ln, crc), name in zip(lens, names):
        s = r.buf[off: off + ln]
        if zlib.crc32(s) != crc:
            raise FrameError(f"splitzip: checksum mismatch in stream {name!r} (corrupted data)")
        streams.append(np.frombuffer(s, np.uint8))
        off += ln

    embedded = Codebook(dtype, tuple(table)) if (flags & 1 and spec.split) else None
    if embedded is not None and embedded.hash != bytes(cb_hash):
        raise FrameError("splitzip: embedded codebook does not match its hash")
    if kind == 1:
        if codebook is not None:
            if codebook.dtype != dtype:
                raise FrameError(f"splitzip: codebook is for {codebook.dtype}, buffer holds {dtype}")
            if codebook.hash != bytes(cb_hash):
                raise FrameError(f"splitzip: wrong codebook: buffer was encoded with codebook "
                                 f"{bytes(cb_hash).hex()}, got {codebook.hash.hex()}")
        elif embedded is None:
            raise FrameError("splitzip: buffer has no embedded codebook; pass the codebook "
                             f"{bytes(cb_hash).hex()}")

    if kind == 0:
        raw = streams[0].view("<u2" if spec.bits == 16 else np.uint8)
        enc = Encoded("raw", dtype, (n,), chunk, raw=raw, codebook_hash=bytes(cb_hash))
        return Frame(enc, shapes, embedded)

    sm, codes, counts, pos, val = streams
    nch, w = geo.num_chunks, geo.lanes
    if spec.bits == 16:
        sm_words = sm.view("<u4").reshape(nch, 2, w)
    else:
        b = sm.reshape(-1, 3).astype(np.uint32)
        sm_words = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)).reshape(nch, w)
    code_words = codes.view("<u4").reshape(nch, w)
    counts = counts.view("<u2").astype(np.int32)
    pos = pos.view("<u2")
    if int(counts.sum()) != n_esc:
        raise FrameError("splitzip: escape counts do not add up to the escape total")
    if counts.size and int(counts.max()) > chunk:
        raise FrameError("splitzip: an escape count exceeds the chunk size")
    if n_esc and int(pos.max()) >= chunk:
        raise FrameError("splitzip: an escape position lies outside its chunk")
    if n_esc and int(val.max()) >= (1 << spec.exp_bits):
        raise FrameError("splitzip: an escape exponent is out of range")
    enc = Encoded("split", dtype, (n,), chunk, n_esc=int(n_esc), sm_words=sm_words,
                  code_words=code_words, counts=counts, esc_pos=pos, esc_val=val,
                  codebook_hash=bytes(cb_hash))
    return Frame(enc, shapes, embedded)
