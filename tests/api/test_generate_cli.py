"""`python -m tbjax.generate` end to end (in process, same engine shapes as the shared fixture so no new compile)."""
from tbjax.generate import main

ARGS = ["--dtype", "float32", "--num-pages", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]


def test_generate_cli_prints_the_greedy_continuation(capsys, hf_ref, smollm_llm):
    meta, _ = hf_ref
    assert main(ARGS + ["--temperature", "0", "--max-tokens", "6", "The capital of France is"]) == 0
    out = capsys.readouterr().out
    assert smollm_llm.tokenizer.decode(meta["greedy"][0][:6]) in out


def test_generate_cli_rejects_bad_params(capsys):
    assert main(ARGS + ["--top-p", "0", "hi"]) == 2
    assert "top_p" in capsys.readouterr().err
