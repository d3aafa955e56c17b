"""Per-request sampling: parameters, their validation, and one jitted sampler for a whole batch.

Every row of a batch carries its own temperature / top-k / top-p / min-p and its own PRNG key, derived from the
request's seed and the position of the token being sampled, so a request samples the same tokens whatever else
shares its batch (batch invariance) and a seeded request is reproducible.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.utils import is_int


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it."""


MAX_TOKENS_LIMIT = 1 << 20


# What an unset (None) temperature / top_k / top_p / min_p becomes when neither the request nor the model's defaults
# (tbjax.weights.generation_config: generation_config.json, GGUF metadata, the default model's card) set it.
LIBRARY_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling. ``temperature`` / ``top_k`` / ``top_p`` / ``min_p`` left None take the model's defaults
    (``tbjax.LLM`` and the servers fill them: ``with_defaults``), else ``LIBRARY_DEFAULTS`` (``validate`` fills those)."""

    max_tokens: int = 256
    temperature: float | None = None  # 0 => greedy; None => the model's default, else 1.0
    top_k: int | None = None          # 0 => off; None => the model's default, else 0
    top_p: float | None = None        # in (0, 1]; None => the model's default, else 1.0
    min_p: float | None = None        # in [0, 1); None => the model's default, else 0.0
    seed: int | None = None
    stop: Sequence[str] = ()          # stop strings (not included in the output text)
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int = 0                 # how many top logprobs to return per token (0 => only the chosen token's)

    @classmethod
    def greedy(cls, max_tokens: int = 256, **kw) -> "SamplingParams":
        return cls(max_tokens=max_tokens, temperature=0.0, **kw)

    def with_defaults(self, defaults) -> "SamplingParams":
        """A copy whose unset (None) sampling fields take ``defaults`` (a dict, e.g. a model's
        ``GenerationDefaults.sampling()``); fields set explicitly are kept."""
        fill = {k: v for k, v in dict(defaults or {}).items()
                if k in LIBRARY_DEFAULTS and v is not None and getattr(self, k) is None}
        return dataclasses.replace(self, **fill)

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Check every field (raises ``SamplingParamsError`` naming it); sampling fields still unset take
        ``LIBRARY_DEFAULTS``, in place."""
        for k, v in LIBRARY_DEFAULTS.items():
            if getattr(self, k) is None:
                setattr(self, k, v)

        def bad(field, why):
            raise SamplingParamsError(f"{field}={getattr(self, field)!r}: {why}")
        if not is_int(self.max_tokens, numpy=True):
            bad("max_tokens", "must be an integer")
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            bad("max_tokens", f"must be in 1..{MAX_TOKENS_LIMIT}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0")
        if not is_int(self.top_k, numpy=True) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 disables it)")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if not (0.0 <= self.min_p < 1.0):
            bad("min_p", "must be in [0, 1)")
        if self.seed is not None and (not is_int(self.seed, numpy=True) or not 0 <= self.seed < 2**63):
            bad("seed", "must be a non-negative integer")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if any((not isinstance(s, str)) or not s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        if vocab_size is not None and any(not 0 <= int(t) < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"token ids must be in [0, {vocab_size})")
        if not is_int(self.logprobs, numpy=True) or not 0 <= self.logprobs <= 20:
            bad("logprobs", "must be an integer in 0..20")
        return self


def _row_key(seed, position):
    return jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), position)


SAMPLE_CANDIDATES = 64   # the fast path's candidate set (lax.top_k) before falling back to a full sort
TOPK_ROUND = 16          # XLA:GPU runs lax.top_k with k <= 16 as one TopK kernel; a larger k becomes a [B, V] sort


def top_k(x_BV, k: int):
    """(values, ids) of the k largest entries of each row, like ``lax.top_k``, in rounds of at most TOPK_ROUND
    (each round's winners masked to -inf before the next): on XLA:GPU a [32, 128k] lax.top_k with k = 20 is a
    segmented radix sort of every row (~0.8 ms, a tenth of a Llama-8B decode step), k <= 16 one TopK kernel.
    Same values in the same order as ``lax.top_k``; among equal values the ids may differ. Rows need at least k
    entries above -inf (logits and log-softmax rows have no -inf)."""
    if k <= TOPK_ROUND:
        return jax.lax.top_k(x_BV, k)
    rows = jnp.arange(x_BV.shape[0])[:, None]
    vals, ids = [], []
    for r in range(0, k, TOPK_ROUND):
        v, i = jax.lax.top_k(x_BV, min(TOPK_ROUND, k - r))
        vals.append(v)
        ids.append(i)
        if r + TOPK_ROUND < k:
            x_BV = x_BV.at[rows, i].set(-jnp.inf)
    return jnp.concatenate(vals, axis=-1), jnp.concatenate(ids, axis=-1)


def _keep_sorted(s_sorted_BC, lse_B1, top_k_B, top_p_B, min_p_B):
    """The tokens top-k / top-p / min-p keep, for rows sorted in descending order (the first is always kept)."""
    C = s_sorted_BC.shape[-1]
    p_sorted = jnp.exp(s_sorted_BC - lse_B1)                              # probabilities of the full distribution
    rank = jnp.arange(C)[None, :]
    keep = jnp.where(top_k_B[:, None] > 0, rank < top_k_B[:, None], True)
    cum_before = jnp.cumsum(p_sorted, axis=-1) - p_sorted
    keep &= cum_before < top_p_B[:, None]
    keep &= p_sorted >= min_p_B[:, None] * p_sorted[:, :1]
    return keep.at[:, 0].set(True)


def _choose(s_sorted_BC, ids_BC, lse_B1, gumbel_BV, top_k_B, top_p_B, min_p_B):
    """Applies top-k / top-p / min-p to rows sorted in descending order and draws with Gumbel-max.

    The noise is indexed by token id (not by rank), so a candidate subset and the full sort draw the same token.
    """
    keep = _keep_sorted(s_sorted_BC, lse_B1, top_k_B, top_p_B, min_p_B)
    g = jnp.take_along_axis(gumbel_BV, ids_BC, axis=-1)
    j = jnp.argmax(jnp.where(keep, s_sorted_BC + g, -jnp.inf), axis=-1)
    return jnp.take_along_axis(ids_BC, j[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _order_u32(x):
    """uint32 keys in the order of the float32 values (larger value, larger key; -0.0 just below +0.0)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _keep_by_threshold(scaled_BV, lse_B1, top_k_B, top_p_B, min_p_B, materialize: bool = False, bits: int = 2,
                       shared_mask: bool = False):
    """The tokens top-k / top-p / min-p keep, without a sort and without a runtime branch: the same rule as
    `_keep_sorted` over the order (value descending, id ascending). A token is kept iff the tokens before it in that
    order number fewer than top_k and weigh less than top_p; that holds for a prefix of the order, so it is found as
    the smallest value whose first token is kept, on the values' uint32 keys `bits` bits at a time (32 / bits rounds,
    each testing 2^bits - 1 candidate digits by a masked count and sum over the row); ties at that value are resolved
    in id order by an exclusive prefix sum. `bits` trades rounds for work per round.

    The count and the sum each get their own compare: XLA:GPU then fuses both into one reduction pass over the row.
    With one mask feeding both (`shared_mask=True`, kept for the benchmark) it writes the [B, 2^bits - 1, V] mask
    to memory every round and reads it back twice (GPU cost of each: benchmarks/bench_sampler.py)."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    B, V = scaled_BV.shape
    p = jnp.exp(scaled_BV - lse_B1)
    u = _order_u32(scaled_BV)
    if materialize:                      # computed once, not again inside each round's reductions
        p, u = jax.lax.optimization_barrier((p, u))
    k = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V).astype(jnp.int32)

    def dropped(v_BD):                   # is the first token of value v (in id order) dropped? monotone: falls with v
        u_B1V, v_BD1 = u[:, None, :], v_BD[:, :, None]
        n = jnp.sum(u_B1V > v_BD1, axis=-1, dtype=jnp.int32)
        m = jnp.sum(jnp.where((u_B1V > v_BD1) if shared_mask else (v_BD1 < u_B1V), p[:, None, :], 0.0), axis=-1)
        return (n >= k[:, None]) | (m >= top_p_B[:, None])
    # the largest v whose first token is dropped (v = 0 is: all V tokens lie above it), built from the top digit down
    last = jnp.zeros((B,), jnp.uint32)
    digits = jnp.arange(1, 1 << bits, dtype=jnp.uint32)
    for shift in range(32 - bits, -1, -bits):   # unrolled: a while loop's condition would be a device-to-host copy
        t_BD = last[:, None] + (digits[None, :] << shift)
        d = jnp.sum(dropped(t_BD), axis=-1, dtype=jnp.uint32)     # dropped for digits 1..d (monotone)
        last = last + (d << shift)
    v = (last + 1)[:, None]              # the smallest value whose first token is kept
    above, tie = u > v, u == v
    n_before = jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32) + jnp.cumsum(tie, axis=-1, dtype=jnp.int32) - tie
    pt = jnp.where(tie, p, 0.0)
    m_before = jnp.sum(jnp.where(above, p, 0.0), axis=-1, keepdims=True) + jnp.cumsum(pt, axis=-1) - pt
    keep = above | (tie & (n_before < k[:, None]) & (m_before < top_p_B[:, None]))
    keep &= p >= min_p_B[:, None] * jnp.max(p, axis=-1, keepdims=True)
    first = jnp.argmax(scaled_BV, axis=-1)
    return keep | (jnp.arange(V)[None, :] == first[:, None])


@functools.partial(jax.jit, static_argnames=("candidates", "branchless"))
def sample(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B, seed_B, position_B, *,
           candidates: int = SAMPLE_CANDIDATES, branchless: bool = False):
    """Returns (token_B int32, logprobs_BV float32 of the unmodified distribution).

    temperature 0 => argmax. top_k 0 => off. The PRNG key of row b is fold_in(key(seed_b), position_b).
    Cost: a batch of greedy rows is an argmax (runtime branch); otherwise the top `candidates` tokens per row
    (lax.top_k) decide whenever they provably hold every token the filters keep (top_k <= candidates, or the
    candidates' mass reaches top_p, or min_p cuts inside them); only then is the [B, V] sort skipped. Both paths
    give the same token for the same key. candidates=0 always sorts.

    branchless=True (the engine's choice on GPU): no runtime branch at all. XLA:GPU runs a conditional by copying
    its predicate to the host and waiting for the stream, so a step program holding one blocks its own dispatch
    until the device reaches the sampler, and the host cannot prepare the next step meanwhile. Every row is then
    sampled from the kept set of `_keep_by_threshold` (the same rule, found without a sort; the same Gumbel noise,
    so the same token as the sorted path unless float rounding moves a token at the top-p boundary).
    """
    logits = logits_BV.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    B, V = logits.shape
    C = min(candidates, V)
    if branchless:
        t = jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
        scaled = logits / t
        lse = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
        keys = jax.vmap(_row_key)(seed_B, position_B)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
        keep = _keep_by_threshold(scaled, lse, top_k_B, top_p_B, min_p_B)
        sampled_tok = jnp.argmax(jnp.where(keep, scaled + gumbel, -jnp.inf), axis=-1).astype(jnp.int32)
        return jnp.where(temperature_B > 0, sampled_tok, greedy_tok), logprobs

    def sampled():
        t = jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
        scaled = logits / t
        lse = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
        keys = jax.vmap(_row_key)(seed_B, position_B)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
        args = (lse, gumbel, top_k_B, top_p_B, min_p_B)

        def full():
            order = jnp.argsort(-scaled, axis=-1)
            return _choose(jnp.take_along_axis(scaled, order, axis=-1), order.astype(jnp.int32), *args)
        if C == 0:
            return full()
        cand_s, cand_i = jax.lax.top_k(scaled, C)
        p_c = jnp.exp(cand_s - lse)
        covered = _covered(p_c, top_k_B, top_p_B, min_p_B, temperature_B, C, V)
        return jax.lax.cond(jnp.all(covered), lambda: _choose(cand_s, cand_i.astype(jnp.int32), *args), full)

    sampled_tok = jax.lax.cond(jnp.all(temperature_B <= 0), lambda: greedy_tok, sampled)
    tok = jnp.where(temperature_B > 0, sampled_tok, greedy_tok)
    return tok, logprobs


def _covered(p_c, top_k_B, top_p_B, min_p_B, temperature_B, C, V):
    """Rows whose kept set provably lies inside their top-C candidates (then no [B, V] sort is needed)."""
    return (((top_k_B > 0) & (top_k_B <= C)) | (jnp.sum(p_c, axis=-1) >= top_p_B)
            | (p_c[:, -1] < min_p_B * p_c[:, 0]) | (C == V) | (temperature_B <= 0))


def _sampling_probs(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B, candidates):
    B, V = logits_BV.shape
    logits = logits_BV.astype(jnp.float32)
    t = jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
    scaled = logits / t
    lse = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
    C = min(candidates, V)
    rows = jnp.arange(B)[:, None]

    def keep_of(s_sorted, ids):
        keep = _keep_sorted(s_sorted, lse, top_k_B, top_p_B, min_p_B)
        return jnp.zeros((B, V), bool).at[rows, ids].set(keep)

    def full():
        order = jnp.argsort(-scaled, axis=-1)
        return keep_of(jnp.take_along_axis(scaled, order, axis=-1), order)
    if C == 0:
        keep_V = full()
    else:
        cand_s, cand_i = jax.lax.top_k(scaled, C)
        covered = _covered(jnp.exp(cand_s - lse), top_k_B, top_p_B, min_p_B, temperature_B, C, V)
        keep_V = jax.lax.cond(jnp.all(covered), lambda: keep_of(cand_s, cand_i), full)
    e = jnp.where(keep_V, jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), 0.0)
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    return jnp.where(temperature_B[:, None] > 0, probs, onehot)


def sampling_probs(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B, *, candidates: int = SAMPLE_CANDIDATES):
    """float32 [B, V]: the distribution ``sample`` draws each row from: softmax(logits / temperature) over the tokens
    top-k / top-p / min-p keep (the same keep rule as ``sample``), renormalized; greedy rows (temperature 0) one-hot
    at the argmax. Speculative decoding needs it whole: the draft's and the target's (rejection sampling)."""
    return _sampling_probs(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B, min(candidates, logits_BV.shape[1]))


# fold_in constant of the acceptance uniform: another stream than the row's Gumbel noise (the key itself)
_ACCEPT_STREAM = 0x5EC


def verify_draft(logits_BV, q_BV, draft_B, temperature_B, top_k_B, top_p_B, min_p_B, seed_B, position_B, *,
                 candidates: int = SAMPLE_CANDIDATES):
    """Speculative verification of one drafted token per row: (token_B int32, accepted_B bool).

    The target's distribution p (``sampling_probs`` of ``logits_BV``) and the draft's q (``q_BV``, the distribution
    the draft sampled ``draft_B`` from, same transforms) give the standard rejection rule: accept the draft with
    probability min(1, p(d) / q(d)); otherwise the token is drawn from the residual max(0, p - q) / Z. The emitted
    token is then distributed exactly as p. Greedy rows (temperature 0): accepted iff the draft is the argmax, and
    the token is the argmax. Randomness is per row from key(seed) folded with the position, as ``sample``: the
    uniform on its own stream, the residual draw Gumbel-max with the row key's noise."""
    B, V = logits_BV.shape
    greedy_tok = jnp.argmax(logits_BV.astype(jnp.float32), axis=-1).astype(jnp.int32)
    draft_B = draft_B.astype(jnp.int32)

    def sampled():
        p = _sampling_probs(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B, min(candidates, V))
        q = q_BV.astype(jnp.float32)
        pd = jnp.take_along_axis(p, draft_B[:, None], axis=-1)[:, 0]
        qd = jnp.take_along_axis(q, draft_B[:, None], axis=-1)[:, 0]
        keys = jax.vmap(_row_key)(seed_B, position_B)
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, _ACCEPT_STREAM), (), jnp.float32))(keys)
        accept = u * qd < pd
        resid = jnp.maximum(p - q, 0.0)
        resid = jnp.where(jnp.sum(resid, axis=-1, keepdims=True) > 0, resid, p)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
        r_tok = jnp.argmax(jnp.where(resid > 0, jnp.log(resid) + gumbel, -jnp.inf), axis=-1).astype(jnp.int32)
        return jnp.where(accept, draft_B, r_tok), accept

    s_tok, s_acc = jax.lax.cond(jnp.all(temperature_B <= 0), lambda: (greedy_tok, draft_B == greedy_tok), sampled)
    greedy = temperature_B <= 0
    return jnp.where(greedy, greedy_tok, s_tok), jnp.where(greedy, draft_B == greedy_tok, s_acc)


def keep_mask_numpy(logits_V: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """float64 numpy reference of the set of tokens sampling may return (for tests)."""
    z = logits_V.astype(np.float64) / (temperature if temperature > 0 else 1.0)
    order = np.argsort(-z, kind="stable")
    p = np.exp(z[order] - z[order][0])
    p /= p.sum()
    keep = np.ones_like(p, bool)
    if top_k > 0:
        keep[top_k:] = False
    keep &= (np.cumsum(p) - p) < top_p
    keep &= p >= min_p * p[0]
    keep[0] = True
    out = np.zeros_like(keep)
    out[order] = keep
    return out
