"""Warp-specialized Mosaic GPU decode kernel for fp8 (e4m3 / e5m2) KV pools.

Why it exists: Hopper's wgmma has no fp8 x f16 form and fp8 wgmma needs both operands K-major (V is not), so fp8 pages
must be widened to f16 in shared memory before the matmuls. In the one-warpgroup kernel (gpu.py) that conversion sits
on the critical path of every step: 1.18-1.45x the bf16 time at equal split policy (H200, benchmarks/RESULTS.md,
"Paged attention"; the numbers below). Here the work of one program is split over warpgroups:

- C converter warpgroups (wg 1..C): each owns the steps i with i % C == wg - 1. For its step it issues the
  TMAs of the block's fp8 K/V pages into its slots of the fp8 ring, waits for them, widens them to f16
  (`astype`: the hardware cvt.f16x2.e4m3x2 / e5m2x2, exact) into an f16 staging slot, and signals `ready`.
- One compute warpgroup (wg 0): per step waits `ready`, runs QK^T wgmma, the online softmax (fp8 scales on
  the logits / probabilities as in gpu.py), the PV wgmma, and signals `free` so the staging slot can be
  refilled.

So the conversion of step i+1.. overlaps the matmuls and softmax of step i, and C warpgroups share the
conversion work. Semantics, masking, split-K partials and the output layout are exactly gpu.py's (the same
KernelConfig, combine and wrappers); gpu.py routes fp8 decode here when fp8_converters > 0 (default
tuning.py: fp8_converters = 1).

fp8_convert="bits" widens with integer ops instead of cvt (e5m2: b << 8; e4m3: sign/exponent-mantissa shifts,
exactly value x 2^-8, the 2^8 folded into the logit scale and one multiply of the output), on 32-bit words of
the same shared memory (RefUnion views), writing the head dim in widen_permutation order (q is permuted to
match, the output permuted back). Exact, but slower than cvt on the H200.

Measured (H200, benchmarks/RESULTS.md, batch 8 x 8k, GQA 4, bf16 = 0.080 ms at 128-token steps x 2 stages with "sms2"
splits / 0.067 ms at the defaults, 64 x 2 with "waves"): inline conversion 0.116 ms ("sms2" splits) / 0.079 ("waves");
this kernel with 1 converter x 128-token steps 0.074 (the default), 1-3 converters x 64-token steps 0.085, 2
converters x 128 0.084; "bits" 0.091-0.119. More converter warpgroups do not help and integer widening is slower, and
the fp8 kernel moves tokens at about the bf16 kernel's token rate (fp8/bf16 time 0.9-1.1 at equal split policy).
Hypothesis (not profiled): once the bytes halve, the limit is the single compute warpgroup's serial per-step chain (QK
wgmma -> softmax -> PV wgmma at M=64 rows of which 4-8 are used), not the conversion.
fp8_compute_wgs=2 (opt-in, not measured on a GPU) tests that hypothesis:
two compute warpgroups take alternate steps (steps i % 2 == c), each with its own acc/m/l, and each writes its
own split-K partial (so the existing combine merges them); one converter feeds both. Checked in the GPU
interpreter with its race detector and lowered for cuda (tests/kernels/test_paged_attention_gpu.py).

fp8_qk=True (cfg.qk8; opt-in, tuning.py fp8_qk, not measured on a GPU) removes half of the conversion: Mosaic GPU's wgmma
takes e4m3/e5m2 operands with f32 accumulation when both are K-major, which q [rows, H] and a K page [tokens, H]
are for Q.K^T. The wrapper quantizes q per row to e4m3 (gpu.quantize_q_rows; the row scale times the softmax scale
multiplies the logits), the compute warpgroup runs QK^T on the fp8 K bytes straight from the TMA ring, and the
converters widen only V (V is [tokens, H], i.e. N-major for P.V, which 8-bit wgmma cannot take without a
transpose). Because the ring slot is now read by the compute warpgroup, a `kread` barrier per slot tells the
converter when it may be refilled (the converter refills step i's slot while starting step i + C, so the wait is
normally already satisfied); with no f16 K staging the default ring doubles (128-token steps x 4 stages). The same
option exists in gpu.py's one-warpgroup kernel, where the V conversion runs while the QK wgmma is in flight and the
smaller shared-memory footprint (64 x 3: ~73 KiB) allows three CTAs per SM. Accuracy: the result equals the
fp8-aware reference evaluated at the quantized q (tests); against the reference at the original q it adds the e4m3
rounding of q (<= 2^-4 relative per element), about the size of the error the e4m3 K already has (a few 1e-4 ..
1e-3 absolute on unit-scale outputs in the CPU tests).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import common
from .gpu_blocks import (M_INIT, ROWS, block_walk, column_positions, decode_program, issue_block_tmas,
                         online_softmax_step, page_columns, q_scratch, store_work_item, tiles, work_list_out_types)

def staging_slots(converters, compute_wgs=1):
  """f16 staging slots (K and V each): at least 2 (conversion of one step overlaps the matmuls of the
  previous), and a multiple of the converter and compute warpgroup counts (slot f is always filled by
  converter f % C and read by compute warpgroup f % Q)."""
  n = math.lcm(converters, compute_wgs)
  return n * max(1, -(-2 // n))


def smem_bytes_ws(BK, H, stages, converters, compute_wgs=1, qk8=False):
  """Estimate: q tile + fp8 ring + union(f16 staging, output staging per compute warpgroup) + barriers.
  qk8: e4m3 q tile + its row scales, and only V is staged in f16."""
  staging = staging_slots(converters, compute_wgs) * (1 if qk8 else 2) * BK * H * 2
  out = compute_wgs * (ROWS * H * 8 + 2 * ROWS * 4)  # work-list decode: output-dtype (<= f32) + f32 staging
  q = ROWS * H + ROWS * 4 if qk8 else ROWS * H * 2
  return q + stages * 2 * BK * H + max(staging, out) + 1024


def check_ws(cfg, converters):
  if not cfg.fp8 or cfg.ragged:
    raise common.Unsupported("the warp-specialized kernel is for fp8 decode only")
  if cfg.stages % converters:
    raise common.Unsupported(f"stages={cfg.stages} must be a multiple of converters={converters}")
  if cfg.compute_wgs not in (1, 2) or (cfg.compute_wgs == 2 and converters != 1):
    raise common.Unsupported(f"compute_wgs={cfg.compute_wgs} with converters={converters}: supported are 1 compute "
                             "warpgroup with 1-3 converters, or 2 compute warpgroups with 1 converter")
  if cfg.qk8 and cfg.stages % cfg.compute_wgs:  # each compute warpgroup waits on the TMA barriers of its own slots
    raise common.Unsupported(f"fp8_qk with compute_wgs={cfg.compute_wgs} needs stages={cfg.stages} to be a multiple "
                             "of it")


E4M3_BITS_FACTOR = 256.0  # the e4m3 bit trick yields value x 2^-8


def widen_permutation(H):
  """Column order of the bit-trick f16 tiles: column c holds head-dim element perm[c].

  A 32-bit word of fp8 row data holds elements 4j..4j+3; its widened low word (4j, 4j+1) goes to f16 columns
  2j, 2j+1 of the first half and its high word (4j+2, 4j+3) to the same columns of the second half, so each
  half is written by one plain (unshuffled) store. QK^T is invariant when q is permuted the same way; the PV
  output comes out permuted and is put back in order by the wrapper.
  """
  c = np.arange(H)
  half = H // 2
  j = (c % half) // 2
  return 4 * j + 2 * (c // half) + c % 2


def widen_words(w, fp8_name):
  """u32 words of 4 fp8 values -> (lo, hi) u32 words of 2 f16 values each (elements 4j, 4j+1 and 4j+2, 4j+3),
  with integer ops only. e5m2 bits << 8 are exactly the f16 bits; e4m3 b -> ((b & 0x80) << 8) | ((b & 0x7f) << 7)
  is exactly e4m3 x 2^-8 (subnormals included; the 0x7f / 0xff NaN encodings become a finite 1.875 x 2^0).
  Works on jnp arrays and on the kernel's register arrays alike."""
  u = lambda x: jnp.asarray(x, jnp.uint32)
  shl = lambda x, n: lax.shift_left(x, u(n))
  shr = lambda x, n: lax.shift_right_logical(x, u(n))
  if jnp.dtype(fp8_name) == jnp.dtype(jnp.float8_e5m2):
    lo = (shl(w, 8) & u(0xFF00)) | (shl(w, 16) & u(0xFF000000))
    hi = (shr(w, 8) & u(0xFF00)) | (w & u(0xFF000000))
  else:
    lo = ((shl(w, 8) & u(0x8000)) | (shl(w, 7) & u(0x3F80))) | ((shl(w, 16) & u(0x80000000)) |
                                                              (shl(w, 15) & u(0x3F800000)))
    hi = ((shr(w, 8) & u(0x8000)) | (shr(w, 9) & u(0x3F80))) | ((w & u(0x80000000)) | (shr(w, 1) & u(0x3F800000)))
  return lo, hi


def _widen_bits(src32, dst32, fp8_name):
  """fp8 tile [BK, H] seen as u32 [BK, H/4] -> f16 tile [BK, H] seen as u32 [BK, H/2], in widen_permutation
  order: the low words fill the first half of each row, the high words the second."""
  lo, hi = widen_words(src32[...], fp8_name)
  hw = src32.shape[-1]
  dst32.at[:, pl.ds(0, hw)][...] = lo
  dst32.at[:, pl.ds(hw, hw)][...] = hi


def _kernel_ws(cfg, C, *refs):
  it = iter(refs)
  q_ref, kv_ref, bt_ref, lens_ref = next(it), next(it), next(it), next(it)
  wl_ref = next(it) if cfg.worklist else None
  nsel_ref = next(it) if cfg.sparse else None
  lp_ref = next(it) if cfg.sparse else None
  sc_ref = next(it)
  qs_ref = next(it) if cfg.qk8 else None
  o_ref = next(it)
  m_ref = None if cfg.final else next(it)
  l_ref = None if cfg.final else next(it)
  ext_refs = (next(it), next(it), next(it)) if cfg.worklist else None
  q_smem, ring, union, tma_bars, ready_bars, free_bars, q_bar = (next(it) for _ in range(7))
  Q = cfg.compute_wgs
  done_bar = next(it) if Q > 1 else None
  p_smem = next(it) if cfg.p_via_smem else None
  qs_smem = next(it) if cfg.qk8 else None
  kread_bars = next(it) if cfg.qk8 else None  # qk8: compute has read ring slot's K (the QK wgmma finished)
  (kq_smem, vq_smem), (kq32, vq32) = ring
  union = list(union)
  staged16 = union[0]  # (k16, v16), or (v16,) with qk8
  k16, v16 = (None, staged16[0]) if cfg.qk8 else staged16
  k32, v32 = union[1] if cfg.fp8_bits else (None, None)
  o_all, ml_all = union[-1][:2]
  of_all = union[-1][2] if cfg.worklist else None  # work-list decode: f32 staging of extra-chunk outputs

  G, BK, spp, g = cfg.G, cfg.BK, cfg.spp, cfg.g
  cdt = jnp.dtype(jnp.float16)
  F = staging_slots(C, Q)
  widen = E4M3_BITS_FACTOR if (cfg.fp8_bits and jnp.dtype(cfg.fp8) == jnp.dtype(jnp.float8_e4m3fn)) else 1.0
  wg = lax.axis_index("wg")
  k = lax.axis_index("kvh")
  w, s, sp, nsp = decode_program(cfg, wl_ref)
  kv_len = lens_ref[s]
  b_lo, n_steps, block_pages, logical_page = block_walk(cfg, s, k, sp, kv_len, bt_ref, lp_ref, nsel_ref,
                                                        nsplit=nsp)

  def issue(b, slot, pages):
    issue_block_tmas(cfg, kv_ref, k, b, pages, kq_smem.at[slot], vq_smem.at[slot], tma_bars.at[slot])

  # ------------------------------------------------------------------ converters
  @pl.when(wg >= Q)
  def _converter():
    if C + Q >= 3:  # 3-4 warpgroups share 64K registers: give the compute warpgroup(s) room for acc + logits
      plgpu.set_max_registers(96 if Q == 1 else 104, action="decrease")
    j = wg - Q
    # Prologue: this converter's first stages // C steps.
    for t in range(cfg.stages // C):
      i = j + t * C

      @pl.when(i < n_steps)
      def _():
        issue(b_lo + i, lax.rem(i, cfg.stages), block_pages(b_lo + i))

    n_mine = jnp.maximum(n_steps - j + C - 1, 0) // C

    def refill_after_kread(i):
      """qk8: ring slot of step i is free once the compute warpgroup's QK wgmma of step i is done."""
      slot = lax.rem(i, cfg.stages)
      plgpu.barrier_wait(kread_bars.at[slot])

      @pl.when(i + cfg.stages < n_steps)
      def _():
        issue(b_lo + i + cfg.stages, slot, block_pages(b_lo + i + cfg.stages))

    def body(t, _):
      i = j + t * C
      b = b_lo + i
      slot = lax.rem(i, cfg.stages)
      fslot = lax.rem(i, F)
      if cfg.qk8:  # refill the previous step's slot first (its K was read long ago), then convert this step's V
        @pl.when(t > 0)
        def _():
          refill_after_kread(i - C)
      else:
        next_pages = block_pages(b + cfg.stages)
      plgpu.barrier_wait(tma_bars.at[slot])

      @pl.when(i >= F)
      def _():
        plgpu.barrier_wait(free_bars.at[fslot])

      if cfg.fp8_bits:
        _widen_bits(kq32.at[slot], k32.at[fslot], cfg.fp8)
        _widen_bits(vq32.at[slot], v32.at[fslot], cfg.fp8)
      elif cfg.qk8:
        v16.at[fslot][...] = vq_smem[slot].astype(cdt)
      else:
        k16.at[fslot][...] = kq_smem[slot].astype(cdt)
        v16.at[fslot][...] = vq_smem[slot].astype(cdt)
      plgpu.commit_smem()  # fence + warpgroup barrier: the f16 tiles are visible to wgmma, the fp8 slot is read
      plgpu.barrier_arrive(ready_bars.at[fslot])

      if not cfg.qk8:
        @pl.when(i + cfg.stages < n_steps)
        def _():
          issue(b + cfg.stages, slot, next_pages)
      return ()

    lax.fori_loop(0, n_mine, body, ())
    if cfg.qk8:  # the last step's kread (no refill left; observed so every phase is waited)
      @pl.when(n_mine > 0)
      def _():
        refill_after_kread(j + (n_mine - 1) * C)

    # Observe the last `free` of each staging slot this converter filled (the interpreter requires every phase
    # of a barrier a thread waits on to be observed; on hardware it also keeps the staging tiles, which the
    # output staging aliases, untouched until the compute warpgroup is done with them).
    for f in range(F):
      @pl.when((f % C == j) & (f < n_steps))
      def _():
        plgpu.barrier_wait(free_bars.at[f])

  # ------------------------------------------------------------------ compute
  @pl.when(wg < Q)
  def _compute():
    if C + Q >= 3:
      plgpu.set_max_registers(200, action="increase")
    c = wg if Q > 1 else 0  # this compute warpgroup takes the steps i with i % Q == c
    r0 = jnp.minimum((k * g) // 8 * 8, cfg.N - ROWS) if cfg.N > ROWS else 0

    def load_q():
      if cfg.N > ROWS:
        plgpu.copy_gmem_to_smem(q_ref.at[s, pl.ds(r0, ROWS)], q_smem, q_bar)
      else:
        plgpu.copy_gmem_to_smem(q_ref.at[s, pl.ds(0, cfg.R)], q_smem.at[pl.ds(0, cfg.R)], q_bar)
      if cfg.qk8:
        plgpu.copy_gmem_to_smem(qs_ref.at[s, pl.ds(r0, ROWS)], qs_smem, q_bar)

    busy = n_steps > 0  # False: kv_len 0 or a split past the real length: no q load, no pages, neutral output
    if Q > 1:
      pl.when(busy & (c == 0))(load_q)  # one q load, shared by the compute warpgroups
    else:
      pl.when(busy)(load_q)
    local = k * g - r0
    pl.when(busy)(lambda: plgpu.barrier_wait(q_bar))
    if cfg.qk8:
      qs_row = plgpu.load(qs_smem, layout=plgpu.Layout.WGMMA.reduce(1))
    col = plgpu.broadcasted_iota(jnp.int32, (ROWS, BK), 1, layout=plgpu.Layout.WGMMA)

    def body(t, carry):
      acc, m_i, l_i = carry
      i = c + t * Q
      b = b_lo + i
      fslot = lax.rem(i, F)
      cur_pages = block_pages(b)
      k_scales = [sc_ref[pg, 2 * k] for pg in cur_pages]
      v_scales = [sc_ref[pg, 2 * k + 1] for pg in cur_pages]
      plgpu.barrier_wait(ready_bars.at[fslot])
      slot = lax.rem(i, cfg.stages)
      if cfg.qk8:  # the wgmma reads the TMA'd K bytes itself: observe their arrival here too (already complete)
        plgpu.barrier_wait(tma_bars.at[slot])
      kop = kq_smem.at[slot] if cfg.qk8 else k16.at[fslot]  # qk8: the fp8 K bytes straight from the TMA ring

      def qk_fn(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, kop.transpose((1, 0)))
        return acc_ref[...]
      logits = pl.run_scoped(qk_fn, plgpu.ACC((ROWS, BK), jnp.float32))
      if cfg.qk8:
        plgpu.barrier_arrive(kread_bars.at[slot])

      pos = column_positions(cfg, b, col, logical_page)
      ksc, vsc = page_columns(k_scales, col, G), page_columns(v_scales, col, G)

      if cfg.qk8:  # per-row q scale x softmax scale (the wrapper folded them)
        logits = logits * lax.broadcast_in_dim(qs_row, logits.shape, [0]) * ksc
      else:
        logits = logits * (cfg.scale * widen) * ksc
      p, m_new, l_i, acc = online_softmax_step(cfg, logits, pos, kv_len, m_i, l_i, acc)
      p16 = (p * vsc).astype(cdt)
      if p_smem is not None:  # the interpreter needs the wgmma A operand in shared memory (one per compute WG)
        p_smem.at[c][...] = p16
        plgpu.commit_smem()
        p16 = p_smem.at[c]

      def pv_fn(acc_ref):
        plgpu.wgmma(acc_ref, p16, v16.at[fslot])
        return acc_ref[...]
      acc = acc + pl.run_scoped(pv_fn, plgpu.ACC((ROWS, cfg.H), jnp.float32))
      plgpu.barrier_arrive(free_bars.at[fslot])
      return acc, m_new, l_i

    acc = plgpu.layout_cast(jnp.zeros((ROWS, cfg.H), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((ROWS,), M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    n_mine = jnp.maximum(n_steps - c + Q - 1, 0) // Q
    acc, m_i, l_i = lax.fori_loop(0, n_mine, body, (acc, m_i, l_i))
    if widen != 1.0:  # V tiles were widened as value x 2^-8 (e4m3 bit trick): one multiply at the end
      acc = acc * widen

    # Output staging aliases the f16 staging tiles: every conversion was consumed (each compute warpgroup waited
    # its `ready`s; with two, `done` waits for the other one too), so no warpgroup touches them any more.
    if Q > 1:
      plgpu.barrier_arrive(done_bar)
      plgpu.barrier_wait(done_bar)
    o_smem, ml_smem = o_all.at[c], ml_all.at[c]
    if cfg.worklist:  # idle items write nothing; see gpu.store_work_item
      pl.when(busy)(lambda: store_work_item(cfg, w, s, k, local, acc, m_i, l_i, o_ref, m_ref, l_ref, ext_refs,
                                            o_smem, of_all.at[0], ml_smem))
      return
    if cfg.final:
      inv = jnp.where(l_i > 0, 1.0 / jnp.where(l_i > 0, l_i, 1.0), 0.0)
      o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_smem.dtype)
    else:
      o_smem[...] = acc
      ml_smem[0] = m_i
      ml_smem[1] = l_i
    plgpu.commit_smem()
    if cfg.final:
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(local, g)], o_ref.at[s, pl.ds(k * g, g)])
    else:  # each compute warpgroup's (o, m, l) is one split-K partial: split index sp * Q + c
      part = sp * Q + c
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(local, g)], o_ref.at[part, s, pl.ds(k * g, g)])
      plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[part, s, k])
      plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[part, s, k])
    plgpu.wait_smem_to_gmem(0)


def kernel_call_ws(cfg, q, kv_pages_PGKH, bt, kv_lens_S, extra=(), scales=None, *, converters=2, interpret=False,
                   q_scales=None):
  """Same contract as gpu.kernel_call for fp8 decode configs (dense or sparse)."""
  check_ws(cfg, converters)
  Q = cfg.compute_wgs
  STAGING = staging_slots(converters, Q)
  H, BK, S, N, K = cfg.H, cfg.BK, cfg.S, cfg.N, cfg.K
  cdt = jnp.dtype(jnp.float16)
  pool_dt = jnp.dtype(cfg.fp8)
  out_dtype = jnp.dtype(cfg.out_dtype) if cfg.final else jnp.dtype(jnp.float32)
  ring = (cfg.stages, BK, H)
  arrivals = 2 * cfg.ppb if cfg.spp == 1 else 2
  u32 = jnp.dtype(jnp.uint32)
  ring32 = (cfg.stages, BK, H // 4)
  staged = (("v",) if cfg.qk8 else ("k", "v"))
  union = [tuple(plgpu.SMEM((STAGING, BK, H), cdt, transforms=tiles(cdt)) for _ in staged)]
  if cfg.fp8_bits:  # 32-bit-word views of the same staging bytes, for the integer widening
    union.append(tuple(plgpu.SMEM((STAGING, BK, H // 2), u32, transforms=tiles(u32, H // 2)) for _ in staged))
  if cfg.worklist:  # home rows in the output dtype, extra-chunk rows in f32
    union.append((plgpu.SMEM((Q, ROWS, H), jnp.dtype(cfg.out_dtype)), plgpu.SMEM((Q, 2, ROWS), jnp.float32),
                  plgpu.SMEM((Q, ROWS, H), jnp.float32)))
  else:
    union.append((plgpu.SMEM((Q, ROWS, H), out_dtype), plgpu.SMEM((Q, 2, ROWS), jnp.float32)))
  scratch = [
      q_scratch(cfg),
      # fp8 ring, and its 32-bit-word view (same bytes: 8-row tiles of H bytes, same swizzle) for the bit trick
      plgpu.RefUnion(
          (plgpu.SMEM(ring, pool_dt, transforms=tiles(pool_dt, H)),
           plgpu.SMEM(ring, pool_dt, transforms=tiles(pool_dt, H))),
          (plgpu.SMEM(ring32, u32, transforms=tiles(u32, H // 4)),
           plgpu.SMEM(ring32, u32, transforms=tiles(u32, H // 4))),
      ),
      plgpu.RefUnion(*union),
      plgpu.Barrier(num_arrivals=arrivals, num_barriers=cfg.stages),
      plgpu.Barrier(num_arrivals=1, num_barriers=STAGING),
      plgpu.Barrier(num_arrivals=1, num_barriers=STAGING),
      plgpu.Barrier(num_arrivals=2 if cfg.qk8 else 1),
  ]
  if Q > 1:
    scratch.append(plgpu.Barrier(num_arrivals=Q))
  if cfg.p_via_smem:
    scratch.append(plgpu.SMEM((Q, ROWS, BK), cdt, transforms=tiles(cdt)))
  if cfg.qk8:
    scratch += [plgpu.SMEM((ROWS,), jnp.float32), plgpu.Barrier(num_arrivals=1, num_barriers=cfg.stages)]
  grid, names = (cfg.splits, K, S), ("split", "kvh", "seq")
  if cfg.worklist:
    grid, names = (K, cfg.extra + S), ("kvh", "work")
    out_type = work_list_out_types(cfg)
  elif cfg.final:
    out_type = [jax.ShapeDtypeStruct((S, N, H), jnp.dtype(cfg.out_dtype))]
  else:
    parts = cfg.splits * Q
    out_type = [jax.ShapeDtypeStruct((parts, S, N, H), jnp.float32),
                jax.ShapeDtypeStruct((parts, S, K, ROWS), jnp.float32),
                jax.ShapeDtypeStruct((parts, S, K, ROWS), jnp.float32)]
  call = plgpu.kernel(
      functools.partial(_kernel_ws, cfg, converters),
      out_type=out_type,
      scratch_types=scratch,
      grid=grid,
      grid_names=names,
      num_threads=Q + converters,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=(plgpu.InterpretGPUParams(detect_races=True) if cfg.detect_races else plgpu.InterpretGPUParams())
      if interpret else None,
  )
  res = call(q, kv_pages_PGKH, bt, kv_lens_S, *extra, scales, *([q_scales] if cfg.qk8 else []))
  return res[0] if cfg.final else res


def choose_block_ws(G, H, converters, compute_wgs=1, qk8=False):
  """(BK, stages) defaults for the warp-specialized kernel. H200, batch 8 x 8k: one converter with
  128-token steps x 2 stages 0.074 ms, two converters x 64 x 4 0.085, three 0.085.
  qk8 (no f16 K staging; a ring slot is refilled only after the QK of its step): 4 stages."""
  if converters == 1:
    BK, stages = min(G, 128) if G > 64 else 128, 2
  else:
    BK, stages = (64 if G <= 64 else min(G, 128)), 2 * converters
  if compute_wgs > 1:  # two compute warpgroups: 64-token steps, 2 fp8 slots, 2 staging slots
    BK, stages = (64 if G <= 64 else min(G, 128)), 2
  if qk8:
    stages = 2 * stages
  while stages > converters and smem_bytes_ws(BK, H, stages, converters, compute_wgs, qk8) > 220 * 1024:
    stages -= converters
  return BK, stages
