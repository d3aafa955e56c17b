"""Tokenizer (via the `tokenizers` library) from a tokenizer.json or from GGUF metadata, and chat templates.

No network: a GGUF-embedded BPE vocabulary + merges is rebuilt into a `tokenizers.Tokenizer`; the chat template
(Jinja, from GGUF metadata or tokenizer_config.json) is rendered with jinja2 in a sandbox.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers


class TokenizerError(ValueError):
    pass


_GGUF_CONTROL = 3  # llama.cpp token_type: CONTROL (special tokens such as <|im_start|>)
_GGUF_USER_DEFINED = 4


class TextTokenizer:
    """Encode/decode text and render chat templates. Wraps a `tokenizers.Tokenizer`."""

    def __init__(self, tk: Tokenizer, *, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, eos_token_ids: Sequence[int] = (), add_bos: bool = False):
        self.tk = tk
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        self._template = None

    # ---- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "TextTokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
        tokens = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise TokenizerError("GGUF tokenizer has duplicate tokens")
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type")
        if types is not None:
            special = [AddedToken(tokens[i], special=True, normalized=False)
                       for i, t in enumerate(types) if int(t) in (_GGUF_CONTROL, _GGUF_USER_DEFINED)]
            tk.add_special_tokens(special)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(tk, chat_template=meta.get("tokenizer.chat_template"),
                   bos_token=tokens[bos] if bos is not None else None,
                   eos_token=tokens[eos] if eos is not None else None,
                   eos_token_ids=(int(eos),) if eos is not None else (),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_dir(cls, path: str, eos_token_ids: Sequence[int] = ()) -> "TextTokenizer":
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise TokenizerError(f"no tokenizer.json in {path}")
        try:
            tk = Tokenizer.from_file(tj)
        except Exception as e:
            raise TokenizerError(f"{tj}: cannot parse tokenizer: {e}") from None
        cfg: dict[str, Any] = {}
        tc = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(tc):
            with open(tc) as f:
                cfg = json.load(f)

        def tokstr(x):
            return x.get("content") if isinstance(x, dict) else x
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        eos = tokstr(cfg.get("eos_token"))
        if not eos_token_ids and eos is not None and tk.token_to_id(eos) is not None:
            eos_token_ids = (tk.token_to_id(eos),)
        return cls(tk, chat_template=template, bos_token=tokstr(cfg.get("bos_token")), eos_token=eos,
                   eos_token_ids=eos_token_ids, add_bos=bool(cfg.get("add_bos_token", False)))

    def check_model_vocab(self, model_vocab_size: int, where: str = "model"):
        if self.vocab_size > model_vocab_size:
            raise TokenizerError(f"tokenizer has {self.vocab_size} tokens but the {where} embeds only "
                                 f"{model_vocab_size}: tokenizer and weights do not belong together")
        if model_vocab_size - self.vocab_size > 1024:
            raise TokenizerError(f"tokenizer has {self.vocab_size} tokens but the {where} embeds "
                                 f"{model_vocab_size}: tokenizer and weights do not belong together")

    # ---- text <-> ids ----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"expected str to encode, got {type(text).__name__}")
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token is not None:
            bid = self.tk.token_to_id(self.bos_token)
            if not ids or ids[0] != bid:
                ids = [bid] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token ids out of vocabulary (size {self.vocab_size}): {bad[:5]}")
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---- chat ------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True, **extra) -> str:
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; use generate() with plain prompts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise TokenizerError(f"chat message {i} must be a dict with 'role' and 'content', got {m!r}")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(msg):
                raise TokenizerError(f"chat template: {msg}")
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
