"""Chat templates render in the environment transformers gives them (tbjax.tokenizer.chat_environment: sandbox,
trim/lstrip blocks, loopcontrols, {% generation %}, tojson with its arguments, strftime_now, raise_exception, the
special tokens, tools, extra variables), chat_template.jinja is read, and GGUF tokenizers honour tokenizer.ggml.pre
(llama.cpp's pre-tokenizer regexes) and eot / eom ids. The templates here are written for these tests."""
import datetime
import json

import pytest

from tbjax.tokenizer import GGUF_PRE_TOKENIZERS, TextTokenizer, TokenizerError, _bytes_to_unicode

FEATURES = """\
{%- set ns = namespace(n=0) -%}
{{ bos_token }}
{%- if tools %}<tools>{{ tools | tojson(indent=2) }}</tools>
{% endif -%}
{%- for m in messages %}
  {%- if m.role == 'stop' %}{% break %}{% endif %}
  {%- if m.role == 'skip' %}{% continue %}{% endif %}
  {%- set ns.n = ns.n + 1 %}
  {%- if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}{% endgeneration %}</a>
  {%- if m.tool_calls %}{{ m.tool_calls | tojson(sort_keys=true, separators=(',', ':')) }}{% endif %}
  {%- else %}<{{ m.role }}>{{ m.content | tojson }}{{ m.content | tojson(ensure_ascii=true) }}
  {%- endif %}
{%- endfor %}
[{{ ns.n }}]{{ eos_token }}{{ pad_token }}
{%- if add_generation_prompt %}<a>{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}
{%- endif %}"""


def _tok(template, **kw):
    from tokenizers import Tokenizer, models
    return TextTokenizer(Tokenizer(models.BPE()), chat_template=template, bos_token="<s>", eos_token="</s>",
                         special_tokens={"pad_token": "<pad>"}, **kw)


def test_template_features_render_like_transformers():
    t = _tok(FEATURES)
    msgs = [{"role": "user", "content": "héllo <b>"}, {"role": "skip", "content": "x"},
            {"role": "assistant", "content": "ok", "tool_calls": [{"b": 1, "a": {"z": 2, "y": 3}}]},
            {"role": "stop", "content": "-"}, {"role": "user", "content": "never"}]
    out = t.apply_chat_template(msgs, tools=[{"name": "f"}], enable_thinking=False)
    want = ('<s><tools>[\n  {\n    "name": "f"\n  }\n]</tools>\n'
            '<user>"héllo <b>""h\\u00e9llo <b>"'                        # no HTML escaping; ensure_ascii on request
            '<a>ok</a>[{"a":{"y":3,"z":2},"b":1}]'                      # sort_keys, separators; generation block
            '[2]</s><pad><a><nothink>')                                # break / continue; pad token; extra variable
    assert out == want
    assert t.apply_chat_template(msgs[:1], add_generation_prompt=False).endswith("[1]</s><pad>")


def test_strftime_now_and_raise_exception():
    t = _tok("{{ strftime_now('%Y') }}|{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}"
             "{% endif %}{{ messages[0].content }}")
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == f"{datetime.datetime.now():%Y}|hi"
    with pytest.raises(TokenizerError, match="chat template: first must be user"):
        t.apply_chat_template([{"role": "system", "content": "hi"}])


def test_sandbox_syntax_errors_and_message_checks():
    with pytest.raises(TokenizerError, match="chat template failed"):
        _tok("{{ ''.__class__.__mro__[1].__subclasses__() }}").apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerError, match="does not parse"):
        _tok("{% for m in messages %}").apply_chat_template([{"role": "user", "content": "x"}])
    t = _tok("{% for m in messages %}{{ m.role }}:{{ m.content }}{{ m.tool_calls | tojson }};{% endfor %}")
    # an assistant message with tool calls and no content is fine; a message without role is not
    assert t.apply_chat_template([{"role": "assistant", "tool_calls": [1]}]) == "assistant:[1];"
    with pytest.raises(TokenizerError, match="'role' and 'content'"):
        t.apply_chat_template([{"content": "x"}])
    with pytest.raises(TokenizerError, match="no chat template"):
        _tok(None).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_wins(tmp_path, smollm_f32):
    tok = smollm_f32[2]
    tok.tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": "from config"}))
    assert TextTokenizer.from_dir(str(tmp_path)).apply_chat_template([{"role": "u", "content": "x"}]) == "from config"
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}{{ pad_token }}")
    t = TextTokenizer.from_dir(str(tmp_path), eos_token_ids=(7,))
    assert t.apply_chat_template([{"role": "u", "content": "x"}]) == "[x]<|endoftext|>"
    assert t.eos_token_ids == (7, 2)                       # config.json's ids, then tokenizer_config's eos_token
    assert t.byte_level and t.token_bytes(t.encode("é")[0]) == "é".encode()


# -- GGUF tokenizers -------------------------------------------------------------------------------------------------
def _gguf_meta(pre=None, extra_tokens=(), merges=(), **more):
    chars = list(_bytes_to_unicode().values())
    tokens = chars + list(extra_tokens) + ["<|eot|>", "<|eom|>", "<|end|>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": list(merges),
            "tokenizer.ggml.token_type": [1] * (len(tokens) - 3) + [3, 3, 3],
            "tokenizer.ggml.eos_token_id": len(tokens) - 1, **more}
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta


def _pieces(meta, text):
    t = TextTokenizer.from_gguf_metadata(meta)
    return [p for p, _ in t.tk.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre, want", [
    (None, ["Hello", "Ġworld", "Ġ12345", "!!", "Ġit", "'s"]),            # gpt2's regex (no key: llama.cpp's default)
    ("gpt-2", ["Hello", "Ġworld", "Ġ12345", "!!", "Ġit", "'s"]),
    ("smollm", ["Hello", "Ġworld", "Ġ", "1", "2", "3", "4", "5", "!!", "Ġit", "'s"]),   # digits one by one
    ("llama-bpe", ["Hello", "Ġworld", "Ġ", "123", "45", "!!", "Ġit", "'s"]),            # digits in threes
    ("qwen2", ["Hello", "Ġworld", "Ġ", "1", "2", "3", "4", "5", "!!", "Ġit", "'s"]),
    ("deepseek-v3", ["Hello", "Ġworld", "Ġ", "123", "45", "!!", "Ġit", "'s"]),
])
def test_gguf_pre_tokenizers(pre, want):
    assert _pieces(_gguf_meta(pre), "Hello world 12345!! it's") == want


def test_gguf_llama3_case_insensitive_contractions_newlines_and_ignore_merges():
    assert _pieces(_gguf_meta("llama-bpe"), "I'M here\n\n  x") == ["I", "'M", "Ġhere", "ĊĊ", "Ġ", "Ġx"]
    assert _pieces(_gguf_meta("gpt-2"), "I'M here") == ["I", "'", "M", "Ġhere"]
    # llama3: a whole pre-token that is in the vocabulary is one token even without a merge path (ignore_merges)
    meta = dict(_gguf_meta("llama-bpe", extra_tokens=["Ġhello"]))
    assert TextTokenizer.from_gguf_metadata(meta).encode(" hello", add_special_tokens=False) == [256]
    meta = dict(_gguf_meta("gpt-2", extra_tokens=["Ġhello"]))
    assert len(TextTokenizer.from_gguf_metadata(meta).encode(" hello", add_special_tokens=False)) == 6


def test_gguf_unknown_pre_is_refused_and_eot_eom_end_generation():
    with pytest.raises(TokenizerError, match=r"tokenizer.ggml.pre='tekken' is not supported.*llama-bpe"):
        TextTokenizer.from_gguf_metadata(_gguf_meta("tekken"))
    n = 256
    t = TextTokenizer.from_gguf_metadata(_gguf_meta("llama3", **{"tokenizer.ggml.eot_token_id": n,
                                                                 "tokenizer.ggml.eom_token_id": n + 1}))
    assert t.eos_token_ids == (n + 2, n, n + 1) and t.eos_token == "<|end|>"
    assert t.decode(t.encode("a<|eot|>b", add_special_tokens=False)) == "ab"     # control tokens are special
    assert {"llama-bpe", "llama3", "qwen2", "smollm", "gpt-2", "deepseek-v3"} <= set(GGUF_PRE_TOKENIZERS)


def test_default_model_pre_tokenizer_matches_transformers(hf_ref, smollm_f32):
    """The default model's GGUF says tokenizer.ggml.pre='smollm' (digits split one by one, as its tokenizer.json's
    Digits pre-tokenizer): ids equal transformers' for the stored strings, digits included."""
    meta, _ = hf_ref
    tok = smollm_f32[2]
    for s, ids in meta["tokenizer"].items():
        assert tok.encode(s) == ids, s
    assert tok.encode("2024") == [tok.encode(d)[0] for d in "2024"]
