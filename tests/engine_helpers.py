"""Test doubles for engine tests: a tiny random model at a real layer layout, a byte-level tokenizer, and the
reference greedy decoder (whole-sequence recompute with dense attention: no cache, no batching, no pages)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pallas_kernels.utils import next_pow2
from tbjax.model import forward_dense, init_params
from tbjax.spec import ModelSpec, RopeSpec
from tbjax.tokenizer import TextTokenizer


def tiny_spec(**kw) -> ModelSpec:
    base = dict(arch="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                ffn_dim=128, norm_eps=1e-5, rope=RopeSpec(theta=10000.0, rotary_dim=16), max_position=512,
                tie_embeddings=False, dtype="float32", eos_token_ids=())
    base.update(kw)
    return ModelSpec(**base).validate()


def byte_tokenizer() -> TextTokenizer:
    """A fixed id for each of ByteLevel's 256 characters (sorted: `ByteLevel.alphabet()` returns them in a different
    order on every call, tokenizers 0.23, and two instances must decode alike)."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return TextTokenizer(tk)


@functools.lru_cache(maxsize=None)
def tiny_model(seed=0, **kw):
    spec = tiny_spec(**kw)
    params = init_params(spec, jax.random.key(seed), "float32", std=0.25)
    return spec, params


def reference_greedy(spec, params, prompt, n):
    """Greedy decoding by full recompute (forward_dense over the whole sequence every step)."""
    f = _dense_fn(spec)
    ids = list(prompt)
    for _ in range(n):
        L = next_pow2(len(ids), lo=128)
        padded = np.zeros(L, np.int32)
        padded[:len(ids)] = ids   # causal: padding after the last token changes nothing before it
        lg = f(params, jnp.asarray(padded))
        ids.append(int(np.argmax(np.asarray(lg[len(ids) - 1]))))
    return ids[len(prompt):]


@functools.lru_cache(maxsize=None)
def _dense_fn(spec):
    return jax.jit(lambda p, t: forward_dense(p, spec, t)[0])
