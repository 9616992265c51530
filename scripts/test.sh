#!/usr/bin/env bash
# Set up (or refresh) the virtualenv, check style and types, and run the tests.
#
#   bash scripts/test.sh               everything (what CI runs): ruff and the benchmark pages'
#                                      check, then the integration and e2e tiers in one pytest
#                                      (failing when it takes over 1,100 s of the reference
#                                      machine, scaled by the unit tier's time beside it),
#                                      with mypy, the unit tier (pyspark/Airflow/Prefect/MLflow
#                                      blocked) and the oldest version row's set-up beside it on
#                                      the other core; then the core subset on that row
#                                      (scripts/compat.sh oldest)
#   bash scripts/test.sh -m unit       one selection only: the arguments go to pytest
#   bash scripts/test.sh -m "not e2e"  (ruff, the pages' check and mypy run either way)
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
  python -m coverage report --skip-covered --sort=-cover | tail -n 40
}

python=(python)
if [ "$coverage" = 1 ]; then
  # Every Python started from here is measured (coverage's patch = subprocess, in pyproject).
  export COVERAGE_FILE="$root/.state/coverage/data"
  export SPARKTORCH_OPS_DIR="$root/sparktorch_ops"  # what pyproject's [tool.coverage.run] measures
  rm -rf "$root/.state/coverage"
  mkdir -p "$root/.state/coverage"
  python=(python -m coverage run)
  trap report_coverage EXIT  # also when a step fails: the figures of what ran
fi

step ruff ruff check sparktorch_ops tests harness dags flows examples benchmarks
step benchmark-pages python benchmarks/run_all.py --markdown --check
# Checks that need no services run beside the tests, on the other core (the long tiers leave
# about a fifth of two cores idle); each prints its output and its own time when it is waited for.
background_pids=()
background_names=()
background_logs=()
beside() {
  local name="$1" log started=$SECONDS
  shift
  log="$(mktemp)"
  (
    status=0
    "$@" > "$log" 2>&1 || status=$?
    echo "$((SECONDS - started))" > "$log.time"
    exit "$status"
  ) &
  background_pids+=("$!")
  background_names+=("$name")
  background_logs+=("$log")
}
finish_beside() {
  local i status=0 one
  for i in "${!background_pids[@]}"; do
    one=0
    wait "${background_pids[$i]}" || one=$?
    cat "${background_logs[$i]}"
    echo "== step '${background_names[$i]}': $(cat "${background_logs[$i]}.time") s (beside the tests)"
    rm -f "${background_logs[$i]}" "${background_logs[$i]}.time"
    [ "$one" = 0 ] || status=$one
  done
  return "$status"
}

status=0
# The unit tier's seconds beside the other tiers are this machine's yardstick: the time budget
# below is in the reference machine's seconds (tests/support/time_budget.py).
yardstick="$(mktemp)"
timed() {
  local into="$1" started=$SECONDS status=0
  shift
  "$@" || status=$?
  echo "$((SECONDS - started))" > "$into"
  return "$status"
}
beside mypy mypy  # single-threaded, ~50 s from a clean clone
if [ "$#" -eq 0 ]; then
  beside "unit tier (integrations blocked)" \
    timed "$yardstick" "${python[@]}" -m tests.support.blocked_unit_tier -q
  # The oldest row's virtualenv (mostly downloads, once per pin change) builds meanwhile.
  [ "$coverage" = 1 ] || beside "oldest version row, set up" bash scripts/compat.sh --setup oldest
  budget=()
  # The integration and e2e tiers' share of the 22-minute suite, in seconds of the reference
  # machine (scaled by the unit tier's time on a slower one); under coverage, times mean
  # nothing. Over it, the run fails and lists its 25 slowest tests (tests/support/time_budget.py).
  [ "$coverage" = 1 ] || budget=(--time-budget=1100 --time-yardstick-file="$yardstick")
  step "integration and e2e tiers" "${python[@]}" -m pytest -ra --durations=25 "${budget[@]}" \
    -m "not unit" || status=$?
  finish_beside || status=$?  # the row's set-up among them
  if [ "$coverage" = 0 ]; then
    step "oldest version row, core subset" bash scripts/compat.sh oldest || status=$?
  fi
else
  step "pytest $*" "${python[@]}" -m pytest -ra --durations=25 "$@" || status=$?
  finish_beside || status=$?
fi
rm -f "$yardstick"
exit "$status"
