"""Prompt logprobs (what ``echo`` with ``logprobs`` returns, e.g. for lm-eval's loglikelihood tasks).

The engine computes logprobs only for the tokens it samples. The logprob of each *prompt* token given the tokens
before it comes from one whole-sequence forward without a KV cache (``tbjax.model.forward_dense``) over the
engine's own parameters, run on the engine's thread (or in its process) between two steps (``EngineLoop.call``):
the prompt, padded at the end to a power-of-two bucket of at least 16 tokens (causal attention: padding changes
no earlier logit), so that one program per bucket is compiled, on first use. An engine on a decode mesh (several
devices, attention weights packed and sharded) runs the same forward through the engine's layer loop on its mesh
(``tbjax.model.mesh_forward.make_forward``): the prompt on the first device's block, padding segments on the
others. That compile happens after the
warm-up, and it and the forward stall the engine's batch meanwhile; the forward's logits take prompt x vocabulary
x 4 bytes of device memory.

An engine with a ``prompt_logprobs(token_ids, k)`` method (the test double, serving/fake_engine.py) answers for
itself. Stacked and per-layer weight buffers, and decode meshes, are covered
(tests/serving/test_http_prompt_logprobs.py); an engine without weights, or one whose forward fails (a layout not
covered), raises ``PromptLogprobsUnavailable`` naming why, and the HTTP front end answers 400 with it.
"""
from __future__ import annotations

import weakref

from pallas_kernels.utils import next_pow2
from tbjax.engine import Engine
from tbjax.engine.api import PromptScorer

__all__ = ["prompt_logprobs", "PromptLogprobsUnavailable", "TOP_K", "bucket"]

TOP_K = 20        # top logprobs computed per position (requests ask for up to Limits.max_logprobs <= 20)
MIN_BUCKET = 16

_fns: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()        # engine -> jitted dense forward + scores
_mesh_fns: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # engine -> (mesh forward, scores)


class PromptLogprobsUnavailable(ValueError):
    """This engine cannot compute prompt logprobs (the message says why)."""


def bucket(n: int, cap: int | None = None) -> int:
    b = next_pow2(n, MIN_BUCKET)
    return b if cap is None else max(n, min(b, cap))


def _forward_fn(engine):
    fn = _fns.get(engine)
    if fn is not None:
        return fn
    import jax
    import jax.numpy as jnp

    from tbjax.model import forward_dense

    spec = engine.spec

    @jax.jit
    def f(params, tokens_T):
        logits, _ = forward_dense(params, spec, tokens_T)
        lp = jax.nn.log_softmax(logits[:-1].astype(jnp.float32), axis=-1)      # position t predicts token t + 1
        tok = jnp.take_along_axis(lp, tokens_T[1:, None], axis=-1)[:, 0]
        top_v, top_i = jax.lax.top_k(lp, TOP_K)
        return tok, top_v, top_i

    _fns[engine] = f
    return f


def _scores_fn():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def f(logits_TV, tokens_T):
        lp = jax.nn.log_softmax(logits_TV[:-1].astype(jnp.float32), axis=-1)
        tok = jnp.take_along_axis(lp, tokens_T[1:, None], axis=-1)[:, 0]
        top_v, top_i = jax.lax.top_k(lp, TOP_K)
        return tok, top_v, top_i
    return f


def _mesh_forward(engine, padded):
    """The forward on the engine's decode mesh: (token logprobs, top values, top ids) for ``padded`` (one block)."""
    import jax.numpy as jnp
    import numpy as np

    from sharding.mesh import axes_size
    from tbjax.model import mesh_forward as mf

    runner = engine.runner
    plan, mesh = runner.plan, runner.mesh
    if engine not in _mesh_fns:
        _mesh_fns[engine] = (mf.make_forward(plan, mesh, engine.params), _scores_fn())
    fwd, scores = _mesh_fns[engine]
    nb = axes_size(plan.mesh_dict, plan.layout.batch_axes)
    n = len(padded)
    tokens = np.zeros((nb * n,), np.int32)
    tokens[:n] = padded
    positions = np.tile(np.arange(n, dtype=np.int32), nb)
    segments = np.repeat(np.arange(nb, dtype=np.int32), n)     # one segment per device: none straddles two
    logits, _ = fwd(engine.params, tokens, positions, segments)
    return scores(logits[:n], jnp.asarray(padded))


def _on_mesh(engine) -> bool:
    plan, mesh = engine.runner.plan, engine.runner.mesh
    return plan is not None and mesh is not None and (plan.packed or mesh.devices.size > 1)


def prompt_logprobs(engine, token_ids: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Per prompt token: None for the first, then (logprob of the token given the ones before it, the ``k`` most
    likely tokens there as [(id, logprob)]). Runs on the engine's thread (``EngineLoop.call``)."""
    if isinstance(engine, PromptScorer):
        return engine.prompt_logprobs(list(token_ids), k)
    if not 0 <= k <= TOP_K:
        raise ValueError(f"prompt logprobs: k must be in 0..{TOP_K}, got {k}")
    if not isinstance(engine, Engine):
        raise PromptLogprobsUnavailable(f"prompt logprobs (echo with logprobs) need the model's weights; this server's "
                                        f"engine ({type(engine).__name__}) has none")
    import numpy as np

    ids = [int(t) for t in token_ids]
    T = len(ids)
    if T < 2:
        return [None] * T
    spec, params = engine.spec, engine.params
    n = bucket(T, spec.max_position)
    padded = np.zeros((n,), np.int32)
    padded[:T] = ids
    try:
        if _on_mesh(engine):
            tok, top_v, top_i = _mesh_forward(engine, padded)
        else:
            tok, top_v, top_i = _forward_fn(engine)(params, padded)
    except Exception as e:  # noqa: BLE001 - a parameter layout the forward does not take
        raise PromptLogprobsUnavailable(f"prompt logprobs (echo with logprobs) are not available with this engine's "
                                        f"parameter layout (a whole-sequence forward over them failed: "
                                        f"{type(e).__name__}: {str(e)[:200]})") from None
    tok, top_v, top_i = np.asarray(tok), np.asarray(top_v), np.asarray(top_i)
    out: list = [None]
    for t in range(T - 1):
        out.append((float(tok[t]), [(int(a), float(b)) for a, b in zip(top_i[t, :k], top_v[t, :k])]))
    return out
