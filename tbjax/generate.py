"""`python -m tbjax.generate "prompt"`: generate text with the default model (or --model PATH) from the shell."""
from __future__ import annotations

import argparse
import sys
import time

from tbjax import cli


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=cli.prog("python -m tbjax.generate"), description=__doc__)
    ap.add_argument("prompt", nargs="+", help="prompt text (several prompts are generated as one batch)")
    ap.add_argument("--model", default=None, help="GGUF file, HF safetensors dir or tbjax checkpoint (default: SmolLM2)")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=None,
                    help="0 = greedy (default: the model's, see --generation-config)")
    ap.add_argument("--top-k", type=int, default=None, help="0 = off (default: the model's)")
    ap.add_argument("--top-p", type=float, default=None, help="default: the model's")
    ap.add_argument("--min-p", type=float, default=None, help="default: the model's")
    ap.add_argument("--generation-config", default="auto",
                    help="sampling defaults: auto (the model's generation_config.json / GGUF metadata / the default "
                         "model's card: temperature 0.2, top_p 0.9), none (temperature 1, no filters) or a "
                         "generation_config.json path; the flags above win")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16"])
    ap.add_argument("--weight-dtype", default=None, choices=["auto", "bf16", "float32", "fp8", "int8", "int4"],
                    help="resident weight format: auto = the checkpoint's own quantization (default unless --dtype is "
                         "given), bf16/float32 = dequantized at load, int8/int4/fp8 = converted at load")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens per step (default: 16384 on GPU / TPU, 512 on CPU)")
    ap.add_argument("--num-pages", type=int, default=None, help="KV pages (default: from free device memory)")
    ap.add_argument("--kv-dtype", default="auto", help="auto (= weights dtype), bfloat16, float8_e4m3fn, float8_e5m2")
    args = ap.parse_args(argv)

    from tbjax.default_model import DefaultModelMissing
    from tbjax.llm import LLM
    from tbjax.sampling import SamplingParams, SamplingParamsError

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop)
        import dataclasses
        dataclasses.replace(params).validate()       # bad flags fail before the model loads
        t0 = time.perf_counter()
        llm = LLM(args.model, dtype=args.dtype, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, num_pages=args.num_pages, progress=False,
                  generation_config=args.generation_config)
        t1 = time.perf_counter()
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outs = llm.generate(args.prompt, params)
        t2 = time.perf_counter()
    except (DefaultModelMissing, SamplingParamsError, ValueError) as e:   # GenerationConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p, o in zip(args.prompt, outs):
        print(f"--- {p!r}\n{o.text}")
    n = sum(len(o.token_ids) for o in outs)
    print(f"[load {t1 - t0:.1f}s, generate {n} tokens in {t2 - t1:.2f}s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
