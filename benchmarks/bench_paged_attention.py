"""Paged attention on a GPU: correctness against the jnp reference, then speed (issue 4).

Sections (each writes its results into the JSON as soon as it finishes, so a run cut short keeps them):
  ceiling     HBM copy bandwidth measured in the same run (torch device-to-device copy, read + write bytes;
              and a JAX copy) - the bandwidth the decode kernel is compared with.
  correctness Mosaic GPU kernels vs the reference on random small problems (decode, fp8, ragged, sparse).
  decode      decode attention, batch x context x GQA, 8 kv heads x 128, page 16: kernel time, achieved KV
              bandwidth, % of the copy ceiling, speed-up over the jnp reference and over JAX's deprecated
              Triton paged_attention op where it runs.
  fp8         fp8 (e4m3fn, e5m2) KV time vs bf16 on the same shapes.
  sparse      sparse decode (10% of pages) vs dense at 32k context.
  tuning      block size / stages / splits variants.
  prefill     ragged prefill kernel vs the reference (uniform prefill, and a mixed prefill + decode batch).
  fp8var      fp8 kernel variants (inline conversion vs warp-specialized converters, block, stages, split
              policy) at batch 8 x 8k, against bf16 in the same run; picks the fastest for `grid`.
  small       bf16 small-batch / short-context variants (block, stages, split policy).
  grid        bf16 and fp8 (the fp8var winner) over batch x context, with errors against the reference.
  wide        the cost of padding (--wide-pages N): the same decode batch with its tight block table, with the
              table padded to N pages per sequence, and with extra kv_len-0 slots (2 x batch, and --wide-slots),
              plus the opt-in run-time work list (work_list=True) and the max_kv_len hint; bf16 and fp8; and the
              ragged kernel's share of an engine step (a decode-only step: every slot at kv_len 0; a mixed step:
              prefill chunks + decode rows at kv_len 0), next to the same prefill with a tight table.

Usage: python3 benchmarks/bench_paged_attention.py --out results.json   (on the H200)
       python3 benchmarks/bench_paged_attention.py --wide-pages 8192 --out wide.json   (the padding cost only)
       python3 benchmarks/bench_paged_attention.py --smoke             (CPU: tiny shapes, interpreted kernels)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import torch_copy_script, write_json  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TORCH_COPY = torch_copy_script(10)


def torch_copy_ceiling():
  try:
    out = subprocess.run([sys.executable, "-c", TORCH_COPY], capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])
  except Exception as e:  # noqa: BLE001
    return {"error": repr(e)}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted kernels, CPU")
  ap.add_argument("--out", default="paged_attention_bench.json")
  ap.add_argument("--time-limit", type=float, default=480.0, help="skip remaining sections after this many s")
  ap.add_argument("--sections", default=None,
                  help="default ceiling,correctness,decode,fp8,sparse,triton,tuning,prefill (with --wide-pages: "
                       "ceiling,wide); r3 run: ceiling,correctness,fp8var,small,triton,sparse,prefill,grid")
  ap.add_argument("--wide-pages", type=int, default=0,
                  help="`wide` section: block-table width (pages per sequence) of the padded tables, e.g. 8192 = "
                       "128k tokens at page 16; implies --sections ceiling,wide unless --sections is given")
  ap.add_argument("--wide-slots", type=int, default=256,
                  help="`wide` section: sequence slots of the largest padded batch (real ones + kv_len-0 ones)")
  ap.add_argument("--watchdog", type=float, default=0.0,
                  help="if > 0: exit with status 3 (results saved) when nothing progresses for this many seconds "
                       "(a hung kernel)")
  ap.add_argument("--bf16-candidate", default="",
                  help='JSON kwargs of a bf16 kernel variant timed next to the default in `grid`, e.g. '
                       '\'{"block_kv": 64, "stages": 2, "split_policy": "waves"}\'')
  ap.add_argument("--fp8-variants", default="",
                  help="JSON list of fp8 kwargs for `fp8var` (default: run C's list)")
  ap.add_argument("--grid-groups", default="",
                  help="GQA groups of the `grid` section, e.g. 4,8 (default: the profile's)")
  ap.add_argument("--profile", default="full", choices=("full", "final", "r3"),
                  help="final: the reduced matrices of run B; r3: run C (fp8 kernel variants, small-batch "
                       "variants, Triton/sparse/prefill, then the bf16 + fp8 grid), fits the device budget")
  args = ap.parse_args()
  if args.sections is None:
    args.sections = "ceiling,wide" if args.wide_pages else "ceiling,correctness,decode,fp8,sparse,triton,tuning,prefill"
  sections = args.sections.split(",")
  t_start = time.time()
  res = {"sections_done": [], "skipped": []}

  progress = [time.time()]

  def save():
    progress[0] = time.time()
    write_json(args.out, res)

  if args.watchdog > 0:
    import threading

    def watchdog():
      while True:
        time.sleep(2)
        if time.time() - progress[0] > args.watchdog:
          res["watchdog"] = f"no progress for {args.watchdog:.0f} s; exiting"
          save()
          print("WATCHDOG: no progress, exiting with status 3", flush=True)
          os._exit(3)
    threading.Thread(target=watchdog, daemon=True).start()

  if "ceiling" in sections and not args.smoke:
    res["ceiling"] = torch_copy_ceiling()  # before JAX grabs the GPU memory
    save()

  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.paged_attention import gpu, reference, sparse, tuning

  smoke = args.smoke
  impl_interp = smoke
  res["meta"] = {"jax": jax.__version__, "device": str(jax.devices()[0]), "smoke": smoke,
                 "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "core_count": getattr(jax.devices()[0], "core_count", None)}
  try:
    res["meta"]["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
  except Exception:  # noqa: BLE001
    pass

  # ---------------------------------------------------------------- timing
  def timeit(f, *a, iters=5):
    """Median kernel time in ms (CUPTI sum over the call's kernels; wall clock on CPU)."""
    if not smoke:
      try:
        from jax.experimental.mosaic.gpu import profiler
        _, ts = profiler.measure(f, iterations=iters)(*a)
        if ts:
          return float(statistics.median(ts))
      except Exception as e:  # noqa: BLE001
        res.setdefault("timing_fallbacks", []).append(repr(e)[:200])
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(iters if not smoke else 2):
      t = time.perf_counter()
      jax.block_until_ready(f(*a))
      ts.append((time.perf_counter() - t) * 1e3)
    return float(statistics.median(ts))

  def over_time():
    return time.time() - t_start > args.time_limit

  def section(name):
    if name not in sections:
      return False
    if over_time():
      res["skipped"].append(name)
      save()
      return False
    print(f"== {name} ({time.time() - t_start:.0f}s)", flush=True)
    progress[0] = time.time()
    res.setdefault("section_start_s", {})[name] = round(time.time() - t_start, 1)
    return True

  def done(name):
    res["sections_done"].append(name)
    save()

  def vs_reference(row, S, L, fr, f, a, more=None):
    """Where S * L is at most 256K and the kernel timed: row's ref_ms, speedup_vs_ref and max_err_vs_ref of
    reference `fr` against kernel `f` on arguments `a`, then ``more(ref_out)`` (the reference output, float32);
    a failure is row's ref_error."""
    if not (S * L <= 256 * 1024 and "ms" in row):
      return
    try:
      row["ref_ms"] = timeit(fr, *a, iters=3)
      row["speedup_vs_ref"] = row["ref_ms"] / row["ms"]
      ref_out = f32(fr(*a))
      row["max_err_vs_ref"] = float(np.max(np.abs(f32(f(*a)) - ref_out)))
      if more is not None:
        more(ref_out)
    except Exception as e:  # noqa: BLE001
      row["ref_error"] = repr(e)[:300]

  def add_row(name, row, rounded=False):
    """Append `row` to ``res[name]``, print it (floats to 4 places when `rounded`) and save."""
    res.setdefault(name, []).append(row)
    print("  ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()} if rounded else row,
          flush=True)
    save()

  f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))

  # ---------------------------------------------------------------- ceiling (JAX side)
  if section("ceiling"):
    n = (64 if smoke else 2048) * 1024 * 1024
    x = jnp.ones((n // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    ms = timeit(copy, x)
    res.setdefault("ceiling", {})["jax_elementwise_TBps"] = 2 * n / (ms * 1e-3) / 1e12
    del x
    done("ceiling")
  ceiling = res.get("ceiling", {}).get("torch_copy_TBps") or res.get("ceiling", {}).get("jax_elementwise_TBps")

  rng = np.random.default_rng(0)

  def rand_problem(S, K, g, H, G, Pmax, dtype=jnp.bfloat16, lens=None, P=None):
    P = P or S * Pmax + 3
    q = jnp.asarray(rng.standard_normal((S, K * g, H)), jnp.bfloat16)
    kv = rng.standard_normal((P, G, 2 * K, H)).astype(np.float32)
    sc = None
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
      sc = jnp.asarray(rng.uniform(0.005, 0.02, (P, 2 * K)), jnp.float32)
      kv = jnp.asarray(kv / np.asarray(sc)[:, None, :, None] / 4).astype(dtype)
    else:
      kv = jnp.asarray(kv, dtype)
    bt = jnp.asarray(rng.permutation(P)[: S * Pmax].reshape(S, Pmax), jnp.int32)
    if lens is None:
      lens = rng.integers(1, Pmax * G + 1, S)
    return q, kv, bt, jnp.asarray(lens, jnp.int32), sc

  # ---------------------------------------------------------------- correctness
  ws_rows = []

  def record(name, out, ref, rows=ws_rows):
    o, r = f32(out), f32(ref)
    err = float(np.max(np.abs(o - r))) if o.size else 0.0
    row = {"case": name, "max_abs_err": err, "nan": int(np.isnan(o).sum()), "ok": bool(err < 3e-2 and
                                                                                       not np.isnan(o).any())}
    rows.append(row)
    progress[0] = time.time()
    print(f"  {name:48s} err {err:.2e} {'OK' if row['ok'] else 'FAIL'}", flush=True)

  if section("correctness"):
    rows = []
    record = functools.partial(record, rows=rows)  # noqa: F811 - this section's rows

    dec_cases = [
        ("decode g4 G16 H128", dict(S=5, K=8, g=4, H=128, G=16, Pmax=40), {}),
        ("decode g8 G16 H128 window+cap", dict(S=3, K=8, g=8, H=128, G=16, Pmax=40), dict(sliding_window=100,
                                                                                         soft_cap=20.0)),
        ("decode g4 G64 H128 splits=3", dict(S=3, K=4, g=4, H=128, G=64, Pmax=12), dict(splits=3)),
        ("decode g4 G256 H128", dict(S=2, K=2, g=4, H=128, G=256, Pmax=4), {}),
        ("decode g3 K3 G16 H64 (N=9)", dict(S=4, K=3, g=3, H=64, G=16, Pmax=20), {}),
        ("decode g1 G32 H128", dict(S=3, K=8, g=1, H=128, G=32, Pmax=16), {}),
    ]
    if args.profile == "final":
      dec_cases = [dec_cases[0], dec_cases[1], dec_cases[3]]
    if args.profile == "r3":
      dec_cases = [dec_cases[0], dec_cases[1],
                   ("decode g4 G16 H128 split_policy=waves", dict(S=5, K=8, g=4, H=128, G=16, Pmax=40),
                    dict(split_policy="waves"))]
    for name, shp, kw in dec_cases:
      q, kv, bt, lens, sc = rand_problem(**shp)
      lens = lens.at[0].set(0)
      out = gpu.paged_decode_attention_gpu(q, kv, bt, lens, interpret=impl_interp, **kw)
      kw.pop("splits", None)
      kw.pop("split_policy", None)
      record(name, out, reference.paged_decode_attention_reference(q, kv, bt, lens, **kw))
    fp8_cases = [(jnp.float8_e4m3fn, {}, {}), (jnp.float8_e5m2, {}, {})]
    if args.profile == "r3":
      fp8_cases = [(jnp.float8_e4m3fn, dict(fp8_converters=0), {})]
    for dt, kk, semantics in fp8_cases:
      q, kv, bt, lens, sc = rand_problem(S=4, K=8, g=4, H=128, G=16, Pmax=40, dtype=dt)
      out = gpu.paged_decode_attention_gpu(q, kv, bt, lens, kv_scales_PK=sc, interpret=impl_interp, **kk, **semantics)
      record(f"decode fp8 {jnp.dtype(dt).name} {kk} {semantics}", out,
             reference.paged_decode_attention_reference(q, kv, bt, lens, kv_scales_PK=sc, **semantics))
    # ragged prefill / mixed
    rag_cases = [("ragged bf16 g4", jnp.bfloat16, {}), ("ragged bf16 g8 window", jnp.bfloat16,
                                                        dict(sliding_window=50)),
                 ("ragged fp8 e4m3 g4", jnp.float8_e4m3fn, {})]
    if args.profile == "r3":
      rag_cases = [("ragged bf16 g3 window (padded rows)", jnp.bfloat16, dict(sliding_window=50)), rag_cases[2]]
    for name, dt, kw in rag_cases:
      g = 8 if "g8" in name else (3 if "g3" in name else 4)
      q_lens = np.array([37, 0, 1, 130, 5])
      extra = np.array([10, 0, 200, 0, 60])
      G, Pmax = 16, 24
      _, kv, bt, _, sc = rand_problem(S=5, K=4, g=g, H=128, G=G, Pmax=Pmax, dtype=dt)
      lens = jnp.asarray(np.minimum(q_lens + extra, Pmax * G), jnp.int32)
      cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
      T = int(cu[-1]) + 7
      qT = jnp.asarray(rng.standard_normal((T, 4 * g, 128)), jnp.bfloat16)
      out = gpu.paged_attention_gpu(qT, kv, bt, lens, cu, kv_scales_PK=sc, interpret=impl_interp, **kw)
      record(name, out, reference.paged_attention_reference(qT, kv, bt, lens, cu, kv_scales_PK=sc, **kw))
    # sparse
    for dt in ((jnp.float8_e4m3fn,) if args.profile == "r3" else (jnp.bfloat16, jnp.float8_e4m3fn)):
      q, kv, bt, lens, sc = rand_problem(S=3, K=4, g=4, H=128, G=16, Pmax=40, dtype=dt, lens=[600, 37, 400])
      kmin = jnp.asarray(rng.standard_normal((kv.shape[0], 4, 128)), jnp.float32)
      kmax = kmin + 1.0
      out, (phys, logical, count) = sparse.paged_sparse_decode_attention(
          q, kv, bt, lens, kmin, kmax, num_sink_pages=1, num_window_pages=2, top_k_pages=5, kv_scales_PK=sc,
          impl="gpu_interpret" if smoke else "gpu", return_selection=True)
      record(f"sparse {jnp.dtype(dt).name} converters={tuning.current().fp8_converters}", out,
             sparse.sparse_decode_attention_reference(q, kv, bt, lens, logical, kv_scales_PK=sc))
    res["correctness"] = rows
    done("correctness")

  # ---------------------------------------------------------------- decode matrix
  K, H, G = 8, 128, 16
  if smoke:
    batches, contexts, groups = (1, 2), (128, 256), (4,)
  elif args.profile in ("final", "r3"):
    batches, contexts, groups = (1, 8, 32, 128), (1024, 8192, 32768), (4,)
  else:
    batches, contexts, groups = (1, 8, 32, 128), (1024, 8192, 32768), (4, 8)
  max_tokens = max(batches) * max(contexts)
  P_total = max_tokens // G + 64
  small = jnp.asarray(rng.standard_normal((64, G, 2 * K, H)), jnp.bfloat16)
  pool = None

  def get_pool():
    nonlocal pool
    if pool is None:
      pool = jax.jit(lambda s: jnp.tile(s, (P_total // 64 + 1, 1, 1, 1))[:P_total])(small)
    return pool

  perm = jnp.asarray(rng.permutation(P_total), jnp.int32)

  def decode_inputs(S, L, g):
    Pmax = L // G
    bt = perm[: S * Pmax].reshape(S, Pmax)
    lens = jnp.full((S,), L, jnp.int32)
    q = jnp.asarray(rng.standard_normal((S, K * g, H)), jnp.bfloat16)
    return q, bt, lens

  def decode_grid():
    """(S, L, g, q, bt, lens) for each g of groups, L of contexts and S of batches; past the time limit, the rest of
    that row of batches is skipped."""
    for g in groups:
      for L in contexts:
        for S in batches:
          if over_time():
            break
          yield (S, L, g) + decode_inputs(S, L, g)

  def kv_bytes(S, L, itemsize):
    return S * L * K * 2 * H * itemsize

  pool8 = None

  def get_pool8():
    """fp8 e4m3 pool of the same geometry (stored values ~ 50 x N(0, 1), clipped to the e4m3 range; scales 0.02)."""
    nonlocal pool8
    if pool8 is None:
      pool8 = jax.jit(lambda s: jnp.tile(jnp.clip(s.astype(jnp.float32) * 50, -440, 440).astype(jnp.float8_e4m3fn),
                                         (P_total // 64 + 1, 1, 1, 1))[:P_total])(small)
    return pool8

  def f8_kernel(**kw):
    return jax.jit(lambda q, kv, bt, lens, sc: gpu.paged_decode_attention_gpu(
        q, kv, bt, lens, kv_scales_PK=sc, interpret=impl_interp, **kw))

  def bf_kernel(**kw):
    return jax.jit(lambda q, kv, bt, lens: gpu.paged_decode_attention_gpu(q, kv, bt, lens, interpret=impl_interp, **kw))

  fp8_best = {}  # kwargs of the fastest fp8 variant (fp8var), used by grid

  def dequantized_q(q):
    """The q an fp8-QK kernel (fp8_qk=True) actually uses: its per-row e4m3 quantization, in f32."""
    q8, s_q = gpu.quantize_q_rows(q)
    return q8.astype(jnp.float32) * s_q[..., None]

  if section("fp8var"):
    kv, kv8 = get_pool(), get_pool8()
    sc = jnp.full((P_total, 2 * K), 0.02, jnp.float32)
    if args.profile == "r3":
      # Correctness of the warp-specialized kernel first (random small problems vs the reference).
      ws_cases = [(jnp.float8_e4m3fn, dict(fp8_converters=1), {}),
                  (jnp.float8_e4m3fn, dict(fp8_converters=2, split_policy="waves"), {}),
                  (jnp.float8_e4m3fn, dict(fp8_converters=3, splits=1), dict(sliding_window=300, soft_cap=20.0)),
                  (jnp.float8_e5m2, dict(fp8_converters=2, block_kv=128, stages=2), {}),
                  (jnp.float8_e4m3fn, dict(fp8_converters=1, fp8_compute_wgs=2), dict(sliding_window=300)),
                  (jnp.float8_e5m2, dict(fp8_converters=1, fp8_compute_wgs=2, block_kv=128, stages=2, splits=1), {}),
                  # fp8 QK^T (q quantized per row to e4m3): compared with the reference at the quantized q
                  (jnp.float8_e4m3fn, dict(fp8_converters=0, fp8_qk=True), dict(sliding_window=300, soft_cap=20.0)),
                  (jnp.float8_e5m2, dict(fp8_converters=0, fp8_qk=True, block_kv=128, stages=2, splits=1), {}),
                  (jnp.float8_e4m3fn, dict(fp8_converters=1, fp8_qk=True), {}),
                  (jnp.float8_e5m2, dict(fp8_converters=2, fp8_qk=True, block_kv=64, stages=8, splits=1),
                   dict(soft_cap=20.0))]
      if args.fp8_variants:  # run D: the integer-op widening
        ws_cases = [(jnp.float8_e4m3fn, dict(fp8_converters=1, block_kv=128, stages=2, fp8_convert="bits"), {}),
                    (jnp.float8_e4m3fn, dict(fp8_converters=2, fp8_convert="bits", splits=1),
                     dict(sliding_window=300, soft_cap=20.0)),
                    (jnp.float8_e5m2, dict(fp8_converters=1, fp8_convert="bits", split_policy="waves"), {})]
      for dt, kk, semantics in ws_cases:
        qq, kvv, btt, lns, scc = rand_problem(S=4, K=8, g=4, H=128, G=16, Pmax=40, dtype=dt)
        out = gpu.paged_decode_attention_gpu(qq, kvv, btt, lns, kv_scales_PK=scc, interpret=impl_interp, **kk,
                                             **semantics)
        if kk.get("fp8_qk"):
          record(f"decode fp8 {jnp.dtype(dt).name} {kk} {semantics} vs ref(q) [q8 rounding]", out,
                 reference.paged_decode_attention_reference(qq, kvv, btt, lns, kv_scales_PK=scc, **semantics),
                 rows=ws_rows)
          qq = dequantized_q(qq)
        record(f"decode fp8 {jnp.dtype(dt).name} {kk} {semantics}", out,
               reference.paged_decode_attention_reference(qq, kvv, btt, lns, kv_scales_PK=scc, **semantics),
               rows=ws_rows)
      qq, kvv, btt, lns, scc = rand_problem(S=3, K=4, g=4, H=128, G=16, Pmax=40, dtype=jnp.float8_e4m3fn,
                                            lens=[600, 37, 400])
      kmin = jnp.asarray(rng.standard_normal((kvv.shape[0], 4, 128)), jnp.float32)
      with tuning.override(fp8_converters=2, fp8_convert="bits" if args.fp8_variants else "cvt"):  # sparse: the row
        out, (_, logical, _) = sparse.paged_sparse_decode_attention(
            qq, kvv, btt, lns, kmin, kmin + 1.0, num_sink_pages=1, num_window_pages=2, top_k_pages=5,
            kv_scales_PK=scc, impl="gpu_interpret" if smoke else "gpu", return_selection=True)
      record(f"sparse float8_e4m3fn converters=2 {'bits' if args.fp8_variants else 'cvt'}", out,
             sparse.sparse_decode_attention_reference(qq, kvv, btt, lns, logical, kv_scales_PK=scc), rows=ws_rows)
      res["correctness_ws"] = ws_rows
      save()
    S, L, g = (8, contexts[1], 4) if not smoke else (2, contexts[-1], 4)
    q, bt, lens = decode_inputs(S, L, g)
    bf16_ms = timeit(bf_kernel(), q, kv, bt, lens)
    fref8 = jax.jit(lambda q, kv, bt, lens, sc: reference.paged_decode_attention_reference(
        q, kv, bt, lens, kv_scales_PK=sc))
    ref8 = f32(fref8(q, kv8, bt, lens, sc))
    ref8_q8 = f32(fref8(dequantized_q(q), kv8, bt, lens, sc))
    res["fp8var_ref_q8_vs_ref_max_abs"] = float(np.max(np.abs(ref8_q8 - ref8)))  # the q rounding's own effect
    # Default list: the current default, the inline kernel, and the not-yet-measured two-compute-warpgroup and
    # fp8-QK (fp8_qk=True) variants (run C's list and run D's are in their JSON files; pass them with
    # --fp8-variants to repeat them). fp8_qk rows are also checked against the reference at the quantized q.
    variants = [dict(), dict(fp8_converters=0),
                dict(fp8_converters=1, fp8_compute_wgs=2),
                dict(fp8_converters=1, fp8_compute_wgs=2, block_kv=128, stages=2),
                dict(fp8_converters=1, fp8_compute_wgs=2, stages=4),
                # fp8 QK^T wgmma (q per-row e4m3), only V widened: inline (one warpgroup) and warp-specialized
                dict(fp8_converters=0, fp8_qk=True),
                dict(fp8_converters=0, fp8_qk=True, block_kv=64, stages=4),
                dict(fp8_converters=0, fp8_qk=True, block_kv=128, stages=2),
                dict(fp8_converters=0, fp8_qk=True, block_kv=128, stages=3),
                dict(fp8_converters=1, fp8_qk=True),
                dict(fp8_converters=1, fp8_qk=True, block_kv=64, stages=6),
                dict(fp8_converters=2, fp8_qk=True, block_kv=64, stages=8),
                dict(fp8_converters=1, fp8_qk=True, fp8_compute_wgs=2)]
    if args.fp8_variants:
      variants = json.loads(args.fp8_variants)
    if smoke:
      variants = variants[:2]
    best = None
    for kw in variants:
      if over_time():
        break
      row = {"S": S, "L": L, "g": g, "variant": kw, "bf16_ms": bf16_ms}
      try:
        fk = f8_kernel(**kw)
        row["fp8_ms"] = timeit(fk, q, kv8, bt, lens, sc)
        row["fp8_over_bf16"] = row["fp8_ms"] / bf16_ms
        row["fp8_TBps"] = kv_bytes(S, L, 1) / (row["fp8_ms"] * 1e-3) / 1e12
        out8 = f32(fk(q, kv8, bt, lens, sc))
        row["max_err_vs_ref"] = float(np.max(np.abs(out8 - ref8)))
        if kw.get("fp8_qk"):  # the exact check: the reference at the kernel's quantized q
          row["max_err_vs_ref_q8"] = float(np.max(np.abs(out8 - ref8_q8)))
        if not row["max_err_vs_ref"] < 3e-2 or not row.get("max_err_vs_ref_q8", 0.0) < 3e-2:  # NaN too
          row["rejected"] = "error vs the fp8-aware reference"
        elif best is None or row["fp8_ms"] < best[0]:
          best = (row["fp8_ms"], kw)
      except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
      add_row("fp8var", row)
    if best is not None:
      fp8_best.update(best[1])
      res["fp8_best"] = dict(best[1])
    done("fp8var")

  if section("small"):
    kv = get_pool()
    configs = [(8, 1024, 4), (32, 1024, 4), (64, 1024, 4), (1, 8192, 4)] if not smoke else [(2, 256, 4)]
    variants = [dict(), dict(split_policy="waves"), dict(block_kv=64, stages=2, split_policy="waves"),
                dict(block_kv=64, stages=3, split_policy="waves"), dict(block_kv=64, stages=4)]
    if smoke:
      variants = variants[:2]
    for S, L, g in configs:
      q, bt, lens = decode_inputs(S, L, g)
      for kw in variants:
        if over_time():
          break
        row = {"S": S, "L": L, "g": g, "variant": kw}
        try:
          row["ms"] = timeit(bf_kernel(**kw), q, kv, bt, lens)
          row["TBps"] = kv_bytes(S, L, 2) / (row["ms"] * 1e-3) / 1e12
          if ceiling:
            row["pct_ceiling"] = 100 * row["TBps"] / ceiling
        except Exception as e:  # noqa: BLE001
          row["error"] = repr(e)[:300]
        add_row("small", row)
    done("small")

  if section("decode"):
    kv = get_pool()
    for S, L, g, q, bt, lens in decode_grid():
      f = jax.jit(lambda q, kv, bt, lens: gpu.paged_decode_attention_gpu(q, kv, bt, lens, interpret=impl_interp))
      row = {"S": S, "L": L, "g": g}
      try:
        row["ms"] = timeit(f, q, kv, bt, lens)
        row["TBps"] = kv_bytes(S, L, 2) / (row["ms"] * 1e-3) / 1e12
        if ceiling:
          row["pct_ceiling"] = 100 * row["TBps"] / ceiling
      except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
      fr = jax.jit(lambda q, kv, bt, lens: reference.paged_decode_attention_reference(q, kv, bt, lens))
      vs_reference(row, S, L, fr, f, (q, kv, bt, lens))
      add_row("decode", row, rounded=True)
    done("decode")

  # ---------------------------------------------------------------- fp8
  if section("fp8"):
    kv_bf16 = get_pool()
    sc = jnp.full((P_total, 2 * K), 0.01, jnp.float32)
    cases = [(min(8, batches[-1]), contexts[1], groups[-1]), (batches[-1], contexts[-1], groups[-1]),
             (1, contexts[-1], groups[0])]
    variants = [(None, None)] if smoke else [(None, None), (64, 4), (128, 2)]
    for dt in (jnp.float8_e4m3fn, jnp.float8_e5m2):
      kv8 = jax.jit(lambda s: jnp.tile((s * 100).astype(dt), (P_total // 64 + 1, 1, 1, 1))[:P_total])(small)
      for S, L, g in cases:
        if dt == jnp.float8_e5m2 and S != cases[1][0]:
          continue
        q, bt, lens = decode_inputs(S, L, g)
        fb = jax.jit(lambda q, kv, bt, lens: gpu.paged_decode_attention_gpu(q, kv, bt, lens, interpret=impl_interp))
        try:
          bf16_ms = timeit(fb, q, kv_bf16, bt, lens)
        except Exception as e:  # noqa: BLE001
          bf16_ms = None
          res.setdefault("fp8_errors", []).append(repr(e)[:300])
        for bk, st in (variants if (S, L, g) == cases[1] and dt == jnp.float8_e4m3fn else variants[:1]):
          if over_time():
            break
          f8 = jax.jit(lambda q, kv, bt, lens, sc: gpu.paged_decode_attention_gpu(
              q, kv, bt, lens, kv_scales_PK=sc, block_kv=bk, stages=st, interpret=impl_interp))
          row = {"dtype": jnp.dtype(dt).name, "S": S, "L": L, "g": g, "block_kv": bk, "stages": st, "bf16_ms": bf16_ms}
          try:
            row["fp8_ms"] = timeit(f8, q, kv8, bt, lens, sc)
            row["fp8_TBps"] = kv_bytes(S, L, 1) / (row["fp8_ms"] * 1e-3) / 1e12
            if bf16_ms:
              row["fp8_over_bf16"] = row["fp8_ms"] / bf16_ms
          except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:300]
          add_row("fp8", row)
      del kv8
    done("fp8")

  # ---------------------------------------------------------------- sparse
  if section("sparse"):
    kv = get_pool()
    L = contexts[-1]
    npages = L // G
    kmin = jax.jit(lambda: jnp.tile(jnp.asarray(rng.standard_normal((64, K, H)), jnp.bfloat16),
                                    (P_total // 64 + 1, 1, 1))[:P_total])()
    kmax = kmin + 1
    sel = dict(num_sink_pages=2, num_window_pages=8, top_k_pages=max(1, npages // 10 - 10))
    for S, g in ((1, 8), (32 if not smoke else 2, 8), (32 if not smoke else 2, 4)):
      if over_time():
        break
      q, bt, lens = decode_inputs(S, L, g)
      impl = "gpu_interpret" if smoke else "gpu"
      fs = jax.jit(lambda q, kv, bt, lens, a, b: sparse.paged_sparse_decode_attention(q, kv, bt, lens, a, b,
                                                                                      impl=impl, **sel))
      fsel = jax.jit(lambda q, a, b, bt, lens: sparse.select_pages(q, a, b, bt, lens, page_size=G, **sel))
      fd = jax.jit(lambda q, kv, bt, lens: gpu.paged_decode_attention_gpu(q, kv, bt, lens, interpret=impl_interp))
      row = {"S": S, "L": L, "g": g, "pages": npages, "selected": sparse.budget(**sel, table_cols=npages)}
      try:
        row["sparse_ms"] = timeit(fs, q, kv, bt, lens, kmin, kmax)
        row["select_ms"] = timeit(fsel, q, kmin, kmax, bt, lens)
        row["dense_ms"] = timeit(fd, q, kv, bt, lens)
        row["sparse_over_dense"] = row["sparse_ms"] / row["dense_ms"]
      except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
      add_row("sparse", row)
    done("sparse")

  # ---------------------------------------------------------------- Triton (deprecated JAX op)
  if section("triton") and not smoke:
    try:
      import warnings
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as triton_pa
      kv = get_pool()
      k_pages = jnp.transpose(kv[:, :, 0::2], (2, 0, 1, 3))  # [K, P, G, H]
      v_pages = jnp.transpose(kv[:, :, 1::2], (2, 0, 1, 3))
      configs = [(S, L, g) for g in groups for L in contexts for S in batches]
      if args.profile == "final":
        configs = [(S, 8192, 4) for S in batches]
      elif args.profile == "r3":
        configs = [(S, 8192, 4) for S in (8, 32, 128)]
      for S, L, g in configs:
        if over_time():
          break
        q, bt, lens = decode_inputs(S, L, g)
        ft = jax.jit(lambda q, kp, vp, bt, lens: triton_pa((q * (1.0 / np.sqrt(H))).astype(q.dtype), kp, vp, bt,
                                                           lens))
        fk = jax.jit(lambda q, kv, bt, lens: gpu.paged_decode_attention_gpu(q, kv, bt, lens))
        row = {"S": S, "L": L, "g": g}
        try:
          row["ms"] = timeit(fk, q, kv, bt, lens)
          row["triton_ms"] = timeit(ft, q, k_pages, v_pages, bt, lens)
          row["speedup_vs_triton"] = row["triton_ms"] / row["ms"]
          row["max_diff_vs_triton"] = float(np.max(np.abs(f32(fk(q, kv, bt, lens)) -
                                                          f32(ft(q, k_pages, v_pages, bt, lens)))))
        except Exception as e:  # noqa: BLE001
          row["error"] = repr(e)[:300]
        add_row("triton", row)
      del k_pages, v_pages
    except Exception as e:  # noqa: BLE001
      res["triton_error"] = repr(e)[:500]
    done("triton")

  # ---------------------------------------------------------------- tuning
  if section("tuning"):
    kv = get_pool()
    variants = [(64, 3), (64, 4), (64, 6), (128, 2), (128, 3)] if not smoke else [(64, 2)]
    probes = [(32 if not smoke else 2, contexts[1], 4), (1, contexts[-1], 8)]
    for S, L, g in probes:
      q, bt, lens = decode_inputs(S, L, g)
      for bk, st in variants:
        for splits in ((None,) if S > 1 else (None, 64, 128)):
          if over_time():
            break
          f = jax.jit(lambda q, kv, bt, lens: gpu.paged_decode_attention_gpu(q, kv, bt, lens, block_kv=bk, stages=st,
                                                                             splits=splits, interpret=impl_interp))
          row = {"S": S, "L": L, "g": g, "block_kv": bk, "stages": st, "splits": splits}
          try:
            row["ms"] = timeit(f, q, kv, bt, lens)
            row["TBps"] = kv_bytes(S, L, 2) / (row["ms"] * 1e-3) / 1e12
          except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:200]
          add_row("tuning", row)
    done("tuning")

  # ---------------------------------------------------------------- prefill
  if section("prefill"):
    for S, ql, g in ((4, 2048 if not smoke else 64, 4), (1, 8192 if not smoke else 64, 8)):
      if over_time():
        break
      Pmax = ql // G
      P = S * Pmax + 4
      kvp = jnp.asarray(rng.standard_normal((P, G, 2 * K, H)), jnp.bfloat16)
      bt = jnp.asarray(rng.permutation(P)[: S * Pmax].reshape(S, Pmax), jnp.int32)
      lens = jnp.full((S,), ql, jnp.int32)
      cu = jnp.arange(S + 1, dtype=jnp.int32) * ql
      qT = jnp.asarray(rng.standard_normal((S * ql, K * g, H)), jnp.bfloat16)
      fk = jax.jit(lambda *a: gpu.paged_attention_gpu(*a, interpret=impl_interp))
      fr = jax.jit(lambda *a: reference.paged_attention_reference(*a))
      row = {"S": S, "q_len": ql, "g": g}
      try:
        row["ms"] = timeit(fk, qT, kvp, bt, lens, cu)
        flops = 4 * S * (ql * (ql + 1) / 2) * K * g * H
        row["TFLOPs"] = flops / (row["ms"] * 1e-3) / 1e12
        if S * ql * K * g * ql <= 2**30:  # the reference materializes f32 logits [T, N, L]
          row["ref_ms"] = timeit(fr, qT, kvp, bt, lens, cu, iters=2)
          row["speedup_vs_ref"] = row["ref_ms"] / row["ms"]
          row["max_err_vs_ref"] = float(np.max(np.abs(f32(fk(qT, kvp, bt, lens, cu)) -
                                                      f32(fr(qT, kvp, bt, lens, cu)))))
      except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
      add_row("prefill", row)
    # Mixed batch: a few prefill chunks next to many decode rows (what a continuous-batching step looks like).
    if not over_time():
      n_pre, n_dec = (4, 60) if not smoke else (1, 3)
      ql, ctx = (512, 2048) if not smoke else (32, 64)
      q_lens = np.array([ql] * n_pre + [1] * n_dec)
      kv_lens = np.array([ql + ctx] * n_pre + [ctx] * n_dec)
      S = n_pre + n_dec
      Pmax = int(kv_lens.max()) // G + 1
      P = S * Pmax + 4
      kvp = jnp.asarray(rng.standard_normal((P, G, 2 * K, H)), jnp.bfloat16)
      bt = jnp.asarray(rng.permutation(P)[: S * Pmax].reshape(S, Pmax), jnp.int32)
      lens = jnp.asarray(kv_lens, jnp.int32)
      cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
      g = 4
      qT = jnp.asarray(rng.standard_normal((int(cu[-1]), K * g, H)), jnp.bfloat16)
      fk = jax.jit(lambda *a: gpu.paged_attention_gpu(*a, interpret=impl_interp))
      fr = jax.jit(lambda *a: reference.paged_attention_reference(*a))
      row = {"mixed": f"{n_pre} x prefill {ql} (+{ctx} cached) + {n_dec} x decode at {ctx}", "g": g}
      try:
        row["ms"] = timeit(fk, qT, kvp, bt, lens, cu)
        row["ref_ms"] = timeit(fr, qT, kvp, bt, lens, cu, iters=2)
        row["speedup_vs_ref"] = row["ref_ms"] / row["ms"]
        row["max_err_vs_ref"] = float(np.max(np.abs(f32(fk(qT, kvp, bt, lens, cu)) - f32(fr(qT, kvp, bt, lens, cu)))))
      except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
      add_row("prefill", row)
    done("prefill")

  # ---------------------------------------------------------------- grid: bf16 and fp8 over batch x context
  if section("grid"):
    if args.grid_groups:
      groups = tuple(int(x) for x in args.grid_groups.split(","))
    kv, kv8 = get_pool(), get_pool8()
    sc = jnp.full((P_total, 2 * K), 0.01, jnp.float32)
    fb, f8 = bf_kernel(), f8_kernel(**fp8_best)
    cand = json.loads(args.bf16_candidate) if args.bf16_candidate else None
    fc = bf_kernel(**cand) if cand else None
    sc = jnp.full((P_total, 2 * K), 0.02, jnp.float32)
    fr = jax.jit(lambda q, kv, bt, lens: reference.paged_decode_attention_reference(q, kv, bt, lens))
    fr8 = jax.jit(lambda q, kv, bt, lens, sc: reference.paged_decode_attention_reference(q, kv, bt, lens,
                                                                                         kv_scales_PK=sc))
    for S, L, g, q, bt, lens in decode_grid():
      row = {"S": S, "L": L, "g": g, "fp8_variant": dict(fp8_best)}
      try:
        row["ms"] = timeit(fb, q, kv, bt, lens)
        row["TBps"] = kv_bytes(S, L, 2) / (row["ms"] * 1e-3) / 1e12
        if ceiling:
          row["pct_ceiling"] = 100 * row["TBps"] / ceiling
        if fc is not None:
          row["cand"] = cand
          row["cand_ms"] = timeit(fc, q, kv, bt, lens)
          row["cand_TBps"] = kv_bytes(S, L, 2) / (row["cand_ms"] * 1e-3) / 1e12
          if ceiling:
            row["cand_pct_ceiling"] = 100 * row["cand_TBps"] / ceiling
        row["fp8_ms"] = timeit(f8, q, kv8, bt, lens, sc)
        row["fp8_over_bf16"] = row["fp8_ms"] / row["ms"]
        row["fp8_TBps"] = kv_bytes(S, L, 1) / (row["fp8_ms"] * 1e-3) / 1e12
      except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]

      def more_errors(ref_out):
        if fc is not None:
          row["cand_max_err_vs_ref"] = float(np.max(np.abs(f32(fc(q, kv, bt, lens)) - ref_out)))
        if "fp8_ms" in row:
          out8 = f32(f8(q, kv8, bt, lens, sc))
          row["fp8_max_err_vs_ref"] = float(np.max(np.abs(out8 - f32(fr8(q, kv8, bt, lens, sc)))))
          if fp8_best.get("fp8_qk", tuning.current().fp8_qk):
            row["fp8_max_err_vs_ref_q8"] = float(np.max(np.abs(out8 - f32(fr8(dequantized_q(q), kv8, bt, lens,
                                                                              sc)))))
      vs_reference(row, S, L, fr, fb, (q, kv, bt, lens), more_errors)
      add_row("grid", row, rounded=True)
    done("grid")

  # ---------------------------------------------------------------- wide: the cost of padded tables / slots
  if section("wide"):
    Nw = args.wide_pages or (64 if smoke else 8192)
    M = args.wide_slots if not smoke else 3
    if smoke:
      configs = [(1, 64)]
    else:
      configs = [(1, 8192), (8, 1024), (8, 8192), (32, 1024), (64, 8192), (128, 2048)]
    Kw, Hw, Gw, gw = 8, 128, 16, 4
    need = max(S * L // Gw for S, L in configs)
    Pw = need + 64
    base = jnp.asarray(rng.standard_normal((64, Gw, 2 * Kw, Hw)), jnp.bfloat16)
    poolw = jax.jit(lambda b: jnp.tile(b, (Pw // 64 + 1, 1, 1, 1))[:Pw])(base)
    poolw8 = jax.jit(lambda b: jnp.tile(jnp.clip(b.astype(jnp.float32) * 50, -440, 440).astype(jnp.float8_e4m3fn),
                                        (Pw // 64 + 1, 1, 1, 1))[:Pw])(base)
    scw = jnp.full((Pw, 2 * Kw), 0.02, jnp.float32)
    permw = jnp.asarray(rng.permutation(Pw), jnp.int32)

    def dec_fn(fp8, **kw):
      if fp8:
        return jax.jit(lambda q, kv, bt, lens, sc: gpu.paged_decode_attention_gpu(
            q, kv, bt, lens, kv_scales_PK=sc, interpret=impl_interp, **kw))
      return jax.jit(lambda q, kv, bt, lens: gpu.paged_decode_attention_gpu(q, kv, bt, lens, interpret=impl_interp,
                                                                            **kw))

    def wide_table(bt_tight, slots):
      """The tight table's rows padded to Nw entries (extra entries: valid page ids, never read), plus kv_len-0
      slots whose rows are random valid pages."""
      S, Pt = bt_tight.shape
      filler = jnp.asarray(rng.integers(0, Pw, (slots, Nw)), jnp.int32)
      return filler.at[:S, :Pt].set(bt_tight)

    for S, L in configs:
      Pt = L // Gw
      bt = permw[: S * Pt].reshape(S, Pt)
      lens = jnp.full((S,), L, jnp.int32)
      q = jnp.asarray(rng.standard_normal((S, Kw * gw, Hw)), jnp.bfloat16)
      Mx = max(M, 2 * S)
      variants = [("tight", S, Pt, {}), (f"P={Nw}", S, Nw, {}), (f"P={Nw} slots={2 * S}", 2 * S, Nw, {})]
      if M > 2 * S:
        variants.append((f"P={Nw} slots={M}", M, Nw, {}))
      # A/B: the opt-in run-time work list (split count from the real lengths), and the static length hint
      variants += [(f"P={Nw} slots={Mx} work_list", Mx, Nw, dict(work_list=True)),
                   (f"P={Nw} slots={Mx} max_kv_len={L}", Mx, Nw, dict(max_kv_len=L))]
      for fp8 in (False, True):
        tight_ms, tight_out = None, None
        for name, slots, width, kw in variants:
          if over_time():
            break
          btv = bt if width == Pt and slots == S else wide_table(bt, slots)
          lv = jnp.zeros((slots,), jnp.int32).at[:S].set(lens)
          qv = jnp.zeros((slots, Kw * gw, Hw), jnp.bfloat16).at[:S].set(q)
          args_ = (qv, poolw8, btv, lv, scw) if fp8 else (qv, poolw, btv, lv)
          row = {"kind": "decode", "dtype": "float8_e4m3fn" if fp8 else "bfloat16", "S": S, "L": L, "g": gw,
                 "variant": name, "slots": slots, "table_pages": width, **kw}
          try:
            f = dec_fn(fp8, **kw)
            cfg = gpu.make_config(qv.shape, poolw.shape, (poolw8 if fp8 else poolw).dtype, width,
                                  scale=1.0, soft_cap=None, sliding_window=None, out_dtype="bfloat16", **kw)
            if getattr(cfg, "worklist", False):  # run-time chunks of the (equal-length) live sequences
              row["splits"] = f"wl{int(gpu.decode_work_list(cfg, lv)[1][0])}"
              row["extra_programs"] = cfg.extra
            else:
              row["splits"] = cfg.splits
            row["ms"] = timeit(f, *args_)
            row["TBps"] = kv_bytes(S, L, 1 if fp8 else 2) / (row["ms"] * 1e-3) / 1e12
            out = f32(f(*args_))[:S]
            if tight_ms is None:
              tight_ms, tight_out = row["ms"], out
            else:
              row["over_tight"] = row["ms"] / tight_ms
              row["max_abs_diff_vs_tight"] = float(np.max(np.abs(out - tight_out)))
            row["pad_rows_zero"] = bool(np.all(f32(f(*args_))[S:] == 0))
          except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:300]
          add_row("wide", row, rounded=True)

    # The ragged kernel's share of an engine step (step_attention sends single-row sequences to decode and shows
    # the ragged kernel those sequences at kv_len 0).
    fr = jax.jit(lambda *a: gpu.paged_attention_gpu(*a, interpret=impl_interp))
    n_pre, ql, ctx = (4, 512, 2048) if not smoke else (1, 32, 64)
    mixed = []
    for slots in sorted({n_pre + 60 if not smoke else n_pre + 3, M}):
      n_dec = slots - n_pre
      mixed.append((f"mixed: {n_pre} x prefill {ql} (+{ctx} cached), {n_dec} decode rows at kv_len 0, P={Nw}",
                    n_pre, n_dec, Nw))
      mixed.append((f"decode-only step: {slots} rows, all kv_len 0, P={Nw}", 0, slots, Nw))
    mixed.insert(0, (f"tight: {n_pre} x prefill {ql} (+{ctx} cached)", n_pre, 0, (ql + ctx) // Gw))
    tight_ms = None
    for name, npre, ndec, width in mixed:
      if over_time():
        break
      S = npre + ndec
      q_lens = np.array([ql] * npre + [1] * ndec)
      kv_lens = np.array([ql + ctx] * npre + [0] * ndec)
      cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
      T = int(cu[-1])
      btr = jnp.asarray(rng.integers(0, Pw, (S, width)), jnp.int32)
      if npre:
        btr = btr.at[:npre, : (ql + ctx) // Gw].set(permw[: npre * ((ql + ctx) // Gw)].reshape(npre, -1))
      qT = jnp.asarray(rng.standard_normal((T, Kw * gw, Hw)), jnp.bfloat16)
      row = {"kind": "ragged", "variant": name, "T": T, "slots": S, "table_pages": width, "g": gw}
      try:
        row["ms"] = timeit(fr, qT, poolw, btr, jnp.asarray(kv_lens, jnp.int32), cu)
        if npre and tight_ms is None:
          tight_ms = row["ms"]
        elif npre:
          row["over_tight"] = row["ms"] / tight_ms
      except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
      add_row("wide", row, rounded=True)
    done("wide")

  res["elapsed_s"] = time.time() - t_start
  save()
  print_table(res)


def print_table(res):
  c = res.get("ceiling", {})
  print(f"\nceiling: torch copy {c.get('torch_copy_TBps')} TB/s, jax elementwise {c.get('jax_elementwise_TBps')} TB/s")
  tri = {(r["S"], r["L"], r["g"]): r.get("triton_ms") for r in res.get("triton", [])}
  for r in res.get("triton", []):
    print("triton", r)
  print(f"{'S':>4} {'L':>6} {'g':>2} {'ms':>8} {'TB/s':>6} {'%ceil':>6} {'ref ms':>8} {'x ref':>6} {'triton':>8} {'x tri':>6}")
  for r in res.get("decode", []):
    t = tri.get((r["S"], r["L"], r["g"]))
    ms = r.get("ms")
    print(f"{r['S']:>4} {r['L']:>6} {r['g']:>2} {ms or float('nan'):8.3f} {r.get('TBps', float('nan')):6.2f} "
          f"{r.get('pct_ceiling', float('nan')):6.1f} {r.get('ref_ms', float('nan')):8.3f} "
          f"{r.get('speedup_vs_ref', float('nan')):6.2f} {t or float('nan'):8.3f} "
          f"{(t / ms) if (t and ms) else float('nan'):6.2f}")
  for r in res.get("fp8", []):
    print("fp8", r)
  for r in res.get("sparse", []):
    print("sparse", r)
  for r in res.get("prefill", []):
    print("prefill", r)
  for r in res.get("fp8var", []):
    print("fp8var", r)
  for r in res.get("small", []):
    print("small", r)
  for r in res.get("grid", []):
    print("grid", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
  wide = res.get("wide", [])
  if wide:
    print("\npadding cost (`wide`): same real work, padded block table / extra kv_len-0 slots")
    print(f"{'kind':>6} {'dtype':>13} {'S|sl':>4} {'L|T':>6} {'variant':54s} {'splits':>6} {'ms':>8} {'x tight':>7} "
          f"{'TB/s':>6} {'diff':>8}")
    for r in wide:
      nan = float("nan")
      print(f"{r['kind']:>6} {r.get('dtype', ''):>13} {r.get('S', r.get('slots', '')):>4} {r.get('L', r.get('T', '')):>6} "
            f"{r['variant'][:54]:54s} {str(r.get('splits', '')):>6} {r.get('ms', nan):8.4f} "
            f"{r.get('over_tight', nan):7.2f} {r.get('TBps', nan):6.2f} {r.get('max_abs_diff_vs_tight', nan):8.1e}"
            + (f"  ERROR {r['error'][:80]}" if "error" in r else ""))


if __name__ == "__main__":
  main()
