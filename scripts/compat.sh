#!/usr/bin/env bash
# Run the tests against the version rows of requirements/compat/<row>.txt.
#
#   bash scripts/compat.sh [ROW...]          the core subset on each row (default: every row)
#   bash scripts/compat.sh --all [ROW...]    the integration tier instead of the subset
#   bash scripts/compat.sh --setup [ROW...]  only build (or reuse) each row's virtualenv
#
# Each row's virtualenv lives outside the clone (SPARKTORCH_COMPAT_CACHE, default
# ~/.cache/sparktorch_ops/compat) and is rebuilt only when its pins change. Each row's result
# (versions, counts, seconds) goes to docs/compatibility.json, and docs/compatibility.md is
# rendered from it with the date and the commit. Exits non-zero if any row failed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cache="${SPARKTORCH_COMPAT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sparktorch_ops/compat}"
selection=core
case "${1:-}" in
  --all) selection=integration; shift ;;
  --setup) selection=none; shift ;;
esac
rows=("$@")
if [ "${#rows[@]}" -eq 0 ]; then
  for file in requirements/compat/*.txt; do
    rows+=("$(basename "$file" .txt)")
  done
fi

# What the core subset proves on a row: local and barrier mode (local[2]), a standalone
# cluster whose workers have no sparktorch_ops, DataFrame input, a checkpoint resume after a
# crash, the Airflow operator under dag.test() and the Prefect task in a flow.
CORE=(
  "tests/integration/test_local_mode.py::test_env_contract_rank0_value_logs_and_metrics"
  "tests/integration/test_barrier_mode.py::test_barrier_env_contract_and_rank0_value"
  "tests/integration/test_dataframe.py::test_uneven_partitions_reach_every_rank_equally"
  "tests/integration/test_checkpoint.py::test_barrier_mode_resumes_after_a_crash_bit_for_bit"
  "tests/integration/test_cluster.py::test_executors_with_torch_but_no_working_sparktorch_ops_train_with_the_drivers_copy"
  "tests/airflow/test_operator.py::test_summary_is_pushed_with_the_rank0_value_and_metrics"
  "tests/prefect/test_task.py::test_dataframe_input_reaches_the_ranks_and_the_summary"
)

quiet_pip() {
  "$1/bin/python" -m pip "${@:2}" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}

# An interpreter of version $1 (3.12): on PATH, else one pyenv installed.
find_python() {
  local candidate
  for candidate in "python$1" "$HOME"/.pyenv/versions/"$1"*/bin/"python$1"; do
    if "$candidate" -c 'import sys' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  echo "no Python $1 on PATH or in ~/.pyenv/versions" >&2
  return 1
}

# Build (or reuse) the row's venv; prints its directory. Fails at the first step that fails.
row_venv() {
  local row="$1" file="requirements/compat/$1.txt" python want venv
  python="$(find_python "$(sed -n 's/^# python: *//p' "$file")")" || return 1
  want="$(cat "$file" requirements/no-deps.txt | sha256sum | cut -c1-12)"
  venv="$cache/$row-$want"
  if [ ! -f "$venv/.complete" ]; then
    rm -rf "$venv"
    mkdir -p "$cache"
    "$python" -m venv "$venv" >&2 || return 1
    quiet_pip "$venv" install -q --upgrade pip >&2 || return 1
    quiet_pip "$venv" install -q -r "$file" >&2 || return 1
    quiet_pip "$venv" install -q --no-deps -r requirements/no-deps.txt >&2 || return 1
    touch "$venv/.complete"
  fi
  # This clone's package, without touching the pins (an editable install follows the clone).
  if [ "$(cat "$venv/.clone" 2>/dev/null || true)" != "$root" ]; then
    quiet_pip "$venv" install -q --no-deps -e "$root" >&2 || return 1
    echo "$root" > "$venv/.clone"
  fi
  echo "$venv"
}

status=0
mkdir -p .state/compat
for row in "${rows[@]}"; do
  [ -f "requirements/compat/$row.txt" ] || { echo "no such row: requirements/compat/$row.txt" >&2; exit 2; }
  started=$SECONDS
  echo "== compat row '$row': setting up"
  if ! venv="$(row_venv "$row")"; then
    python3 scripts/compat_table.py record "$row" --not-built "$((SECONDS - started))" \
      --reason "its environment did not build (see the output above)"
    status=1
    continue
  fi
  built=$((SECONDS - started))
  if [ "$selection" = none ]; then
    echo "== compat row '$row': set up in $built s"
    continue
  fi
  if [ "$selection" = core ]; then
    tests=("${CORE[@]}")
  else
    tests=(-m integration)
  fi
  report=".state/compat/$row.xml"
  echo "== compat row '$row': ${tests[*]:0:2}..."
  row_status=0
  (
    export PATH="$venv/bin:$PATH" PYSPARK_PYTHON="$venv/bin/python"
    export PYSPARK_DRIVER_PYTHON="$venv/bin/python" SPARK_LOCAL_IP=127.0.0.1
    export PREFECT_SERVER_ANALYTICS_ENABLED=false PYTHONUNBUFFERED=1
    "$venv/bin/python" -m pytest -p no:cacheprovider -q -ra --junitxml="$report" "${tests[@]}"
  ) || row_status=$?
  "$venv/bin/python" scripts/compat_table.py record "$row" --junit "$report" \
    --setup-seconds "$built" --seconds "$((SECONDS - started))" --selection "$selection"
  echo "== compat row '$row': $((SECONDS - started)) s (setup $built s), exit $row_status"
  [ "$row_status" = 0 ] || status=$row_status
done
[ "$selection" = none ] || python3 scripts/compat_table.py render
exit "$status"
