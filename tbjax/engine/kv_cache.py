"""Device-resident KV page pools, one per layer, owned by the cache (layout, dtype, scales) rather than the model.

Layout per layer: pages [P, G, 2K, H] with K and V interleaved on the kv-head axis (index 2k = K of kv head k,
2k+1 = V), so one copy of a page brings both; fp8 pools (e4m3fn / e5m2) carry float32 scales [P, 2K]
(per page, per kv head, per K/V), raised and requantized by the write kernel as new tokens arrive.
Page ids are per dp rank; page 0 of each rank is the null page that padding block-table entries point to.
MLA models cache their latent form (kv_lora_rank + qk_rope_head_dim dims per token: the compressed KV and the shared
rope key) once per token, split over the K and V slots of a one-head pool (tbjax/engine/mla_paged.py), so the pool
layout, allocator, fp8 scales and transfers stay those of GQA.
"""
from __future__ import annotations

import dataclasses
import gc

import jax
import jax.numpy as jnp

from tbjax.engine.mla_paged import latent_dims, latent_heads
from tbjax.spec import ModelSpec

KV_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float8_e4m3fn": jnp.float8_e4m3fn,
             "float8_e5m2": jnp.float8_e5m2, "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn,
             "fp8_e5m2": jnp.float8_e5m2, "bf16": jnp.bfloat16, "f32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    num_pages: int            # per dp rank, including the null page
    page_size: int = 16
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"kv cache dtype {self.dtype!r} not supported; choose one of {sorted(KV_DTYPES)}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (one is the null page), got {self.num_pages}")

    @property
    def jnp_dtype(self):
        return jnp.dtype(KV_DTYPES[self.dtype])

    @property
    def is_fp8(self) -> bool:
        return self.jnp_dtype.itemsize == 1


def cache_heads(spec: ModelSpec) -> tuple[int, int]:
    """(kv heads K, dims H) of a layer's cache: GQA's kv heads, or for MLA one head of half the latent's dims (the
    latent's halves fill the K and the V slot)."""
    if spec.mla is not None:
        return latent_heads(latent_dims(spec))
    return spec.n_kv_heads, spec.head_dim


def bytes_per_token(spec: ModelSpec, dtype) -> int:
    """KV bytes one token occupies over all layers (scales excluded)."""
    K, H = cache_heads(spec)
    return spec.n_layers * 2 * K * H * jnp.dtype(KV_DTYPES.get(dtype, dtype)).itemsize


def init_kv_cache(spec: ModelSpec, cfg: KVCacheConfig):
    """List over layers of (pages_PGKH, scales_PK or None), zero-filled."""
    K, H = cache_heads(spec)
    shape = (cfg.num_pages, cfg.page_size, 2 * K, H)

    def one():
        pages = jnp.zeros(shape, cfg.jnp_dtype)
        scales = jnp.zeros((cfg.num_pages, 2 * K), jnp.float32) if cfg.is_fp8 else None
        return pages, scales
    return [one() for _ in range(spec.n_layers)]


def page_bytes(spec: ModelSpec, page_size: int, dtype: str) -> int:
    """Device bytes of one page over all layers, fp8 scales included."""
    scales = spec.n_layers * 2 * cache_heads(spec)[0] * 4 if jnp.dtype(KV_DTYPES[dtype]).itemsize == 1 else 0
    return bytes_per_token(spec, dtype) * page_size + scales


def pages_for_budget(spec: ModelSpec, page_size: int, dtype: str, budget_bytes: int) -> int:
    return max(2, budget_bytes // page_bytes(spec, page_size, dtype))


def auto_num_pages(spec: ModelSpec, page_size: int, dtype: str, params_bytes: int, fraction: float = 0.85,
                   device=None) -> int:
    """Pages that fit in the device memory left after the weights (CPU: a fixed 16k-token pool).

    The count is rounded down to a coarse step (1/64 of it or finer, a power of two), so that a few MB more or less
    in use at start-up (loader temporaries not yet freed) give the same pool, hence the same step-program shapes and
    program-cache keys at every start."""
    dev = device if device is not None else jax.devices()[0]
    per_page = page_bytes(spec, page_size, dtype)
    if dev.platform == "cpu":
        return max(2, 16384 // page_size + 1)
    gc.collect()                       # buffers of dropped loader arrays are freed before memory is counted
    stats = dev.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return max(2, 16384 // page_size + 1)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    budget = int(free * fraction) - 2 * params_bytes // max(spec.n_layers, 1)  # headroom for activations
    return stable_page_count(budget // per_page)


def stable_page_count(pages: int) -> int:
    """`pages` rounded down to a multiple of the largest power of two <= pages / 64 (at least 2 pages)."""
    if pages < 128:
        return max(2, pages)
    step = 1 << ((pages // 64).bit_length() - 1)
    return pages // step * step
