"""Speculative decoding with the sliding-window self draft: acceptance rate and decode tokens/s, speculation on vs
off, per batch size; and the draft's KV bytes per sequence (windowed ring vs full attention) from the planner.

  python benchmarks/bench_speculative.py --platform cpu --shapes 1 --prompt-tokens 320 --max-tokens 48
  python benchmarks/bench_speculative.py --platform gpu --shapes 1,8,32 --json spec_h200.json

Prompts are natural text (a public-domain paragraph repeated with variations) longer than the window, so the
draft sees less context than the target. Decode tokens/s counts generated tokens over the wall time of the steps
after every request's first token (prefill excluded); every step program is compiled before timing.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import write_json  # noqa: E402

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
        "was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything "
        "before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the "
        "other way. ")
TOPICS = ["a lighthouse keeper", "the history of bread", "a chess tournament", "rain in the mountains",
          "an old clockmaker", "the first train", "a garden in winter", "the night market"]


def _prompts(tok, n, prompt_tokens):
    out = []
    for i in range(n):
        ids = tok.encode(f"Write about {TOPICS[i % len(TOPICS)]}. " + TEXT * 40)
        out.append(ids[:prompt_tokens])
    return out


def _reset_counters(eng):
    sd = eng.spec_decoder
    if sd is not None:
        for k in ("num_draft_tokens", "num_accepted_tokens", "num_verify_steps", "num_emitted_tokens",
                  "num_verify_entries", "num_draft_steps", "num_rebuilds"):
            setattr(sd, k, 0)
    return eng


def run_once(spec, params, tok, batch, args, speculative):
    from tbjax.engine import Engine, EngineConfig
    from tbjax.sampling import SamplingParams
    cfg = EngineConfig(num_pages=args.num_pages, max_num_seqs=max(batch, 1),
                       max_num_batched_tokens=args.budget, speculative=speculative)
    eng = Engine(spec, params, tok, cfg)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=1, ignore_eos=True)
    t0 = time.perf_counter()
    if args.warmup:
        eng.warmup()
    else:    # compile only what this workload runs: the same requests once, untimed (other prompts: no cache hits)
        for i, p in enumerate(_prompts(tok, batch, args.prompt_tokens)):
            eng.add_request(("warm", i), p[::-1], sp)
        while eng.has_unfinished():
            eng.step()
        eng = _reset_counters(eng)
    compile_s = time.perf_counter() - t0
    for i, p in enumerate(_prompts(tok, batch, args.prompt_tokens)):
        eng.add_request(i, p, sp)
    first, n_tok, t_start, steps = set(), 0, None, 0
    while eng.has_unfinished():
        outs = eng.step()
        for o in outs:
            if o.request_id in first:
                n_tok += len(o.new_token_ids)
            elif o.new_token_ids:
                first.add(o.request_id)
        if t_start is None and len(first) == batch:
            t_start = time.perf_counter()
            n_tok = 0
        elif t_start is not None:
            steps += 1
    dt = time.perf_counter() - t_start
    st = eng.stats()
    return {"batch": batch, "speculative": bool(speculative), "decode_tokens": n_tok, "decode_s": dt,
            "tokens_per_s": n_tok / dt if dt > 0 else 0.0, "decode_steps": steps, "compile_s": compile_s,
            "acceptance_rate": st.get("spec_acceptance_rate"), "tokens_per_verify": st.get("spec_tokens_per_step")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--platform", default="cpu", choices=["cpu", "gpu", "tpu"])
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--shapes", default="1", help="comma-separated batch sizes, e.g. 1,8,32")
    ap.add_argument("--num-tokens", type=int, default=4, help="drafted tokens per step (k)")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=320)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--budget", type=int, default=128, help="max_num_batched_tokens")
    ap.add_argument("--num-pages", type=int, default=None)
    ap.add_argument("--no-off", action="store_true", help="skip the runs without speculation")
    ap.add_argument("--warmup", action="store_true",
                    help="compile every step program first (default: run the workload once untimed, compiling only "
                         "the programs it uses)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    os.environ["JAX_PLATFORMS"] = {"gpu": "cuda"}.get(a.platform, a.platform)   # "gpu" would also try rocm
    import jax

    from tbjax.plan import draft_kv_bytes
    from tbjax.weights import load_model
    spec, params, tok = load_model(a.model, progress=False)
    if a.num_pages is None:
        a.num_pages = 2048 if a.platform != "cpu" else 512
    sc = {"draft": "self", "num_tokens": a.num_tokens, "window": a.window}
    rows = []
    for b in (int(x) for x in a.shapes.split(",")):
        for on in ((True,) if a.no_off else (False, True)):
            r = run_once(spec, params, tok, b, a, sc if on else None)
            rows.append(r)
            print(f"batch {b:3d} speculation {'on ' if on else 'off'}: {r['tokens_per_s']:8.1f} tok/s decode"
                  + (f", acceptance {r['acceptance_rate']:.3f}, {r['tokens_per_verify']:.2f} tokens/verify step"
                     if on else ""), flush=True)
    kv = [dict(context=c, **draft_kv_bytes(spec, c, window=a.window, num_tokens=a.num_tokens)) for c in
          (8192, 32768, 131072)]
    print(f"\n{'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'speedup':>8} {'accept':>7} {'tok/verify':>10}")
    for b in sorted({r["batch"] for r in rows}):
        off = next((r for r in rows if r["batch"] == b and not r["speculative"]), None)
        on = next((r for r in rows if r["batch"] == b and r["speculative"]), None)
        sp = on["tokens_per_s"] / off["tokens_per_s"] if off and on and off["tokens_per_s"] else float("nan")
        print(f"{b:5d} {off['tokens_per_s'] if off else float('nan'):10.1f} {on['tokens_per_s']:10.1f} {sp:8.2f} "
              f"{on['acceptance_rate']:7.3f} {on['tokens_per_verify']:10.2f}")
    print(f"\ndraft KV per sequence ({spec.arch}, window {a.window}, k={a.num_tokens}, bf16, page 16):")
    for k in kv:
        print(f"  context {k['context']:6d}: windowed {k['windowed_bytes'] / 2**20:7.2f} MiB vs full attention "
              f"{k['full_bytes'] / 2**20:9.2f} MiB")
    out = {"platform": a.platform, "device": str(jax.devices()[0].device_kind),
           "model": a.model or "default (SmolLM2-135M-Instruct)", "settings": vars(a), "runs": rows,
           "draft_kv_bytes": kv}
    if a.json:
        write_json(a.json, out)          # adds the commit (and date, host) fields
    return 0


if __name__ == "__main__":
    sys.exit(main())
