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
  local name="$1" started=$SECONDS
  shift
  "$@"
  echo "== step '$name': $((SECONDS - started)) s"
}

python=(python)
if [ "$coverage" = 1 ]; then
  # Every Python started from here is measured (coverage's patch = subprocess, in pyproject).
  export COVERAGE_FILE="$root/.state/coverage/data"
  rm -rf "$root/.state/coverage"
  mkdir -p "$root/.state/coverage"
  python=(python -m coverage run)
fi

step ruff ruff check sparktorch_ops tests dags flows examples benchmarks
step mypy mypy
step benchmark-pages python benchmarks/run_all.py --markdown --check
if [ "$#" -eq 0 ]; then
  step "unit tier (integrations blocked)" "${python[@]}" -m tests.support.blocked_unit_tier -q
  step "integration and e2e tiers" "${python[@]}" -m pytest -ra --durations=25 -m "not unit"
else
  step "pytest $*" "${python[@]}" -m pytest -ra --durations=25 "$@"
fi
if [ "$coverage" = 1 ]; then
  python -m coverage combine -q
  python -m coverage report --format=total | sed 's/^/line coverage of sparktorch_ops, %: /'
  python -m coverage report --skip-covered --sort=cover | tail -n 40
fi
