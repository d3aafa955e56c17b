"""Named-mesh sharding on 8 fake CPU devices: packed attention buffers, just-in-time gathers (all_gather and the
ppermute ring), expert parallelism (gather and all_to_all with capacity), partition rules, meshes that do not fit,
and the decode-mesh forward against transformers' logits (tests/data/hf_moe, made by
`/tmp/refenv/bin/python scripts/make_hf_moe_reference.py`) with attention weights sharded and replicated."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from sharding import expert_parallel as xp
from sharding import packed as pk
from sharding import rules as sr
from sharding.mesh import DecodeLayout, MeshMismatch, make_mesh, parse_mesh_arg
from sharding.prefetch import gather_buffer
from tbjax.model import mesh_forward as mf
from tbjax.weights.hf_names_moe import load_hf

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "hf_moe")
SEED = int.from_bytes(os.urandom(4), "little")
REPS = 4                               # 2 reference rows x 4 = 8 sequences: one per device on 8 devices


def rng(k=0):
    return np.random.default_rng(SEED + k)


# ---- meshes ---------------------------------------------------------------------------------------------------
def test_make_mesh_axes_and_errors():
    m = make_mesh(dp=2, ep=4)
    assert m.axis_names == ("dp", "ep", "tp", "pp") and dict(m.shape) == {"dp": 2, "ep": 4, "tp": 1, "pp": 1}
    with pytest.raises(MeshMismatch, match="needs 16 devices but only 8"):
        make_mesh(dp=4, ep=4)
    with pytest.raises(MeshMismatch, match="'ep' must be a positive integer"):
        make_mesh(ep=0)
    assert parse_mesh_arg("dp=8, ep=2") == {"dp": 8, "ep": 2}
    for bad, msg in (("xp=2", "unknown mesh axis"), ("dp", "axis=size"), ("dp=two", "not an integer"),
                     ("dp=0", ">= 1")):
        with pytest.raises(MeshMismatch, match=msg):
            parse_mesh_arg(bad)
    with pytest.raises(MeshMismatch, match="attn_gather"):
        DecodeLayout(attn_gather="broadcast")


# ---- packed buffers -------------------------------------------------------------------------------------------
def test_pack_unpack_mixed_dtypes_is_exact():
    r = rng(1)
    t = {"a": r.normal(size=(3, 5)).astype(jnp.bfloat16), "n": r.normal(size=(7,)).astype(np.float32),
         "b": r.normal(size=(4, 2, 3)).astype(np.float16)}
    lay = pk.make_layout({k: (v.shape, v.dtype) for k, v in t.items()})
    assert all(e.offset % pk.ALIGN == 0 for e in lay.entries) and lay.nbytes % pk.ALIGN == 0
    buf = pk.pack(t, lay, total_bytes=lay.padded_bytes(3))
    assert buf.dtype == jnp.uint8 and buf.shape == (lay.padded_bytes(3),) and lay.padded_bytes(3) % 3 == 0
    out = pk.unpack(buf, lay)
    for k, v in t.items():
        assert out[k].dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(v))


def test_fp8_wire_is_exact_with_checkpoint_scales_and_close_without():
    r = rng(2)
    codes = jnp.asarray(r.normal(0, 60, (40, 24)).clip(-448, 448)).astype(pk.FP8)
    s = r.uniform(1e-3, 1e-2, (3, 2)).astype(np.float32)             # 16x16 blocks, partial edges
    w32 = np.asarray(codes.astype(jnp.float32)) * np.repeat(np.repeat(s, 16, 0), 16, 1)[:40, :24]
    for dt in (jnp.float32, jnp.bfloat16):
        w = jnp.asarray(w32).astype(dt)                               # "the checkpoint, dequantized"
        lay = pk.make_layout({"w": ((40, 24), dt), "g": ((24,), dt)}, wire="fp8", block=(16, 16))
        assert lay.entry("w").encoding == "fp8_block" and lay.entry("g").encoding == "raw"
        buf = pk.pack({"w": w, "g": jnp.ones(24, dt)}, lay, {"w": s})
        np.testing.assert_array_equal(np.asarray(pk.unpack(buf, lay)["w"]), np.asarray(w))
        # without the checkpoint's scales: amax/448 per block, within e4m3's 2^-4 relative step
        got = np.asarray(pk.unpack(pk.pack({"w": w, "g": jnp.ones(24, dt)}, lay), lay)["w"], np.float32)
        np.testing.assert_allclose(got, np.asarray(w, np.float32), rtol=0.07, atol=1e-6)
    nat = pk.make_layout({"w": ((40, 24), jnp.bfloat16)})
    assert lay.nbytes < nat.nbytes


def test_pack_errors_name_the_problem():
    lay = pk.make_layout({"w": ((4, 4), jnp.float32)}, wire="fp8", block=(2, 2))
    with pytest.raises(pk.PackError, match="missing tensor 'w'"):
        pk.pack({}, lay)
    with pytest.raises(pk.PackError, match="has shape \\(4, 3\\)"):
        pk.pack({"w": jnp.zeros((4, 3))}, lay)
    with pytest.raises(pk.PackError, match="scales of 'w' have shape"):
        pk.pack({"w": jnp.zeros((4, 4))}, lay, {"w": jnp.ones((3, 2))})
    with pytest.raises(pk.PackError, match="not in the packed layout"):
        pk.pack({"w": jnp.zeros((4, 4)), "x": jnp.zeros(1)}, lay)
    with pytest.raises(pk.PackError, match="2-D"):
        pk.make_layout({"v": ((4,), jnp.float32)}, wire="fp8", fp8_names=("v",))


# ---- gathers --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["all_gather", "ppermute"])
@pytest.mark.parametrize("axes", [("dp", "ep"), ("ep",)])
def test_gather_buffer_assembles_the_full_buffer(mode, axes):
    mesh = make_mesh(dp=2, ep=4)
    n = int(np.prod([mesh.shape[a] for a in axes]))
    full = rng(3).integers(0, 256, (5, n * 32)).astype(np.uint8)
    x = jax.device_put(full, NamedSharding(mesh, P(None, axes)))
    f = jax.jit(jax.shard_map(lambda s: jax.vmap(lambda r: gather_buffer(r, axes, mode))(s), mesh=mesh,
                              in_specs=P(None, axes), out_specs=P(None, axes)))
    got = np.asarray(f(x))                       # every device's full copy, concatenated along the sharded axis
    np.testing.assert_array_equal(got, np.tile(full, (1, n)))


# ---- expert parallelism ---------------------------------------------------------------------------------------
def _ep_case(T=6, K=3, E=8, D=8, F=6):
    r = rng(4)
    x = r.normal(size=(8 * T, D)).astype(np.float32)
    ids = np.stack([r.permutation(E)[:K] for _ in range(8 * T)]).astype(np.int32)
    ids[: T] = 0                                   # device 0 sends all of its first pairs to expert 0: skew
    w = r.uniform(0.1, 1, (8 * T, K)).astype(np.float32)
    wg, wu = r.normal(0, 0.3, (2, E, D, F)).astype(np.float32)
    wd = r.normal(0, 0.3, (E, F, D)).astype(np.float32)
    return x, ids, w, (wg, wu, wd)


def _np_ep(x, ids, w, weights, n, C):
    """float64 reference with all_to_all capacity: on each source device, pairs in (token, k) order; a pair is
    dropped once its destination device already got C pairs from that source."""
    wg, wu, wd = (a.astype(np.float64) for a in weights)
    E = wg.shape[0]
    T = x.shape[0] // n
    y = np.zeros(x.shape)
    dropped = 0
    for src in range(n):
        count = np.zeros(n, int)
        for t in range(src * T, (src + 1) * T):
            for j, e in enumerate(ids[t]):
                dst = e // (E // n)
                if count[dst] >= C:
                    dropped += 1
                    continue
                count[dst] += 1
                g, u = x[t] @ wg[e], x[t] @ wu[e]
                y[t] += w[t, j] * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    return y, dropped


@pytest.mark.parametrize("mode,capacity", [("gather", None), ("all_to_all", None), ("all_to_all", 2)])
def test_expert_parallel_dispatch_combine(mode, capacity):
    mesh = make_mesh(dp=2, ep=4)
    axes = ("dp", "ep")
    x, ids, w, weights = _ep_case()
    E = weights[0].shape[0]

    def f(x, ids, w, wg, wu, wd):
        y, drop = xp.moe_dispatch_combine(x, ids, w, (wg, wu, wd), n_experts=E, axes=axes, mode=mode,
                                          capacity=capacity)
        return y, jax.lax.psum(drop, axes)

    tok, exp = P(axes), P(axes)
    sm = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(tok, tok, tok, exp, exp, exp), out_specs=(tok, P())))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    y, dropped = sm(put(x, tok), put(ids, tok), put(w, tok), *(put(a, exp) for a in weights))
    ref, ref_drop = _np_ep(x, ids, w, weights, 8, capacity or ids.size)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-5, err_msg=f"seed {SEED}")
    assert int(dropped) == ref_drop and (capacity is None) == (ref_drop == 0)


def test_expert_load_is_summed_over_batch_axes():
    mesh = make_mesh(dp=2, ep=4)
    ids = rng(5).integers(0, 16, (64, 4)).astype(np.int32)
    f = jax.jit(jax.shard_map(lambda i: xp.expert_load(i, 16, ("dp", "ep")), mesh=mesh,
                              in_specs=P(("dp", "ep")), out_specs=P()))
    np.testing.assert_array_equal(np.asarray(f(jax.device_put(ids, NamedSharding(mesh, P(("dp", "ep")))))),
                                  np.bincount(ids.ravel(), minlength=16))


# ---- partition rules ------------------------------------------------------------------------------------------
def test_partition_rules_match_and_check():
    tree = {"attn_packed": jax.ShapeDtypeStruct((3, 64), jnp.uint8),
            "groups": {"g": {"we_gate": jax.ShapeDtypeStruct((3, 8, 4, 2), jnp.float32),
                             "router": jax.ShapeDtypeStruct((3, 4, 8), jnp.float32)},
                       "h": {"we_up": [jax.ShapeDtypeStruct((8, 4, 2), jnp.float32)]}}}
    specs = sr.match_rules(tree, sr.decode_rules(("ep",), ("dp", "ep")))
    assert specs["attn_packed"] == P(None, ("dp", "ep"))
    assert specs["groups"]["g"]["we_gate"] == P(None, "ep") and specs["groups"]["g"]["router"] == P()
    assert specs["groups"]["h"]["we_up"][0] == P("ep")           # a per-layer expert buffer [E, ...]
    with pytest.raises(sr.RuleError, match="no partition rule matches parameter 'groups/g/router'"):
        sr.match_rules(tree, [(r"^attn_packed", P()), (r"we_", P())])
    mesh = make_mesh(dp=2, ep=3)
    with pytest.raises(sr.RuleError, match="groups/g/we_gate: dimension 1 of size 8 cannot be split over mesh axes ep=3"):
        sr.shardings(tree, sr.decode_rules(("ep",), ()), mesh)


# ---- the decode-mesh forward ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ds():
    spec, params, scales = load_hf(os.path.join(DATA, "deepseek_v3"), dtype=jnp.float32)
    return spec, params, scales, _batch("deepseek_v3")


def _batch(name):
    ref = np.load(os.path.join(DATA, name, "reference.npz"))
    B, S = ref["tokens"].shape
    tok = np.tile(ref["tokens"], (REPS, 1)).reshape(-1)
    pos = np.tile(np.arange(S), B * REPS)
    seg = np.repeat(np.arange(B * REPS), S)
    want = np.tile(ref["logits"], (REPS, 1, 1)).reshape(B * REPS * S, -1)
    return tok, pos, seg, want


def _run(spec, params, scales, batch, dp, ep, layout):
    mesh = make_mesh(dp=dp, ep=ep)
    plan = mf.make_plan(spec, mesh, layout, dtype=jnp.float32, fp8_scales=scales)
    mp = mf.mesh_params(params, plan, mesh, scales)
    logits, stats = mf.make_forward(plan, mesh, mp)(mp, *batch[:3])
    return plan, mp, np.asarray(logits), jax.tree.map(np.asarray, stats)


_LAYOUTS = {
    "1x1": (1, 1, DecodeLayout()),
    "2x4 all_gather gather": (2, 4, DecodeLayout()),
    "4x2 ppermute all_to_all": (4, 2, DecodeLayout(attn_gather="ppermute", ep_mode="all_to_all")),
    "8x1 replicated": (8, 1, DecodeLayout(attn_axes=())),
    "2x4 experts/ep attn/dp": (2, 4, DecodeLayout(expert_axes=("ep",), attn_axes=("dp",), unroll=2)),
}
_RESULTS = {}


@pytest.mark.parametrize("name", list(_LAYOUTS))
def test_mesh_forward_matches_transformers(ds, name):
    spec, params, scales, batch = ds
    dp, ep, lay = _LAYOUTS[name]
    plan, mp, logits, stats = _run(spec, params, None, batch, dp, ep, lay)
    np.testing.assert_allclose(logits, batch[3], atol=2e-5, rtol=0, err_msg=name)
    n_moe = sum(1 for i in range(spec.n_layers) if spec.layer_kind(i)[1] == "moe")
    assert stats["expert_load_LE"].shape == (n_moe, spec.moe.n_experts)
    assert (stats["expert_load_LE"].sum(1) == len(batch[0]) * spec.moe.top_k).all()
    assert (stats["dropped_L"] == 0).all()
    _RESULTS[name] = (logits, stats["expert_load_LE"])
    if "1x1" in _RESULTS:     # same routing everywhere; sharded and replicated attention give the same logits
        np.testing.assert_array_equal(stats["expert_load_LE"], _RESULTS["1x1"][1])
        np.testing.assert_allclose(logits, _RESULTS["1x1"][0], atol=5e-6, rtol=0)
    if not plan.packed:       # replicated attention keeps the ordinary tree (no gather)
        assert "attn_packed" not in mp and "w_o" in mp["groups"]["mla_moe"]
        return
    # memory: each device holds 1/N of every layer's packed attention buffer (plus alignment padding)
    arr = mp["attn_packed"]
    n = plan.attn_shards
    per_dev = {s.data.nbytes for s in arr.addressable_shards}
    assert per_dev == {spec.n_layers * plan.attn_pack.shard_bytes(n)}
    tensors = spec.n_layers * plan.attn_pack.tensor_bytes()
    assert tensors / n <= per_dev.pop() <= tensors / n + spec.n_layers * pk.ALIGN * (len(plan.attn_pack.entries) + 1)


@pytest.mark.parametrize("name,dp,ep,lay", [
    ("mixtral", 2, 4, DecodeLayout()),
    ("qwen3_moe", 8, 1, DecodeLayout(attn_gather="ppermute", ep_mode="all_to_all", capacity_factor=8.0)),
])
def test_mesh_forward_gqa_moe_models(name, dp, ep, lay):
    spec, params, _ = load_hf(os.path.join(DATA, name), dtype=jnp.float32)
    batch = _batch(name)
    _, _, logits, stats = _run(spec, params, None, batch, dp, ep, lay)
    np.testing.assert_allclose(logits, batch[3], atol=2e-5, rtol=0)
    assert (stats["dropped_L"] == 0).all()


def test_fp8_checkpoint_travels_in_fp8_exactly():
    spec, params, scales = load_hf(os.path.join(DATA, "deepseek_v3_fp8"), dtype=jnp.float32)
    batch = _batch("deepseek_v3_fp8")
    plan, mp, logits, _ = _run(spec, params, scales, batch, 8, 1, DecodeLayout(attn_wire="fp8"))
    enc = {e.name: e.encoding for e in plan.attn_pack.entries}
    assert enc["wq_b"] == enc["w_o"] == "fp8_block" and enc["wkv_a"] == enc["attn_norm"] == "raw"
    np.testing.assert_allclose(logits, batch[3], atol=2e-5, rtol=0)
    # the unpacked weights are bit-identical to the loader's dequantized ones
    buf = np.concatenate([np.asarray(s.data)[1] for s in sorted(mp["attn_packed"].addressable_shards,
                                                                key=lambda s: s.index[1].start)])
    got = pk.unpack(jnp.asarray(buf), plan.attn_pack)
    ref = params["groups"]["mla_moe"]
    for k in ("wq_b", "w_o", "wkv_b", "wkv_a", "attn_norm"):
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(ref[k][0]), err_msg=k)


def test_meshes_that_do_not_fit_are_refused(ds):
    spec, params, _, batch = ds
    with pytest.raises(MeshMismatch, match=r"routed experts: 8 cannot be split over mesh axes dp=3 x ep=2 \(size 6"):
        mf.make_plan(spec, make_mesh(dp=3, ep=2), DecodeLayout())
    with pytest.raises(MeshMismatch, match="tp=2: the decode forward does not implement tp"):
        mf.make_plan(spec, make_mesh(dp=2, tp=2), DecodeLayout())
    with pytest.raises(MeshMismatch, match="not batch axes"):
        mf.make_plan(spec, make_mesh(dp=2, ep=2), DecodeLayout(batch_axes=("dp",)))
    mesh = make_mesh(dp=8)
    plan = mf.make_plan(spec, mesh, DecodeLayout())
    f = mf.make_forward(plan, mesh, mf.abstract_mesh_params(plan))
    tok, pos, seg, _ = batch
    with pytest.raises(MeshMismatch, match=r"batch \(tokens\): 90 cannot be split over mesh axes dp=8 x ep=1"):
        f(None, tok[:90], pos[:90], seg[:90])
    with pytest.raises(MeshMismatch, match="straddles devices"):
        f(None, tok, pos, np.zeros_like(seg))
