"""Tokenizer ids and chat template against transformers' tokenizer (stored reference), and vocab checks."""
import pytest

from tbjax.tokenizer import TextTokenizer, TokenizerError


def test_ids_equal_transformers(hf_ref, smollm_f32):
    meta, _ = hf_ref
    tok = smollm_f32[2]
    for s, ids in meta["tokenizer"].items():
        assert tok.encode(s) == ids, s
        if s:
            assert tok.decode(ids, skip_special_tokens=False) == s
    for p, ids in zip(meta["prompts"], meta["prompt_ids"]):
        assert tok.encode(p) == ids


def test_chat_template_renders_like_transformers(hf_ref, smollm_f32):
    meta, _ = hf_ref
    assert smollm_f32[2].apply_chat_template(meta["chat"], add_generation_prompt=True) == meta["chat_rendered"]
    with pytest.raises(TokenizerError, match="'role' and 'content'"):
        smollm_f32[2].apply_chat_template([{"text": "hi"}])


def test_tokenizer_vocab_must_match_model(smollm_f32):
    spec, _, tok = smollm_f32
    tok.check_model_vocab(spec.vocab_size)
    with pytest.raises(TokenizerError, match="do not belong together"):
        tok.check_model_vocab(32000)
    with pytest.raises(TokenizerError, match="do not belong together"):
        tok.check_model_vocab(128256)
    with pytest.raises(TokenizerError, match="out of vocabulary"):
        tok.decode([1, spec.vocab_size + 5])


def test_tokenizer_from_dir_and_errors(tmp_path, smollm_f32):
    tok = smollm_f32[2]
    tok.tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>", "chat_template": "{{ messages[0].content }}"}')
    t2 = TextTokenizer.from_dir(str(tmp_path))
    assert t2.encode("Hello, world!") == tok.encode("Hello, world!")
    assert t2.eos_token_ids == (2,)
    assert t2.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        TextTokenizer.from_dir(str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerError, match="cannot parse"):
        TextTokenizer.from_dir(str(bad))


@pytest.mark.parametrize("kind", ["window", "stream"])
def test_incremental_text_equals_full_decode(smollm_f32, kind):
    """IncrementalText (a few tokens decoded per step) and StreamText (tokenizers' DecodeStream, the engine's choice)
    against tokenizers' full decode of the whole output: every step's text is the complete-UTF-8 prefix of the full
    decode, and the final text is the full decode. Outputs mix ASCII, multi-byte characters split over byte-level
    tokens, random ids and special tokens."""
    import numpy as np
    from tbjax.engine.detokenize import IncrementalText, StreamText, incremental_text
    tok = smollm_f32[2]
    assert isinstance(incremental_text(tok), StreamText)
    dec = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = np.random.default_rng(0)
    texts = ["Hello, world! ", "naïve café — 東京 🚀🚀 ", "  leading spaces\nand\ttabs ", "ÀÉÎÕÜ ß ∑∫ 😀 "]
    for trial in range(12):
        ids = []
        for _ in range(4):
            pick = rng.integers(0, 3)
            if pick == 0:
                ids += tok.encode(texts[rng.integers(0, len(texts))], add_special_tokens=False)
            elif pick == 1:
                ids += [int(x) for x in rng.integers(0, 49152, rng.integers(1, 6))]
            else:
                ids += [0, 2]                                   # special tokens, skipped in the text
        it = IncrementalText(dec) if kind == "window" else StreamText(tok)
        for n in range(1, len(ids) + 1):
            got = it.update(ids[:n], final=n == len(ids))
            full = dec(ids[:n])
            assert full.startswith(got), (trial, n)
            if not full.endswith("\ufffd"):
                assert got == full, (trial, n)
        assert it.text == dec(ids)


def test_stream_text_names_ids_outside_the_vocabulary(smollm_f32):
    """A sampled id the tokenizer does not have (a model whose embedding is padded past it) is an error naming it."""
    from tbjax.engine.detokenize import StreamText
    tok = smollm_f32[2]
    st = StreamText(tok)
    st.update(tok.encode("Hi", add_special_tokens=False))
    with pytest.raises(TokenizerError, match=str(tok.vocab_size + 3)):
        st.update(tok.encode("Hi", add_special_tokens=False) + [tok.vocab_size + 3])
