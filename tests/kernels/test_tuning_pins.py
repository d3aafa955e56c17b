"""The tuned choices of every kernel family, pinned over a grid of shapes.

Why it exists: the tuned parameters live in one table per family (matmul/tuning.py, paged_attention/tuning.py,
splitzip/tuning.py). This test computes what the lookups choose (tile sizes, fused modes, blocks, split counts,
chunks, escape capacities, implementations) for a grid of shapes on the default rows and compares it with
tests/data/tuning_pins.json. A change to a table or a heuristic that moves any choice shows up here and must come
with a new measurement (and a rewritten pin file, `python tests/kernels/test_tuning_pins.py --write`).
"""
import dataclasses
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

PINS = pathlib.Path(__file__).resolve().parents[1] / "data" / "tuning_pins.json"

T_GRID = (1, 4, 8, 16, 32, 64, 128, 256)
DF_GRID = ((4096, 14336), (14336, 4096), (4096, 4096), (4096, 6144), (2048, 7168), (7168, 2048), (1024, 4096),
           (7168, 512), (192, 320))
SMS_GRID = (132, 4)


def _cfg(c):
    """A TileConfig as "tile_d x tile_f" plus the fields that differ from the defaults."""
    if c is None:
        return None
    rest = [f"{k}={v}" for k, v in dataclasses.asdict(c).items()
            if k not in ("tile_d", "tile_f") and v != getattr(type(c)(), k)]
    return " ".join([f"{c.tile_d}x{c.tile_f}", *rest])


def _matmul():
    from pallas_kernels.matmul import dispatch, gpu, gpu_fused, tuning
    out = {}
    for t in T_GRID:
        for d, f in DF_GRID:
            for n_mats in (1, 2):
                for w_item, bs in ((2, False), (1, False), (1, True)):
                    for sms in SMS_GRID:
                        k = f"t={t} d={d} f={f} m={n_mats} w={w_item} bs={int(bs)} sms={sms}"
                        out[k] = {
                            "auto_config": _cfg(gpu.auto_config(t, d, f, n_mats, w_item, bs, sms)),
                            "fused_direct": _cfg(gpu_fused.auto_config(t, d, f, n_mats, w_item, bs, sms, "direct")),
                            "fused_sem": _cfg(gpu_fused.auto_config(t, d, f, n_mats, w_item, bs, sms, "sem")),
                            "auto_mode": gpu_fused.auto_mode(t, d, f, n_mats, w_item, sms),
                        }
    # the dispatcher's choices for the interpret-mode grid (no GPU): fused mode of the default, kernel or not
    for t in (1, 8, 64, 300):
        for d, f in DF_GRID[:6]:
            for wdt in ("bfloat16", "float8_e4m3fn"):
                x = jax.ShapeDtypeStruct((t, d), jnp.bfloat16)
                w = jax.ShapeDtypeStruct((d, f), jnp.dtype(wdt))
                ws = [w, w]
                k = f"dispatch t={t} d={d} f={f} w={wdt}"
                out[k] = {
                    "fused_mode_1": gpu.fused_mode(x, [w], [None], None, tuning.current().interpret_sms, True),
                    "fused_mode_2": gpu.fused_mode(x, ws, [None, None], None, tuning.current().interpret_sms, True,
                                                   silu_mul=True),
                    "unsupported": dispatch.kernel_unsupported_reason(x, [w]),
                }
    return out


def _paged():
    from pallas_kernels.paged_attention import gpu, gpu_fp8
    out = {}
    for G in (16, 32, 64, 128, 256):
        for H in (64, 128, 256, 576):
            for fp8 in (False, True):
                for ragged in (False, True):
                    for qk8 in (False, True):
                        out[f"block G={G} H={H} fp8={int(fp8)} ragged={int(ragged)} qk8={int(qk8)}"] = list(
                            gpu.choose_block(G, H, fp8, ragged, qk8))
            for conv in (1, 2, 3):
                for cw in (1, 2):
                    for qk8 in (False, True):
                        out[f"block_ws G={G} H={H} conv={conv} cw={cw} qk8={int(qk8)}"] = list(
                            gpu_fp8.choose_block_ws(G, H, conv, cw, qk8))
    for work in (1, 8, 64, 256, 1024):
        for n_blocks in (1, 4, 64, 512):
            for policy in ("waves", "sms2"):
                for smem in (40_000, 90_000, 200_000):
                    out[f"splits work={work} nb={n_blocks} {policy} smem={smem}"] = gpu.choose_splits(
                        work, n_blocks, policy, smem)
    fields = ("worklist", "extra", "wave", "programs", "BK", "stages", "splits", "steps_per_split", "converters",
              "compute_wgs", "fp8_bits", "qk8")
    for S, N, K, H in ((1, 8, 8, 128), (8, 32, 8, 128), (64, 32, 8, 128), (8, 16, 2, 64), (8, 8, 1, 256)):
        for G in (16, 64):
            for pool in ("bfloat16", "float8_e4m3fn"):
                for ragged in (0, 37):
                    for cols in (16, 512):
                        try:
                            cfg = gpu.make_config((S, N, H), (1024, G, 2 * K, H), jnp.dtype(pool), cols, scale=1.0,
                                                  soft_cap=None, sliding_window=None, out_dtype="bfloat16",
                                                  ragged_tiles=ragged)
                            v = {f: getattr(cfg, f) for f in fields}
                        except Exception as e:  # noqa: BLE001 - a shape the kernel refuses is pinned too
                            v = type(e).__name__
                        out[f"config S={S} N={N} K={K} H={H} G={G} {pool} ragged={ragged} cols={cols}"] = v
    return out


def _splitzip():
    import numpy as np

    from pallas_kernels.splitzip import dispatch
    out = {}
    for n in (1, 1000, 1024, 5000, (1 << 20) - 1, 1 << 20, 3 << 20, 1 << 24, 1 << 28):
        out[f"chunk n={n}"] = dispatch.choose_chunk(n)
        out[f"capacity n={n}"] = dispatch.default_capacity(n)
    x = np.zeros(4, np.float32)
    for dt in ("bfloat16", "float8_e4m3fn", "float32"):
        for op in ("encode", "decode"):
            out[f"impl {dt} {op}"] = dispatch.resolve_impl("auto", x, dt, op)
    return out


def compute():
    return {"matmul": _matmul(), "paged_attention": _paged(), "splitzip": _splitzip()}


def test_tuned_choices_match_the_pins():
    got = json.loads(json.dumps(compute()))
    want = json.loads(PINS.read_text())
    for family in want:
        diff = [k for k in want[family] if got[family].get(k) != want[family][k]]
        assert not diff and set(got[family]) == set(want[family]), (
            f"{family}: {len(diff)} choices moved, e.g. {diff[:3]}: "
            f"{[(want[family][k], got[family].get(k)) for k in diff[:3]]}")


def test_overrides_and_explicit_rows_move_the_choices():
    """An override (or an explicit `tun=` row) changes what the lookups choose inside its block only."""
    from pallas_kernels.matmul import gpu, gpu_fused
    from pallas_kernels.matmul import tuning as mm
    from pallas_kernels.paged_attention import gpu as pa_gpu
    from pallas_kernels.paged_attention import tuning as pa
    from pallas_kernels.splitzip import dispatch
    from pallas_kernels.splitzip import tuning as sz

    x, w = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((4096, 14336), jnp.bfloat16)
    assert gpu.fused_mode(x, [w, w], [None, None], None, 132, False, silu_mul=True) == "direct"
    with mm.override(fused=None):
        assert gpu.fused_mode(x, [w, w], [None, None], None, 132, False, silu_mul=True) is None
    assert gpu_fused.auto_mode(1, 4096, 14336, 2, 2, 132, mm.MatmulTuning(direct_min_busy=2.0)) is None
    assert gpu.auto_config(32, 4096, 6144, 1, 2, False, 132).tile_f == 64
    assert gpu.auto_config(32, 4096, 6144, 1, 2, False, 132, mm.MatmulTuning(narrow_f_tp=(0, 0))).tile_f == 128

    assert pa_gpu.choose_block(16, 128, False) == (64, 2)
    with pa.override(decode_block=(128, 2), num_sms=7):
        assert pa_gpu.choose_block(16, 128, False) == (128, 2) and pa.num_sms() == 7
    assert pa.num_sms() == pa.num_sms(pa.TABLE["default"])

    assert dispatch.choose_chunk(5000) == 1024 and dispatch.default_capacity(1 << 20) == 2048
    with sz.override(chunk_large_from=1, capacity_min=4096):
        assert dispatch.choose_chunk(5000) == 8192 and dispatch.default_capacity(1 << 20) == 4096
    assert dispatch.choose_chunk(5000, sz.SplitZipTuning(chunk_small=2048)) == 2048


if __name__ == "__main__" and "--write" in sys.argv:
    PINS.write_text(json.dumps(compute(), indent=1, sort_keys=True) + "\n")
