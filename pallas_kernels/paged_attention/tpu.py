"""Mosaic TPU paged attention kernels: decode (optionally over a sparse page selection) and ragged prefill.

Why it exists: the TPU counterpart of gpu.py, same semantics. Block tables, lengths and the per-tile work list
are scalar-prefetched into SMEM (PrefetchScalarGridSpec); the pool stays in HBM (memory_space=ANY) and each
program walks its sequence's pages with manual async DMAs, double-buffered: block b+1 is in flight while block
b is computed. One program = (sequence, kv head) for decode, (query tile, kv head) for ragged prefill; all g
query heads of the kv head (and, for prefill, 64/g tokens) are the rows of one MXU matmul.

fp8 pools: the DMA brings fp8 pages; the kernel converts in VMEM to f32. Scales are per (page, kv head, K/V);
the wrapper expands them to one value per kv token of the sequence's page list ([S, K, 2, L] f32, ~3% of the
fp8 KV bytes) so the kernel reads them as an aligned lane slice instead of scattered scalars.

Status: checked by the TPU interpreter (tests) and by exporting for the tpu platform; never run on a TPU
(none available here), so Mosaic's own compiler passes (layouts of the strided page DMAs, VMEM limits) and
the speed are unverified. Needs H % 128 == 0 and a page size that divides 128 or is a multiple of 128.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import common

Unsupported = common.Unsupported
ROWS = 64


@dataclasses.dataclass(frozen=True)
class TpuConfig:
  ragged: bool
  sparse: bool
  S: int
  K: int
  g: int
  G: int
  H: int
  Pmax: int  # entries per page-list row
  BK: int  # kv tokens per step (ppb whole pages)
  R: int  # q rows per program
  fp8: bool
  scale: float
  soft_cap: float | None
  window: int | None
  out_dtype: str

  @property
  def ppb(self):
    return self.BK // self.G


def check_supported(G, H, g):
  if not (128 % G == 0 or G % 128 == 0):
    raise Unsupported(f"page size G={G} must divide 128 or be a multiple of 128")
  if H % 128:
    raise Unsupported(f"head dim H={H} must be a multiple of 128 (TPU lanes)")


def _kernel(cfg: TpuConfig, *refs):
  it = iter(refs)
  lens_ref, bt_ref = next(it), next(it)
  info_ref = next(it) if cfg.ragged else None
  nsel_ref = next(it) if cfg.sparse else None
  lp_ref = next(it) if cfg.sparse else None
  q_ref, kv_hbm, rowtok_ref = next(it), next(it), next(it)
  sc_ref = next(it) if cfg.fp8 else None
  o_ref, kbuf, vbuf, sems = next(it), next(it), next(it), next(it)

  G, BK, ppb, R = cfg.G, cfg.BK, cfg.ppb, cfg.R
  i0 = pl.program_id(0)
  k = pl.program_id(1)
  if cfg.ragged:
    s = info_ref[4 * i0]
    ntok = info_ref[4 * i0 + 2]
    qpos0 = info_ref[4 * i0 + 3]
  else:
    s = i0
  kv_len = lens_ref[s]

  if cfg.sparse:
    nsel = nsel_ref[s * cfg.K + k]
    first, last = jnp.int32(0), lax.div(nsel + ppb - 1, ppb)
  elif cfg.ragged:
    last = jnp.where(ntok > 0, lax.div(qpos0 + ntok + BK - 1, BK), 0)
    first = jnp.int32(0) if cfg.window is None else lax.div(jnp.maximum(qpos0 - cfg.window + 1, 0), BK)
  else:
    last = lax.div(kv_len + BK - 1, BK)
    first = jnp.int32(0) if cfg.window is None else lax.div(jnp.maximum(kv_len - cfg.window, 0), BK)
  n = jnp.maximum(last - first, 0)

  def table(idx):
    idx = jnp.clip(idx, 0, cfg.Pmax - 1)
    if cfg.sparse:
      return (s * cfg.K + k) * cfg.Pmax + idx
    return s * cfg.Pmax + idx

  def copies(b, slot):
    out = []
    for j in range(ppb):
      pg = bt_ref[table(b * ppb + j)]
      out.append(pltpu.make_async_copy(kv_hbm.at[pg, :, 2 * k, :], kbuf.at[slot, pl.ds(j * G, G), :],
                                       sems.at[0, slot]))
      out.append(pltpu.make_async_copy(kv_hbm.at[pg, :, 2 * k + 1, :], vbuf.at[slot, pl.ds(j * G, G), :],
                                       sems.at[1, slot]))
    return out

  @pl.when(n > 0)
  def _():
    for c in copies(first, 0):
      c.start()

  q = q_ref[...].astype(jnp.float32)  # [R, H]
  col = lax.broadcasted_iota(jnp.int32, (1, BK), 1)
  if cfg.ragged:
    qpos = qpos0 + rowtok_ref[...]  # [R, 1]

  def body(i, carry):
    acc, m_i, l_i = carry
    b = first + i
    slot = lax.rem(i, 2)

    @pl.when(i + 1 < n)
    def _():
      for c in copies(b + 1, 1 - slot):
        c.start()

    for c in copies(b, slot):
      c.wait()
    kk = kbuf[slot].astype(jnp.float32)  # [BK, H]
    vv = vbuf[slot].astype(jnp.float32)
    logits = lax.dot_general(q, kk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * cfg.scale
    if cfg.fp8:
      base = pl.multiple_of(b * BK, BK)
      logits = logits * sc_ref[0:1, pl.ds(base, BK)]
    if cfg.soft_cap is not None:
      logits = jnp.tanh(logits / cfg.soft_cap) * cfg.soft_cap
    if cfg.sparse:
      pos = jnp.zeros((1, BK), jnp.int32)
      for j in range(ppb):
        lp = jnp.where(b * ppb + j < nsel, lp_ref[table(b * ppb + j)], 1 << 20)  # past the count: masked
        pos = jnp.where(lax.shift_right_logical(col, G.bit_length() - 1) == j, lp * G + col - j * G, pos) \
            if ppb > 1 else lp * G + col
    else:
      pos = b * BK + col
    valid = pos < kv_len
    if cfg.ragged:
      valid = valid & (pos <= qpos)
      if cfg.window is not None:
        valid = valid & (pos > qpos - cfg.window)
    elif cfg.window is not None:
      valid = valid & (pos > kv_len - 1 - cfg.window)
    logits = jnp.where(valid, logits, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(logits, axis=1, keepdims=True))
    alpha = jnp.exp(m_i - m_new)
    p = jnp.exp(logits - m_new)
    l_i = l_i * alpha + jnp.sum(p, axis=1, keepdims=True)
    if cfg.fp8:
      p = p * sc_ref[1:2, pl.ds(base, BK)]
    acc = acc * alpha + jnp.dot(p, vv, preferred_element_type=jnp.float32)
    return acc, m_new, l_i

  init = (jnp.zeros((R, cfg.H), jnp.float32), jnp.full((R, 1), -1e30, jnp.float32), jnp.zeros((R, 1), jnp.float32))
  acc, m_i, l_i = lax.fori_loop(0, n, body, init)
  inv = jnp.where(l_i > 0, 1.0 / jnp.where(l_i > 0, l_i, 1.0), 0.0)
  o_ref[...] = (acc * inv).astype(o_ref.dtype)


def _call(cfg: TpuConfig, prefetch, q, kv_pages_PGKH, rowtok, sc, *, interpret):
  """q: decode [S, K, R, H]; ragged [NT, K, R, H]. Returns the same shape in cfg.out_dtype."""
  n_pref = len(prefetch)
  grid = (q.shape[0], cfg.K)
  if cfg.ragged:
    sc_map = lambda i, k, *pref: (pref[2][4 * i], k, 0, 0)
  else:
    sc_map = lambda i, k, *pref: (i, k, 0, 0)
  in_specs = [pl.BlockSpec((None, None, cfg.R, cfg.H), lambda i, k, *_: (i, k, 0, 0)),
              pl.BlockSpec(memory_space=pl.ANY),
              pl.BlockSpec((cfg.R, 1), lambda i, k, *_: (0, 0))]
  inputs = [q, kv_pages_PGKH, rowtok]
  if cfg.fp8:
    in_specs.append(pl.BlockSpec((None, None, 2, sc.shape[-1]), sc_map))
    inputs.append(sc)
  pool_dt = kv_pages_PGKH.dtype
  scratch = [pltpu.VMEM((2, cfg.BK, cfg.H), pool_dt), pltpu.VMEM((2, cfg.BK, cfg.H), pool_dt),
             pltpu.SemaphoreType.DMA((2, 2))]
  del n_pref
  return pl.pallas_call(
      functools.partial(_kernel, cfg),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch), grid=grid, in_specs=in_specs,
          out_specs=pl.BlockSpec((None, None, cfg.R, cfg.H), lambda i, k, *_: (i, k, 0, 0)),
          scratch_shapes=scratch),
      out_shape=jax.ShapeDtypeStruct(q.shape, jnp.dtype(cfg.out_dtype)),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
  )(*prefetch, *inputs)


def _block(G):
  return max(G, 256)


def _expanded_scales(kv_scales_PK, pages_SxP, K, G, L_pad):
  """Per-token scales along a page list: [S, K, 2, L_pad] f32 (pages_SxP: [S, P] shared or [S, K, P])."""
  if pages_SxP.ndim == 2:
    sc = kv_scales_PK[pages_SxP]  # [S, P, 2K]
    sc = sc.reshape(sc.shape[0], sc.shape[1], K, 2).transpose(0, 2, 3, 1)  # [S, K, 2, P]
  else:
    sc = kv_scales_PK[pages_SxP]  # [S, K, P, 2K]
    kk = jnp.arange(K)
    sc = sc.reshape(*sc.shape[:3], K, 2)[:, kk, :, kk, :]  # [K, S, P, 2]
    sc = sc.transpose(1, 0, 3, 2)  # [S, K, 2, P]
  sc = jnp.repeat(sc, G, axis=-1)
  return jnp.pad(sc, ((0, 0), (0, 0), (0, 0), (0, L_pad - sc.shape[-1])))


def _make_cfg(q_shape_SNH, kv_pages_PGKH, Pmax, *, ragged, sparse, scale, soft_cap, sliding_window, out_dtype, R):
  S, N, H = q_shape_SNH
  P, G, K2, _ = kv_pages_PGKH.shape
  K = K2 // 2
  check_supported(G, H, N // K)
  return TpuConfig(ragged=ragged, sparse=sparse, S=S, K=K, g=N // K, G=G, H=H, Pmax=Pmax, BK=_block(G), R=R,
                   fp8=common.is_fp8(kv_pages_PGKH.dtype), scale=common.default_scale(H, scale),
                   soft_cap=None if soft_cap is None else float(soft_cap),
                   window=None if sliding_window is None else int(sliding_window), out_dtype=out_dtype)


def decode_core(q_SNH, kv_pages_PGKH, pages, kv_lens_S, kv_scales_PK, nsel_SK=None, lp=None, *, scale=None,
                soft_cap=None, sliding_window=None, interpret=False):
  """Shared by dense decode (pages = block tables [S, Pmax]) and sparse decode (pages [S, K, B] + lp, nsel)."""
  S, N, H = q_SNH.shape
  sparse = nsel_SK is not None
  Pmax = pages.shape[-1]
  K = kv_pages_PGKH.shape[2] // 2
  g = N // K
  cfg = _make_cfg(q_SNH.shape, kv_pages_PGKH, Pmax, ragged=False, sparse=sparse, scale=scale, soft_cap=soft_cap,
                  sliding_window=sliding_window, out_dtype=jnp.dtype(q_SNH.dtype).name, R=g)
  q = q_SNH.reshape(S, K, g, H)
  prefetch = [kv_lens_S, pages.reshape(-1)]
  if sparse:
    prefetch += [nsel_SK.reshape(-1).astype(jnp.int32), lp.reshape(-1).astype(jnp.int32)]
  sc = None
  if cfg.fp8:
    L_pad = common.cdiv(Pmax * cfg.G, cfg.BK) * cfg.BK
    sc = _expanded_scales(kv_scales_PK, pages, K, cfg.G, L_pad)
  rowtok = jnp.zeros((g, 1), jnp.int32)
  out = _call(cfg, prefetch, q, kv_pages_PGKH, rowtok, sc, interpret=interpret)
  return out.reshape(S, N, H)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret"))
def paged_decode_attention_tpu(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, *, scale=None, soft_cap=None,
                               sliding_window=None, kv_scales_PK=None, interpret=False):
  """Mosaic TPU decode attention. Raises Unsupported for shapes it cannot run."""
  common.check_decode(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kv_scales_PK, soft_cap=soft_cap,
                      sliding_window=sliding_window)
  return decode_core(q_SNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, kv_scales_PK, scale=scale,
                     soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret"))
def paged_attention_tpu(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1, *, scale=None,
                        soft_cap=None, sliding_window=None, kv_scales_PK=None, interpret=False):
  """Mosaic TPU ragged (prefill / mixed) paged attention."""
  from .gpu import ragged_tile_info  # shared pure-jnp work-list builder
  from .reference import query_positions
  S, N, K, g, P, G, H = common.check_ragged(q_TNH, kv_pages_PGKH, block_tables_SP, kv_lens_S, cu_q_lens_S1,
                                            kv_scales_PK, soft_cap=soft_cap, sliding_window=sliding_window)
  T = q_TNH.shape[0]
  tq = max(1, ROWS // g)
  R = tq * g
  Pmax = block_tables_SP.shape[1]
  cfg = _make_cfg((S, N, H), kv_pages_PGKH, Pmax, ragged=True, sparse=False, scale=scale, soft_cap=soft_cap,
                  sliding_window=sliding_window, out_dtype=jnp.dtype(q_TNH.dtype).name, R=R)
  info, tile_start, NT = ragged_tile_info(cu_q_lens_S1, kv_lens_S, T, tq)
  tok = info[:, 1:2] + jnp.arange(tq, dtype=jnp.int32)[None, :]
  tok_ok = jnp.arange(tq)[None, :] < info[:, 2:3]
  q = q_TNH[jnp.clip(tok, 0, T - 1)]  # [NT, tq, N, H]
  q = jnp.where(tok_ok[:, :, None, None], q, 0).reshape(NT, tq, K, g, H).transpose(0, 2, 1, 3, 4)
  q = q.reshape(NT, K, R, H)
  sc = None
  if cfg.fp8:
    L_pad = common.cdiv(Pmax * G, cfg.BK) * cfg.BK
    sc = _expanded_scales(kv_scales_PK, block_tables_SP, K, G, L_pad)
  rowtok = jnp.asarray((np.arange(R) // g).reshape(R, 1), jnp.int32)
  prefetch = [kv_lens_S, block_tables_SP.reshape(-1), info.reshape(-1)]
  o_tiles = _call(cfg, prefetch, q, kv_pages_PGKH, rowtok, sc, interpret=interpret)  # [NT, K, R, H]
  seg_T, _, valid_T = query_positions(cu_q_lens_S1, kv_lens_S, T)
  t = jnp.arange(T, dtype=jnp.int32)
  within = t - cu_q_lens_S1[seg_T]
  tile_T = jnp.clip(tile_start[seg_T] + within // tq, 0, NT - 1)
  o = o_tiles.reshape(NT, K, tq, g, H)[tile_T, :, within % tq]
  o = jnp.where(valid_T[:, None, None, None], o, 0)
  return o.reshape(T, N, H)
