#!/usr/bin/env bash
# One H200 call comparing the engine's decode step of this tree against an older tree (issue 14: "no slower than the
# previous runner"), each section under its own time limit (T_* seconds, 0 skips), JSON per section under $OUT:
#   old      .carry/old (git archive of the older commit) at the shapes $SHAPES, no transformers, no e2e; profiled at
#            $PROFILE_OLD (default none; PROFILE_NEW: the new tree's profiled shapes, default the first shape)
#   new      this tree, command buffers as the default says (EngineConfig.command_buffers "auto"), with the
#            Engine.step() end-to-end run and a profile of the first shape
#   nocb     this tree with command buffers off ("on" if the default is off): the other setting, same shapes
#   fp8      this tree with fp8 block-scaled weights (--weight-dtype fp8) at $FP8_SHAPES (issue 20: vs the bf16 "new")
#   hf       transformers (StaticCache + torch.compile) at $HF_SHAPES, for the tbjax / transformers ratio
# Usage (device tool, from the repo root, carry .carry):  TBJAX_COMMIT=$(git rev-parse --short HEAD) bash
#   benchmarks/run_step_h200.sh      (set TBJAX_COMMIT: the device copy has no .git)
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
SHAPES="${SHAPES:-32:1024,64:8192,1:1024}"
HF_SHAPES="${HF_SHAPES:-32:1024}"
OTHER_CB="${OTHER_CB:-off}"
B=benchmarks/bench_engine_decode.py
COMMON=(--shapes "$SHAPES" --ref-shape '' --compare-matmul '' --layer-buffers split --no-hf)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
if [ "${T_OLD:-70}" -gt 0 ] && [ -d .carry/old ]; then
  mkdir -p "$OUT/old"; (cd .carry/old && OUT="$OUT/old" timeout "${T_OLD:-70}" python3 $B "${COMMON[@]}" --e2e '' \
    --profile "${PROFILE_OLD:-}" --time-budget "$(( ${T_OLD:-70} - 10 ))" --out "$OUT/step_old.json" > "$OUT/old.log" 2>&1)
  echo "old: rc=$?"; grep -E "^\| |sync" "$OUT/old.log" | tail -8
fi
if [ "${T_NEW:-90}" -gt 0 ]; then
  timeout "${T_NEW:-90}" python3 $B "${COMMON[@]}" --e2e 32:1024 --profile "${PROFILE_NEW:-${SHAPES%%,*}}" \
    --time-budget "$(( ${T_NEW:-90} - 10 ))" --out "$OUT/step_new.json" > "$OUT/new.log" 2>&1
  echo "new: rc=$?"; grep -E "^\| |sync" "$OUT/new.log" | tail -8
fi
if [ "${T_NOCB:-60}" -gt 0 ]; then
  timeout "${T_NOCB:-60}" python3 $B "${COMMON[@]}" --e2e '' --profile '' --command-buffers "$OTHER_CB" \
    --time-budget "$(( ${T_NOCB:-60} - 10 ))" --out "$OUT/step_cb_$OTHER_CB.json" > "$OUT/cb.log" 2>&1
  echo "cb $OTHER_CB: rc=$?"; grep -E "^\| |sync" "$OUT/cb.log" | tail -8
fi
if [ "${T_FP8:-0}" -gt 0 ]; then
  timeout "$T_FP8" python3 $B "${COMMON[@]}" --shapes "${FP8_SHAPES:-32:1024,1:1024}" --e2e '' --profile '' \
    --weight-dtype fp8 --time-budget "$(( T_FP8 - 10 ))" --out "$OUT/step_fp8.json" > "$OUT/fp8.log" 2>&1
  echo "fp8 weights: rc=$?"; grep -E "^\| |sync" "$OUT/fp8.log" | tail -8
fi
if [ "${T_HF:-0}" -gt 0 ]; then
  timeout "${T_HF}" python3 $B --shapes '' --hf-shapes "$HF_SHAPES" --e2e '' --ref-shape '' --compare-matmul '' \
    --profile '' --time-budget "$(( T_HF - 10 ))" --hf-reserve "$(( T_HF - 15 ))" --out "$OUT/step_hf.json" \
    > "$OUT/hf.log" 2>&1
  echo "hf: rc=$?"; tail -5 "$OUT/hf.log"
fi
