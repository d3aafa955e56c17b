#!/usr/bin/env bash
# The test suite as CI runs it: one pytest run per line of tests/groups.txt, each on its xdist workers (n=N on the
# line, default two; a file per worker). Separate runs keep each process's lifetime short: one process for the whole suite
# crashed late inside XLA:CPU in clean-clone runs on the 2-core box, never reproducibly alone.
# Extra arguments go to every pytest run (e.g. --durations=30).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
status=0     # every group runs; the script fails if any did
while read -r line; do
  case "$line" in ''|'#'*) continue;; esac
  dirs=()
  workers=2
  for d in $line; do
    case "$d" in n=*) workers="${d#n=}";; *) dirs+=("tests/$d");; esac
  done
  echo "== pytest -n $workers ${dirs[*]}"
  "$PY" -m pytest -q -n "$workers" --dist loadfile "$@" "${dirs[@]}" || status=1
done < tests/groups.txt
exit "$status"
