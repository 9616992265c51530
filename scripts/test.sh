#!/usr/bin/env bash
# Set up (or refresh) the virtualenv, check style and types, and run the tests.
#
#   bash scripts/test.sh               everything (what CI runs): ruff, mypy, the benchmark pages'
#                                      check, the unit tier with pyspark/Airflow/Prefect/MLflow
#                                      blocked, then the integration and e2e tiers in one pytest
#   bash scripts/test.sh -m unit       one selection only: the arguments go to pytest
#   bash scripts/test.sh -m "not e2e"  (the checks run first either way)
#   bash scripts/test.sh --coverage [ARGS]   the same under coverage.py, rank and agent
#                                      processes included; the report ends the run
#
# Every pytest run prints its wall time per tier and its 25 slowest tests.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
coverage=0
if [ "${1:-}" = "--coverage" ]; then
  coverage=1
  shift
fi
bash scripts/venv.sh
source scripts/env.sh

step() {
  local name="$1" started=$SECONDS status=0
  shift
  "$@" || status=$?
  echo "== step '$name': $((SECONDS - started)) s"
  return "$status"
}

report_coverage() {
  python -m coverage combine -q
  python -m coverage report --format=total | sed 's/^/line coverage of sparktorch_ops, %: /'
  python -m coverage report --skip-covered --sort=cover | tail -n 40
}

python=(python)
if [ "$coverage" = 1 ]; then
  # Every Python started from here is measured (coverage's patch = subprocess, in pyproject).
  export COVERAGE_FILE="$root/.state/coverage/data"
  rm -rf "$root/.state/coverage"
  mkdir -p "$root/.state/coverage"
  python=(python -m coverage run)
  trap report_coverage EXIT  # also when a step fails: the figures of what ran
fi

step ruff ruff check sparktorch_ops tests dags flows examples benchmarks
step benchmark-pages python benchmarks/run_all.py --markdown --check
# mypy (single-threaded, ~50 s from a clean clone) beside the first tests, on the other core.
mypy_log="$(mktemp)"
mypy_started=$SECONDS
(
  status=0
  mypy > "$mypy_log" 2>&1 || status=$?
  echo "$((SECONDS - mypy_started))" >> "$mypy_log.time"  # its own time, not the wait for it
  exit "$status"
) &
mypy_pid=$!
finish_mypy() {
  local status=0
  wait "$mypy_pid" || status=$?
  cat "$mypy_log"
  echo "== step 'mypy': $(cat "$mypy_log.time") s (beside the tests)"
  rm -f "$mypy_log" "$mypy_log.time"
  return "$status"
}
status=0
if [ "$#" -eq 0 ]; then
  step "unit tier (integrations blocked)" "${python[@]}" -m tests.support.blocked_unit_tier -q ||
    status=$?
  finish_mypy || status=$?
  if [ "$status" = 0 ]; then
    step "integration and e2e tiers" "${python[@]}" -m pytest -ra --durations=25 -m "not unit" ||
      status=$?
  fi
else
  step "pytest $*" "${python[@]}" -m pytest -ra --durations=25 "$@" || status=$?
  finish_mypy || status=$?
fi
exit "$status"
