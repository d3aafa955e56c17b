"""Speculative decoding with the sliding-window self draft: acceptance rate and decode tokens/s, speculation on vs
off, per batch size; and the draft's KV bytes per sequence (windowed ring vs full attention) from the planner.

  python benchmarks/bench_speculative.py --platform cpu --shapes 1 --prompt-tokens 320 --max-tokens 48
  python benchmarks/bench_speculative.py --platform gpu --shapes 1,8,32 --time-budget 540 --json spec_h200.json

Prompts are natural text (a public-domain paragraph repeated with variations) longer than the window, so the
draft sees less context than the target. Decode tokens/s counts generated tokens over the wall time of the steps
after every request's first token (prefill excluded).

Compiles: by default every row's engine runs ``Engine.warmup()`` first (every step program of the target and the
draft, all token buckets, and the top-logprobs programs: nothing the timed part can run is left to compile) and then
the same requests reversed once, untimed (the first run of a freshly compiled program costs more than later ones,
without compiling: on the CPU, batch 1 with speculation, 24 tokens, 10.7-11.8 tok/s after the warm-up alone,
13.9-14.2 after both); ``--warmup full`` is the warm-up alone, ``--warmup replay`` the trial run alone (compiles
only the programs that run hits: the H200's timed part compiled the rest). Each row records the backend compiles JAX
reports (tbjax/compile_monitor.py) during the warm-up (with their seconds, summed over the compiles that run in
parallel), during prefill and during the timed part (``compiles_timed``: must be 0 for the tokens/s to mean
anything). ``--time-budget`` bounds the whole run: a row is skipped when the budget is spent or when the last row of
its kind (on / off) took longer than what is left, a decode that runs past it is cut (the row is recorded with
``cut``) and the rows after it skipped; the rows done so far are written to ``--json`` after every row. On
accelerators the compilation cache is on (``--compile-cache``): a second run loads the step programs the first one
compiled.
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
WARMUPS = ("both", "full", "replay")


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


def _warm(eng, tok, batch, args, sp) -> dict:
    """Compile before timing (``args.warmup``); returns the warm-up's wall seconds, compiles and compile seconds."""
    from tbjax import compile_monitor as cm
    c0, s0, t0 = cm.count(), cm.seconds(), time.perf_counter()
    programs = None
    if args.warmup in ("full", "both"):
        programs = eng.warmup()["programs"]
    if args.warmup in ("replay", "both"):   # the same requests reversed, untimed (other prompts: no cache hits)
        for i, p in enumerate(_prompts(tok, batch, args.prompt_tokens)):
            eng.add_request(("warm", i), p[::-1], sp)
        while eng.has_unfinished():
            eng.step()
        _reset_counters(eng)
    return {"warmup_s": time.perf_counter() - t0, "warmup_compiles": cm.count() - c0,
            "warmup_compile_s": cm.seconds() - s0, "warmup_programs": programs}


def run_once(spec, params, tok, batch, args, speculative, deadline):
    from tbjax import compile_monitor as cm
    from tbjax.engine import Engine, EngineConfig
    from tbjax.sampling import SamplingParams
    cfg = EngineConfig(num_pages=args.num_pages, max_num_seqs=max(batch, 1),
                       max_num_batched_tokens=args.budget, speculative=speculative)
    eng = Engine(spec, params, tok, cfg)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=1, ignore_eos=True)
    row = {"batch": batch, "speculative": bool(speculative), **_warm(eng, tok, batch, args, sp)}
    row["compile_s"] = row["warmup_s"]          # (the name earlier results used)
    if time.perf_counter() > deadline:
        return {**row, "cut": True, "tokens_per_s": None, "compiles_timed": None}
    c_start = cm.count()
    for i, p in enumerate(_prompts(tok, batch, args.prompt_tokens)):
        eng.add_request(i, p, sp)
    first, n_tok, t_start, steps, cut = set(), 0, None, 0, False
    c_timed = s_timed = None
    while eng.has_unfinished():
        if time.perf_counter() > deadline:
            cut = True
            for i in range(batch):
                eng.abort(i)
            break
        outs = eng.step()
        for o in outs:
            if o.request_id in first:
                n_tok += len(o.new_token_ids)
            elif o.new_token_ids:
                first.add(o.request_id)
        if t_start is None and len(first) == batch:
            t_start = time.perf_counter()
            c_timed, s_timed = cm.count(), cm.seconds()
            n_tok = 0
        elif t_start is not None:
            steps += 1
    t_end = time.perf_counter()
    dt = t_end - t_start if t_start is not None else 0.0
    st = eng.stats()
    row.update({"decode_tokens": n_tok, "decode_s": dt,
                "tokens_per_s": None if t_start is None else n_tok / dt if dt > 0 else 0.0,
                "decode_steps": steps,
                "compiles_prefill": (c_timed if c_timed is not None else cm.count()) - c_start,
                "compiles_timed": cm.count() - c_timed if c_timed is not None else None,
                "compile_s_timed": cm.seconds() - s_timed if s_timed is not None else None,
                "acceptance_rate": st.get("spec_acceptance_rate"), "tokens_per_verify": st.get("spec_tokens_per_step")})
    if cut:
        row["cut"] = True
    return row


def _fmt(v, spec=".1f", width=10):
    return f"{'-' if v is None else format(v, spec):>{width}}"


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
    ap.add_argument("--warmup", nargs="?", const="both", default="both", choices=WARMUPS,
                    help="before timing: full = Engine.warmup() (every program), replay = the workload reversed once "
                         "untimed (compiles only what it hits), both = full then replay (the default)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for the whole run (model loading included): rows that would start later are "
                         "skipped, a decode that runs past it is cut")
    ap.add_argument("--compile-cache", default="auto", choices=["auto", "on", "off"],
                    help="JAX's persistent compilation cache and tbjax's saved step programs (tbjax/compile_cache.py, "
                         "tbjax/engine/program_cache.py), so that a second run loads its programs: auto = on unless "
                         "on the CPU")
    ap.add_argument("--json", default=None, help="write the results here (after every row)")
    a = ap.parse_args(argv)
    t_begin = time.perf_counter()
    deadline = t_begin + a.time_budget if a.time_budget else float("inf")
    os.environ["JAX_PLATFORMS"] = {"gpu": "cuda"}.get(a.platform, a.platform)   # "gpu" would also try rocm
    import jax

    from tbjax import compile_monitor
    from tbjax.plan import draft_kv_bytes
    from tbjax.weights import load_model
    compile_monitor.install()
    if a.compile_cache == "on" or (a.compile_cache == "auto" and a.platform != "cpu"):
        from tbjax import compile_cache
        a.compile_cache = compile_cache.enable() or "off"      # (TBJAX_COMPILE_CACHE=0 keeps it off)
    spec, params, tok = load_model(a.model, progress=False)
    if a.num_pages is None:
        a.num_pages = 2048 if a.platform != "cpu" else 512
    sc = {"draft": "self", "num_tokens": a.num_tokens, "window": a.window}
    kv = [dict(context=c, **draft_kv_bytes(spec, c, window=a.window, num_tokens=a.num_tokens)) for c in
          (8192, 32768, 131072)]
    todo = [(b, on) for b in (int(x) for x in a.shapes.split(",")) for on in ((True,) if a.no_off else (False, True))]
    rows, skipped = [], []

    def save():
        if a.json:
            write_json(a.json, {"platform": a.platform, "device": str(jax.devices()[0].device_kind),
                                "model": a.model or "default (SmolLM2-135M-Instruct)", "settings": vars(a),
                                "runs": rows, "skipped": skipped, "draft_kv_bytes": kv,
                                "elapsed_s": time.perf_counter() - t_begin})   # adds the commit (and date, host)
    for n, (b, on) in enumerate(todo):
        name = f"batch {b:3d} speculation {'on ' if on else 'off'}"
        # a row is not started when the budget is spent, or when the last row of the same kind (warm-up included,
        # which cannot be interrupted) took longer than what is left
        same = [r["row_s"] for r in rows if r["speculative"] == on]
        if time.perf_counter() + (same[-1] if same else 0.0) > deadline or (rows and rows[-1].get("cut")):
            skipped = [{"batch": bb, "speculative": oo} for bb, oo in todo[n:]]
            print(f"time budget of {a.time_budget:.0f} s: {time.perf_counter() - t_begin:.0f} s spent, skipping "
                  + ", ".join(f"batch {bb} {'on' if oo else 'off'}" for bb, oo in todo[n:]), flush=True)
            break
        t_row = time.perf_counter()
        r = run_once(spec, params, tok, b, a, sc if on else None, deadline)
        r["row_s"] = time.perf_counter() - t_row
        rows.append(r)
        warm = (f"warm-up {r['warmup_s']:.1f} s ({r['warmup_compiles']} compiles, {r['warmup_compile_s']:.1f} s of "
                f"compiling summed over the parallel compiles)")
        if r.get("tokens_per_s") is None:
            print(f"{name}: {warm}; time budget spent before the timed part", flush=True)
        else:
            print(f"{name}: {r['tokens_per_s']:8.1f} tok/s decode"
                  + (f", acceptance {r['acceptance_rate']:.3f}, {r['tokens_per_verify']:.2f} tokens/verify step"
                     if on else "")
                  + f"; {warm}; timed compiles {r['compiles_timed']}"
                  + (" (cut by the time budget)" if r.get("cut") else ""), flush=True)
        save()
    print(f"\n{'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'speedup':>8} {'accept':>7} {'tok/verify':>10} "
          f"{'compiles_timed off/on':>21} {'warm-up s off/on':>17}")
    for b in sorted({r["batch"] for r in rows}):
        off = next((r for r in rows if r["batch"] == b and not r["speculative"]), {})
        on = next((r for r in rows if r["batch"] == b and r["speculative"]), {})
        o_t, n_t = off.get("tokens_per_s"), on.get("tokens_per_s")
        sp = n_t / o_t if o_t and n_t is not None else None
        ct = "/".join("-" if r.get("compiles_timed") is None else str(r["compiles_timed"]) for r in (off, on))
        ws = "/".join(f"{r['warmup_s']:.0f}" if r else "-" for r in (off, on))
        print(f"{b:5d} {_fmt(o_t)} {_fmt(n_t)} {_fmt(sp, '.2f', 8)} {_fmt(on.get('acceptance_rate'), '.3f', 7)} "
              f"{_fmt(on.get('tokens_per_verify'), '.2f')} {ct:>21} {ws:>17}"
              + (" cut" if off.get("cut") or on.get("cut") else ""))
    if skipped:
        print(f"skipped (time budget): {skipped}")
    print(f"\ndraft KV per sequence ({spec.arch}, window {a.window}, k={a.num_tokens}, bf16, page 16):")
    for k in kv:
        print(f"  context {k['context']:6d}: windowed {k['windowed_bytes'] / 2**20:7.2f} MiB vs full attention "
              f"{k['full_bytes'] / 2**20:9.2f} MiB")
    print(f"total {time.perf_counter() - t_begin:.0f} s")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
