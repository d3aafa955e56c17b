"""Tokenizer (via the `tokenizers` library) from a tokenizer.json or from GGUF metadata, and chat templates.

No network: a GGUF-embedded BPE vocabulary + merges is rebuilt into a `tokenizers.Tokenizer`, with the pre-tokenizer
that its ``tokenizer.ggml.pre`` names (``GGUF_PRE_TOKENIZERS``: llama.cpp's regexes for gpt2, smollm / starcoder,
llama-bpe / llama3, qwen2, deepseek-v3, ...; any other name is refused with a clear error rather than tokenized
wrongly); ``tokenizer.ggml.eot_token_id`` / ``eom_token_id`` end a generation like eos.

Chat templates (Jinja, from GGUF metadata, ``chat_template.jinja`` or tokenizer_config.json) are rendered the way
transformers renders them (``chat_environment``): a jinja2 ``ImmutableSandboxedEnvironment`` with trim_blocks,
lstrip_blocks, the loopcontrols extension (``{% break %}`` / ``{% continue %}``) and ``{% generation %}`` blocks;
``tojson`` with transformers' arguments (ensure_ascii=False by default, indent, separators, sort_keys);
``raise_exception(msg)``, ``strftime_now(fmt)``; variables messages, tools, documents, add_generation_prompt, the
special tokens (bos_token, eos_token, ...) and any extra keyword arguments.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers


class TokenizerError(ValueError):
    pass


_GGUF_CONTROL = 3  # llama.cpp token_type: CONTROL (special tokens such as <|im_start|>)
_GGUF_USER_DEFINED = 4

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), applied in order, each piece split again by the next;
# the byte-level mapping follows. Written in the (Oniguruma) form Hugging Face tokenizer.json files use.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3_RES = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                  r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                  r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# name -> (regexes, ignore_merges): llama.cpp's tokenizer.ggml.pre names, grouped as its llama-vocab.cpp groups them
GGUF_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **{n: ((_GPT2_RE,), False) for n in ("default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo", "roberta-bpe")},
    **{n: ((r"\p{N}", _GPT2_RE), False) for n in ("smollm", "starcoder", "refact", "command-r", "codeshell",
                                                   "exaone", "minerva-7b")},
    **{n: ((_LLAMA3_RE,), True) for n in ("llama-bpe", "llama3", "llama-v3", "falcon3")},
    **{n: ((_LLAMA3_RE,), False) for n in ("dbrx", "smaug-bpe")},
    **{n: ((_QWEN2_RE,), False) for n in ("qwen2", "deepseek-r1-qwen", "stablelm2")},
    "deepseek-v3": (_DEEPSEEK3_RES, False),
}


def gguf_pre_tokenizer(pre: str | None):
    """(pre_tokenizer, ignore_merges) for a GGUF's ``tokenizer.ggml.pre`` (None / absent: gpt2's). Raises
    TokenizerError naming the supported ones for any other name."""
    name = "default" if pre is None else str(pre)
    if name not in GGUF_PRE_TOKENIZERS:
        raise TokenizerError(f"GGUF pre-tokenizer tokenizer.ggml.pre={name!r} is not supported; supported: "
                             f"{', '.join(sorted(GGUF_PRE_TOKENIZERS))} (load the model's Hugging Face directory, "
                             "whose tokenizer.json says how to pre-tokenize, instead)")
    regexes, ignore_merges = GGUF_PRE_TOKENIZERS[name]
    gpt2_last = regexes[-1] == _GPT2_RE          # gpt2's regex is ByteLevel's built-in one (as in tokenizer.json)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False)
              for r in (regexes[:-1] if gpt2_last else regexes)]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_last)
    return (pre_tokenizers.Sequence([*splits, byte_level]) if splits else byte_level), ignore_merges


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks assistant tokens for masks): rendered as
    its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: no HTML escaping (jinja's own escapes <, >, &, '), its arguments passed to json.dumps
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise TokenizerError(f"chat template: {message}")


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The Jinja environment chat templates are rendered in (as transformers sets it up)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map of byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


class TextTokenizer:
    """Encode/decode text and render chat templates. Wraps a `tokenizers.Tokenizer`. ``eos_token_ids``: every id that
    ends a generation (the engine stops on them), e.g. eos, eot and eom of a GGUF, or a generation_config's list."""

    def __init__(self, tk: Tokenizer, *, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, eos_token_ids: Sequence[int] = (), add_bos: bool = False,
                 special_tokens: dict[str, str] | None = None, byte_level: bool = True):
        self.tk = tk
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.add_bos = add_bos
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.byte_level = byte_level
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        self._template = None
        self._template_src = None

    def add_eos_token_ids(self, ids: Iterable[int]) -> None:
        """More ids that end a generation (kept after the current ones, no duplicates)."""
        self.eos_token_ids = tuple(dict.fromkeys([*self.eos_token_ids, *(int(i) for i in ids)]))

    # ---- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "TextTokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
        pre, ignore_merges = gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        tokens = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise TokenizerError("GGUF tokenizer has duplicate tokens")
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                  ignore_merges=ignore_merges))
        tk.pre_tokenizer = pre
        tk.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type")
        if types is not None:
            special = [AddedToken(tokens[i], special=True, normalized=False)
                       for i, t in enumerate(types) if int(t) in (_GGUF_CONTROL, _GGUF_USER_DEFINED)]
            tk.add_special_tokens(special)

        def tok(key):
            i = meta.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None
        ends = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return cls(tk, chat_template=meta.get("tokenizer.chat_template"), bos_token=tok("bos"), eos_token=tok("eos"),
                   eos_token_ids=[int(e) for e in ends if e is not None and 0 <= int(e) < len(tokens)],
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   special_tokens={"unk_token": tok("unknown"), "pad_token": tok("padding")})

    @classmethod
    def from_dir(cls, path: str, eos_token_ids: Sequence[int] = ()) -> "TextTokenizer":
        """tokenizer.json + tokenizer_config.json of a Hugging Face directory; the chat template from
        ``chat_template.jinja`` when there is one (as transformers does), else ``chat_template.json``, else
        tokenizer_config.json. ``eos_token_ids`` (e.g. config.json's) come first, then tokenizer_config's eos_token."""
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
        template = read_chat_template(path, cfg)
        eos = tokstr(cfg.get("eos_token"))
        ids = list(eos_token_ids)
        if eos is not None and tk.token_to_id(eos) is not None:
            ids.append(tk.token_to_id(eos))
        specials = {k: tokstr(cfg.get(k)) for k in ("unk_token", "pad_token", "sep_token", "cls_token", "mask_token")}
        return cls(tk, chat_template=template, bos_token=tokstr(cfg.get("bos_token")), eos_token=eos,
                   eos_token_ids=ids, add_bos=bool(cfg.get("add_bos_token", False)), special_tokens=specials,
                   byte_level=_is_byte_level(tk))

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

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (a byte-level BPE piece may be part of a UTF-8 character);
        special tokens give their text."""
        piece = self.tk.id_to_token(int(token_id))
        if piece is None:
            raise TokenizerError(f"token id {token_id} is out of vocabulary (size {self.vocab_size})")
        if self.byte_level and all(c in _BYTE_OF_CHAR for c in piece) and \
                self.tk.decode([int(token_id)], skip_special_tokens=True):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return self.tk.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    # ---- chat ------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True, *,
                            tools: Sequence[dict] | None = None, documents: Sequence[dict] | None = None,
                            **extra) -> str:
        """Render ``messages`` with the model's chat template in transformers' environment (``chat_environment``).
        Each message needs a 'role', and a 'content' unless it carries 'tool_calls'. ``extra`` keyword arguments
        become template variables (e.g. ``enable_thinking=False``)."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; use generate() with plain prompts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or ("content" not in m and "tool_calls" not in m):
                raise TokenizerError(f"chat message {i} must be a dict with 'role' and 'content', got {m!r}")
        if self._template is None or self._template_src != self.chat_template:
            try:
                self._template = chat_environment().from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise TokenizerError(f"chat template does not parse (line {e.lineno}): {e.message}") from None
            self._template_src = self.chat_template
        variables = {**self.special_tokens, "bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                     **extra}
        try:
            return self._template.render(messages=list(messages), tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except TokenizerError:
            raise
        except jinja2.TemplateError as e:   # undefined names used as callables, sandbox refusals, ...
            raise TokenizerError(f"chat template failed: {type(e).__name__}: {e}") from None


CHAT_TEMPLATE_FILE = "chat_template.jinja"


def read_chat_template(path: str, tokenizer_config: dict | None = None) -> str | None:
    """A Hugging Face directory's chat template: ``chat_template.jinja`` (transformers' own file, which wins), then
    ``chat_template.json`` ({"chat_template": ...}), then tokenizer_config.json's ``chat_template`` (a string, or a
    list of named templates: the one named "default")."""
    f = os.path.join(path, CHAT_TEMPLATE_FILE)
    if os.path.isfile(f):
        with open(f, encoding="utf-8") as fh:
            return fh.read()
    f = os.path.join(path, "chat_template.json")
    if os.path.isfile(f):
        with open(f, encoding="utf-8") as fh:
            t = json.load(fh).get("chat_template")
        if t:
            return t
    template = (tokenizer_config or {}).get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _is_byte_level(tk: Tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level (GPT-2 style pieces), from its serialized form."""
    try:
        decoder = json.loads(tk.to_str()).get("decoder")
    except Exception:  # noqa: BLE001
        return False
    return "ByteLevel" in json.dumps(decoder)


class StopStrings:
    """Stop strings applied to a generation's text above the engine (the LLM API and the servers give the engine
    none): the engine's text deltas go in, what may be handed out comes back. Text that could be the start of a stop
    string is held back until it is not (or the generation ends), so a stream never shows text that a stop string
    then takes back; a stop string found ends the generation there: its text and what follows are dropped, and
    only the tokens up to the one that completed it are kept (the caller then aborts the request in the engine).

    Why not the engine's own ``SamplingParams.stop``: a stop string that spans two steps makes the engine send the
    text before it again as one more delta (tbjax/engine/engine.py ``_emit``), and text it already sent is not held
    back. ``decode(ids)``: the output's text as the engine decodes it (special tokens skipped), used only to find the
    token that completed a stop string."""

    def __init__(self, stops: Iterable[str], decode):
        self.stops = [s for s in stops if s]
        self.decode = decode
        self.text = ""          # the engine's text so far
        self.sent = 0           # characters of it handed out
        self.ids: list[int] = []
        self.stopped = False

    def _held(self) -> int:
        """Length of the longest end of the text that is a proper start of a stop string."""
        t = self.text
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(t) - self.sent), best, -1):
                if t.endswith(s[:n]):
                    best = n
                    break
        return best

    def feed(self, new_ids: Sequence[int], text_delta: str, final: bool = False) -> tuple[list[int], str, bool]:
        """(token ids to hand out, text to hand out, stopped): ``final`` when the engine finished the request."""
        if self.stopped:
            return [], "", True
        n_before, before = len(self.ids), len(self.text)
        self.ids.extend(int(t) for t in new_ids)
        self.text += text_delta
        hit = None
        for s in self.stops:
            i = self.text.find(s, max(self.sent, before - len(s) + 1))
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, i + len(s))
        if hit is not None:
            k = len(self.ids)
            for j in range(n_before + 1, len(self.ids) + 1):   # the first token whose text completes the stop string
                if len(self.decode(self.ids[:j])) >= hit[1]:
                    k = j
                    break
            out = self.text[self.sent:hit[0]]
            kept = self.ids[n_before:k]
            del self.ids[k:]
            self.text, self.sent, self.stopped = self.text[:hit[0]], hit[0], True
            return kept, out, True
        end = len(self.text) if final else max(self.sent, len(self.text) - self._held())
        out = self.text[self.sent:end]
        self.sent = end
        return list(new_ids), out, False
