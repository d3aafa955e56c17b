"""SplitZip kernels: Mosaic GPU and Mosaic TPU versions run by the Pallas interpreters on CPU and
compared stream for stream with the numpy reference; GPU kernels lowered for cuda, TPU kernels
exported for tpu. Interpreted outputs start poisoned (all ones), so an unwritten word shows up.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels.splitzip as sz
from pallas_kernels.splitzip import dispatch, gpu, tpu

from splitzip_helpers import kv_like, rng  # noqa: F401  (rng is a fixture)

BF16 = ml_dtypes.bfloat16
CHUNK = 1024


def planted(rng, nch):
    """KV-like data with specials (NaN payloads, +-0, +-inf, subnormals) and one chunk whose escapes
    spread over more lanes than the GPU kernel's slots (exercises the second pass)."""
    x = kv_like(rng, nch * CHUNK).view(np.uint16).copy()
    idx = rng.choice(x.size, size=x.size // 200, replace=False)
    x[idx] = rng.choice(np.array([0, 0x8000, 0x7F80, 0xFF80, 0x7FC3, 0xFFB1, 0x0001, 0x8040], np.uint16), idx.size)
    c = int(rng.integers(0, nch))
    x[c * CHUNK + rng.choice(CHUNK, 60, replace=False)] = 0x0001
    return x.view(BF16)


def codebooks(rng):
    m = sz.Codebook.calibrate(kv_like(rng, 1 << 15)).exponents[0]       # the most frequent exponent
    window = list(range(m - 10, m + 6))
    rng.shuffle(window)
    cb = sz.Codebook("bfloat16", (m,) + tuple(e for e in window if e != m))   # 16 in a row, code 0 = mode
    gap = sz.Codebook("bfloat16", cb.exponents[:15] + (max(cb.exponents) + 3,))   # not 16 in a row
    assert cb.range_perm() is not None and gap.range_perm() is None
    return cb, gap


def bits(a):
    return np.asarray(a).view(np.uint16)


def check_same(enc, ref):
    assert enc.kind == ref.kind == "split" and enc.n_esc == ref.n_esc
    np.testing.assert_array_equal(np.asarray(enc.sm_words), ref.sm_words)
    np.testing.assert_array_equal(np.asarray(enc.code_words), ref.code_words)
    np.testing.assert_array_equal(np.asarray(enc.counts), ref.counts)
    np.testing.assert_array_equal(np.asarray(enc.esc_pos)[: ref.n_esc], ref.esc_pos)
    np.testing.assert_array_equal(np.asarray(enc.esc_val)[: ref.n_esc], ref.esc_val)


@pytest.mark.parametrize("lookup,lut", [("range", "swar"), ("chain", "select")])
def test_gpu_interpret_matches_reference(rng, lookup, lut):
    cb_range, cb_gap = codebooks(rng)
    cb = cb_range if lookup == "range" else cb_gap
    x = planted(rng, 6)
    ref = sz.encode(x, cb, impl="numpy", chunk=CHUNK, allow_raw=False)
    enc = sz.encode(jnp.asarray(x), cb, impl="gpu_interpret", chunk=CHUNK, lookup=lookup, allow_raw=False)
    check_same(enc, ref)
    np.testing.assert_array_equal(bits(sz.decode(ref, cb, impl="gpu_interpret", lut=lut)), bits(x))


def test_gpu_interpret_all_patterns_and_all_escapes(rng):
    cb, _ = codebooks(rng)
    pat = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(BF16)
    ref = sz.encode(pat, cb, impl="numpy", chunk=CHUNK, allow_raw=False)
    enc = sz.encode(jnp.asarray(pat), cb, impl="gpu_interpret", chunk=CHUNK, allow_raw=False)
    check_same(enc, ref)
    np.testing.assert_array_equal(bits(sz.decode(enc, cb, impl="gpu_interpret")), bits(pat))
    # every element escapes; capacity and second-pass rows far too small -> reported, redone
    outside = np.setdiff1d(np.arange(256), cb.array)
    e = rng.choice(outside, 4 * CHUNK)
    adv = ((e << 7) | rng.integers(0, 1 << 7, e.size) | (rng.integers(0, 2, e.size) << 15)).astype(np.uint16).view(BF16)
    ref = sz.encode(adv, cb, impl="numpy", chunk=CHUNK, allow_raw=False)
    enc = sz.encode(jnp.asarray(adv), cb, impl="gpu_interpret", chunk=CHUNK, capacity=1024, cap_rows=1,
                    allow_raw=False)
    check_same(enc, ref)
    np.testing.assert_array_equal(bits(sz.decode(enc, cb, impl="gpu_interpret")), bits(adv))


def test_gpu_escape_overflow_is_reported_not_cut(rng):
    cb, _ = codebooks(rng)
    x = planted(rng, 2)
    ref = sz.encode(x, cb, impl="numpy", chunk=CHUNK, allow_raw=False)
    out = dispatch._encode_device(jnp.asarray(x), cb=cb, chunk=CHUNK, impl="gpu_interpret", capacity=8,
                                  cap_rows=0, opts=())
    n_esc, status = int(out[5]), int(out[6])
    assert n_esc == ref.n_esc > 8
    assert status == 3          # capacity exceeded and a chunk needed the (absent) second pass


def test_tpu_interpret_matches_reference(rng):
    cb, _ = codebooks(rng)
    x = planted(rng, 8)
    ref = sz.encode(x, cb, impl="numpy", chunk=CHUNK, allow_raw=False)
    enc = sz.encode(jnp.asarray(x), cb, impl="tpu_interpret", chunk=CHUNK, allow_raw=False)
    check_same(enc, ref)
    np.testing.assert_array_equal(bits(sz.decode(enc, cb, impl="tpu_interpret")), bits(x))
    pat = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(BF16)
    enc = sz.encode(jnp.asarray(pat), cb, impl="tpu_interpret", chunk=CHUNK, allow_raw=False)
    check_same(enc, sz.encode(pat, cb, impl="numpy", chunk=CHUNK, allow_raw=False))
    np.testing.assert_array_equal(bits(sz.decode(enc, cb, impl="tpu_interpret")), bits(pat))


# Every lookup / slots / lut choice is lowered once, spread over a narrow (one element per thread)
# and a wide (16-byte vectors) chunk.
@pytest.mark.parametrize("lanes,first", [(128, True), (1024, False)])
def test_gpu_kernels_lower_for_cuda(lanes, first):
    cb = sz.default_codebook()
    gap = sz.Codebook("bfloat16", cb.exponents[:15] + (200,))
    nch = 4
    x = jax.ShapeDtypeStruct((nch, 8, lanes), jnp.uint16)
    for c, lookup, slots in ((cb, "range", 16 if first else 0), (gap, "chain", 0 if first else 16)):
        hlo = jax.jit(gpu.encode_kernel(nch, lanes, c, lookup=lookup, slots=slots)).trace(x).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in hlo
    words = (jax.ShapeDtypeStruct((nch, 2, lanes), jnp.uint32), jax.ShapeDtypeStruct((nch, lanes), jnp.uint32))
    hlo = jax.jit(gpu.decode_kernel(nch, lanes, cb, lut="select" if first else "swar")).trace(*words).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in hlo


def test_gpu_pipelines_lower_for_cuda():
    cb = sz.default_codebook()
    n, chunk = 16 * 8192, 8192
    enc = jax.jit(lambda x: dispatch._encode_device(x, cb=cb, chunk=chunk, impl="gpu", capacity=1024,
                                                    cap_rows=4, opts=()))
    hlo = enc.trace(jax.ShapeDtypeStruct((n,), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in hlo
    nch, w = n // chunk, chunk // 8
    dec = jax.jit(lambda *a: dispatch._decode_device(*a, cb=cb, dtype="bfloat16", shape=(n,), chunk=chunk,
                                                     impl="gpu", opts=()))
    args = (jax.ShapeDtypeStruct((nch, 2, w), jnp.uint32), jax.ShapeDtypeStruct((nch, w), jnp.uint32),
            jax.ShapeDtypeStruct((nch,), jnp.int32), jax.ShapeDtypeStruct((1024,), jnp.int32),
            jax.ShapeDtypeStruct((1024,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    assert "mosaic_gpu" in dec.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("nch,lanes", [(8, 128), (16, 1024)])
def test_tpu_kernels_export_for_tpu(nch, lanes):
    cb = sz.default_codebook()
    exp = jax.export.export(jax.jit(tpu.encode_kernel(nch, lanes, cb)), platforms=["tpu"])(
        jax.ShapeDtypeStruct((nch * 8, lanes), jnp.uint16))
    assert "tpu_custom_call" in exp.mlir_module()
    exp = jax.export.export(jax.jit(tpu.decode_kernel(nch, lanes, cb)), platforms=["tpu"])(
        jax.ShapeDtypeStruct((2 * nch, lanes), jnp.uint32), jax.ShapeDtypeStruct((nch, lanes), jnp.uint32))
    assert "tpu_custom_call" in exp.mlir_module()
