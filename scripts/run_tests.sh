#!/usr/bin/env bash
# The test suite as CI runs it: one pytest run per line of tests/groups.txt, each on two xdist workers
# (a file per worker). Separate runs keep each process's lifetime short: one process for the whole suite
# crashed late inside XLA:CPU in clean-clone runs on the 2-core box, never reproducibly alone.
# Extra arguments go to every pytest run (e.g. --durations=30).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
while read -r line; do
  case "$line" in ''|'#'*) continue;; esac
  dirs=()
  for d in $line; do dirs+=("tests/$d"); done
  echo "== pytest ${dirs[*]}"
  "$PY" -m pytest -q -n 2 --dist loadfile "$@" "${dirs[@]}"
done < tests/groups.txt
