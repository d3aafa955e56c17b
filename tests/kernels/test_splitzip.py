"""SplitZip codec: reference encoders (numpy, jnp), codebook, layout, framing and input checks.

Everything is compared bit for bit (uint views), against the input or against stream bytes derived
here straight from the layout description (not from the codec's own packing code).
"""
import collections
import json
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels.splitzip as sz
from pallas_kernels.splitzip import framing, reference
from pallas_kernels.splitzip.layout import Geometry, payload_bytes

from splitzip_helpers import kv_like, rng  # noqa: F401  (rng is a fixture)

BF16 = ml_dtypes.bfloat16


def special_values(rng, n):
    """Random KV plus NaNs with payloads, +-0, +-inf, subnormals, huge values."""
    x = kv_like(rng, n).view(np.uint16).copy()
    idx = rng.choice(n, size=n // 8, replace=False)
    specials = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFA5, 0x7F81, 0x0001, 0x807F,
                         0x0040, 0x7F7F, 0xFF7F, 0x0080], np.uint16)
    x[idx] = rng.choice(specials, size=idx.size)
    return x.view(BF16)


def calib(rng):
    return sz.Codebook.calibrate(kv_like(rng, 1 << 16))


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8)


# ----------------------------------------------------------------------------------------------
# codebook
# ----------------------------------------------------------------------------------------------
def test_calibrate_picks_top16_by_frequency(rng):
    exps = rng.choice(np.arange(90, 140), size=20, replace=False)
    counts = np.arange(200, 180, -1)                    # distinct frequencies, decreasing
    e = np.repeat(exps, counts)
    mant = rng.integers(0, 128, e.size)
    sign = rng.integers(0, 2, e.size)
    x = ((sign << 15) | (e << 7) | mant).astype(np.uint16)
    rng.shuffle(x)
    cb = sz.Codebook.calibrate(x.view(BF16))
    hist = collections.Counter(((x >> 7) & 0xFF).tolist())
    want = [ex for ex, _ in sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))[:16]]
    assert list(cb.exponents) == want
    assert cb.exponents[0] == exps[0]


def test_calibrate_tops_up_few_exponents_and_validates():
    x = np.array([0x3F80, 0x3F80, 0x4000], np.uint16).view(BF16)   # exponents 127, 128
    cb = sz.Codebook.calibrate(x)
    assert cb.exponents[:2] == (127, 128) and len(set(cb.exponents)) == 16
    with pytest.raises(ValueError, match="distinct"):
        sz.Codebook("bfloat16", (1,) * 16)
    with pytest.raises(ValueError, match="16 exponents"):
        sz.Codebook("bfloat16", tuple(range(15)))
    with pytest.raises(ValueError, match=r"\[0, 32\)"):
        sz.Codebook("float8_e5m2", tuple(range(20, 36)))
    with pytest.raises(ValueError, match="split dtype"):
        sz.Codebook("float8_e4m3fn", tuple(range(16)))
    with pytest.raises(TypeError, match="mix"):
        sz.Codebook.calibrate([x, np.zeros(4, ml_dtypes.float8_e5m2)])


def test_codebook_save_load_hash(tmp_path, rng):
    cb = calib(rng)
    p = tmp_path / "cb.json"
    cb.save(p)
    cb2 = sz.Codebook.load(p)
    assert cb2 == cb and cb2.hash == cb.hash
    other = sz.Codebook("bfloat16", cb.exponents[1:] + cb.exponents[:1])
    assert other.hash != cb.hash
    d = json.loads(p.read_text())
    d["exponents"][0], d["exponents"][1] = d["exponents"][1], d["exponents"][0]   # hash left stale
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="corrupted"):
        sz.Codebook.load(p)
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        sz.Codebook.load(p)


def test_range_perm():
    cb = sz.Codebook("bfloat16", (120, 119, 121, 118, 122, 117, 123, 116, 124, 115, 125, 114, 126, 113, 127, 112))
    lo, perm = cb.range_perm()
    assert lo == 112 and all(cb.exponents[perm[r]] == lo + r for r in range(16))
    assert sz.Codebook("bfloat16", tuple(range(100, 115)) + (200,)).range_perm() is None


# ----------------------------------------------------------------------------------------------
# layout: stream bytes derived from the layout description, element by element
# ----------------------------------------------------------------------------------------------
def expected_streams(x, cb, chunk):
    u = bits(x).astype(np.int64)
    geo = Geometry(u.size, chunk)
    w = geo.lanes
    full = np.full(geo.n_pad, cb.exponents[0] << 7, np.int64)
    full[: u.size] = u
    g = np.arange(geo.n_pad)
    c, p = g // chunk, g % chunk
    k, i = p // w, p % w
    e = (full >> 7) & 0xFF
    smv = ((full >> 15) << 7) | (full & 0x7F)
    code_of = {ex: j for j, ex in enumerate(cb.exponents)}
    code = np.array([code_of.get(int(v), 0) for v in e])
    esc = np.array([int(v) not in code_of for v in e])
    sm = np.zeros(geo.n_pad, np.uint8)
    sm[c * chunk + (k // 4) * 4 * w + 4 * i + k % 4] = smv
    codes = np.zeros(geo.n_pad // 2, np.uint8)
    np.add.at(codes, c * (chunk // 2) + 4 * i + k // 2, (code << (4 * (k % 2))).astype(np.uint8))
    counts = np.bincount(c[esc], minlength=geo.num_chunks).astype("<u2")
    order = np.lexsort((p[esc], c[esc]))
    pos = p[esc][order].astype("<u2")
    val = e[esc][order].astype(np.uint8)
    return [sm.tobytes(), codes.tobytes(), counts.tobytes(), pos.tobytes(), val.tobytes()]


@pytest.mark.parametrize("chunk", [1024, 2048])
def test_stream_bytes_follow_the_layout(rng, chunk):
    x = special_values(rng, 3 * chunk - 77)
    cb = calib(rng)
    buf = sz.encode_pages([x], cb, impl="numpy", chunk=chunk, allow_raw=False)
    want = expected_streams(x, cb, chunk)
    payload = b"".join(want)
    assert len(payload) == payload_bytes(sz.encode(x, cb, impl="numpy", chunk=chunk, allow_raw=False).spec,
                                         Geometry(x.size, chunk), len(want[4]))
    assert buf[len(buf) - len(payload):] == payload


# ----------------------------------------------------------------------------------------------
# round trips (numpy and jnp references)
# ----------------------------------------------------------------------------------------------
def all_patterns():
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(BF16)


def adversarial(rng, n, cb):
    """Every element escapes: exponents drawn from outside the codebook."""
    outside = np.setdiff1d(np.arange(256), cb.array)
    e = rng.choice(outside, n)
    return ((rng.integers(0, 2, n) << 15) | (e << 7) | rng.integers(0, 128, n)).astype(np.uint16).view(BF16)


@pytest.mark.parametrize("case", ["patterns", "specials", "adversarial"])
def test_numpy_round_trip_and_size(rng, case):
    cb = calib(rng)
    x = {"patterns": all_patterns, "specials": lambda: special_values(rng, 20000),
         "adversarial": lambda: adversarial(rng, 5000, cb)}[case]()
    enc = sz.encode(x, cb, impl="numpy", chunk=1024, allow_raw=False)
    geo = Geometry(x.size, 1024)
    n_esc_want = int((~np.isin((bits(x) >> 7) & 0xFF, cb.array)).sum())
    assert enc.n_esc == n_esc_want
    assert enc.nbytes() == geo.n_pad + geo.n_pad // 2 + 2 * geo.num_chunks + 3 * n_esc_want
    np.testing.assert_array_equal(bits(sz.decode(enc, cb, impl="numpy")), bits(x))
    buf = sz.encode_pages([x], cb, impl="numpy", chunk=1024, allow_raw=False)
    assert len(buf) == enc.nbytes() + header_len(buf)
    np.testing.assert_array_equal(bits(sz.decode_pages(buf, cb, impl="numpy")[0]), bits(x))


def header_len(buf):
    n_pages = struct.unpack_from("<I", buf, 9)[0]
    off = framing._FIXED.size
    for _ in range(n_pages):
        nd = buf[off]
        off += 1 + 8 * nd
    return off + 1 + 12 * buf[off] + 4


def test_jnp_matches_numpy_with_capacity_retry(rng):
    cb = calib(rng)
    x = special_values(rng, 12 * 1024)         # 1/8 specials: more escapes than capacity 1024
    ref = sz.encode(x, cb, impl="numpy", chunk=1024, allow_raw=False)
    assert ref.n_esc > 1024
    enc = sz.encode(jnp.asarray(x), cb, impl="jnp", chunk=1024, capacity=1024, allow_raw=False)
    assert enc.n_esc == ref.n_esc
    for a, b in [(enc.sm_words, ref.sm_words), (enc.code_words, ref.code_words), (enc.counts, ref.counts)]:
        np.testing.assert_array_equal(np.asarray(a), b)
    np.testing.assert_array_equal(np.asarray(enc.esc_pos)[: ref.n_esc], ref.esc_pos)
    np.testing.assert_array_equal(np.asarray(enc.esc_val)[: ref.n_esc], ref.esc_val)
    np.testing.assert_array_equal(bits(sz.decode(enc, cb, impl="jnp")), bits(x))
    np.testing.assert_array_equal(bits(sz.decode(ref, cb, impl="jnp")), bits(x))


def test_jnp_capacity_overflow_is_reported(rng):
    cb = calib(rng)
    x = adversarial(rng, 2048, cb)
    out = reference.encode_jnp_arrays(jnp.asarray(x), cb, 1024, 1024)
    assert int(out[5]) == 2048                                 # true count, beyond the capacity
    enc = sz.encode(jnp.asarray(x), cb, impl="jnp", chunk=1024, capacity=1024, allow_raw=False)
    assert enc.n_esc == 2048 and enc.esc_pos.shape[0] >= 2048
    np.testing.assert_array_equal(bits(sz.decode(enc, cb, impl="jnp")), bits(x))


def test_raw_fallback_when_split_is_larger(rng):
    cb = calib(rng)
    x = adversarial(rng, 4096, cb)
    for impl in ("numpy", "jnp"):
        enc = sz.encode(x, cb, impl=impl, chunk=1024)
        assert enc.kind == "raw" and enc.nbytes() == x.nbytes
        np.testing.assert_array_equal(bits(sz.decode(enc, cb, impl=impl)), bits(x))


def test_fp8(rng):
    z = (rng.standard_normal(5000) * np.exp2(rng.uniform(-4, 4, 5000))).astype(ml_dtypes.float8_e5m2)
    z.view(np.uint8)[:7] = [0x00, 0x80, 0x7C, 0xFC, 0x7F, 0x01, 0x83]      # +-0, +-inf, nan, subnormals
    cb = sz.Codebook.calibrate(z[:2500])
    for impl in ("numpy", "jnp"):
        enc = sz.encode(z, cb, impl=impl, chunk=1024, allow_raw=False)
        geo = Geometry(z.size, 1024)
        assert enc.nbytes() == 3 * geo.n_pad // 8 + geo.n_pad // 2 + 2 * geo.num_chunks + 3 * enc.n_esc
        np.testing.assert_array_equal(bits(sz.decode(enc, cb, impl=impl)), bits(z))
    buf = sz.encode_pages([z.reshape(50, 100)], cb, impl="numpy", chunk=1024)
    np.testing.assert_array_equal(bits(sz.decode_pages(buf)[0]).reshape(-1), bits(z))
    # e4m3: nothing to gain, passed through raw (no codebook needed)
    q = rng.standard_normal(3000).astype(ml_dtypes.float8_e4m3fn)
    enc = sz.encode(q, None)
    assert enc.kind == "raw" and enc.nbytes() == q.nbytes
    buf = sz.encode_pages([q[:1000], q[1000:].reshape(20, 100)], None)
    out = sz.decode_pages(buf)
    np.testing.assert_array_equal(bits(out[1]).reshape(-1), bits(q[1000:]))


# ----------------------------------------------------------------------------------------------
# pages and framing
# ----------------------------------------------------------------------------------------------
def test_pages_round_trip_jnp(rng):
    cb = calib(rng)
    pages = [special_values(rng, 16 * 6 * 64).reshape(16, 6, 64) for _ in range(3)] + [
        kv_like(rng, 5 * 6 * 64).reshape(5, 6, 64)]
    buf = sz.encode_pages([jnp.asarray(p) for p in pages], cb, impl="jnp")
    out = sz.decode_pages(buf, cb, impl="jnp")
    assert [o.shape for o in out] == [p.shape for p in pages]
    for o, p in zip(out, pages):
        np.testing.assert_array_equal(bits(o), bits(p))
    out = sz.decode_pages(buf, impl="numpy")                 # embedded codebook
    np.testing.assert_array_equal(bits(out[3]), bits(pages[3]))


@pytest.fixture
def framed(rng):
    cb = calib(rng)
    x = special_values(rng, 3000)
    return cb, x, sz.encode_pages([x], cb, impl="numpy", chunk=1024, allow_raw=False)


def test_corrupted_buffers_are_rejected(framed, rng):
    cb, x, buf = framed
    h = header_len(buf)
    geo = Geometry(x.size, 1024)
    n_esc = struct.unpack_from("<Q", buf, 21)[0]
    starts = np.cumsum([h, geo.n_pad, geo.n_pad // 2, 2 * geo.num_chunks, 2 * n_esc])
    for name, lo, hi in zip(["sm", "codes", "counts", "esc_pos", "esc_val"], starts[:-1],
                            list(starts[1:]) + [len(buf)]):
        b = bytearray(buf)
        b[int(rng.integers(lo, hi))] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(sz.FrameError, match=f"checksum mismatch in stream '{name}'"):
            sz.decode_pages(bytes(b), cb)
    b = bytearray(buf)
    b[30] ^= 0x10
    with pytest.raises(sz.FrameError, match="header checksum"):
        sz.decode_pages(bytes(b), cb)
    with pytest.raises(sz.FrameError, match="magic"):
        sz.decode_pages(b"XXXX" + buf[4:], cb)


def test_truncated_and_trailing_buffers_are_rejected(framed, rng):
    cb, _, buf = framed
    for cut in (3, 20, header_len(buf) - 1, header_len(buf) + 5, len(buf) - 1):
        with pytest.raises(sz.FrameError, match="truncated"):
            sz.decode_pages(buf[:cut], cb)
    with pytest.raises(sz.FrameError, match="trailing"):
        sz.decode_pages(buf + b"\0", cb)
    with pytest.raises(TypeError, match="bytes"):
        sz.decode_pages("not bytes", cb)


def test_wrong_codebook_is_rejected(framed):
    cb, x, buf = framed
    other = sz.Codebook("bfloat16", cb.exponents[::-1])
    with pytest.raises(sz.FrameError, match="wrong codebook"):
        sz.decode_pages(buf, other)
    enc = sz.encode(x, cb, impl="numpy", chunk=1024)
    with pytest.raises(ValueError, match="wrong codebook"):
        sz.decode(enc, other, impl="numpy")
    bare = sz.encode_pages([x], cb, impl="numpy", chunk=1024, embed_codebook=False)
    with pytest.raises(sz.FrameError, match="no embedded codebook"):
        sz.decode_pages(bare)
    np.testing.assert_array_equal(bits(sz.decode_pages(bare, cb, impl="numpy")[0]), bits(x))


def test_bad_inputs_name_the_problem(rng):
    cb = calib(rng)
    x = kv_like(rng, 2048)
    with pytest.raises(TypeError, match="float32"):
        sz.encode(np.zeros(8, np.float32), cb)
    with pytest.raises(ValueError, match="power of two"):
        sz.encode(x, cb, chunk=3000)
    with pytest.raises(ValueError, match="codebook is for float8_e5m2"):
        sz.encode(x, sz.Codebook("float8_e5m2", tuple(range(16))))
    with pytest.raises(ValueError, match="needs a codebook"):
        sz.encode(x, None)
    with pytest.raises(ValueError, match="unknown impl"):
        sz.encode(x, cb, impl="cuda")
    with pytest.raises(ValueError, match="bfloat16 only"):
        sz.encode(np.zeros(8, ml_dtypes.float8_e5m2), sz.Codebook("float8_e5m2", tuple(range(16))), impl="gpu")
    with pytest.raises(TypeError, match="list of page arrays"):
        sz.encode_pages(x, cb)
    with pytest.raises(ValueError, match="at least one page"):
        sz.encode_pages([], cb)
    with pytest.raises(TypeError, match="mix dtypes"):
        sz.encode_pages([x, np.zeros(4, ml_dtypes.float8_e5m2)], cb)
    with pytest.raises(TypeError, match="Encoded"):
        sz.decode(x, cb)


def test_auto_impl_and_chunk_choice():
    assert sz.resolve_impl("auto", jnp.zeros(4, jnp.bfloat16), "bfloat16") == (
        {"gpu": "gpu", "tpu": "tpu"}.get(jax.default_backend(), "jnp"))
    assert sz.resolve_impl("auto", None, "float8_e5m2") == "jnp"
    from pallas_kernels.splitzip.dispatch import choose_chunk
    assert choose_chunk(1000) == 1024 and choose_chunk(1 << 24) == 8192
