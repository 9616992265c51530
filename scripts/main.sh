#!/usr/bin/env bash
# Set up (or refresh) the virtualenv and run the main job: the example scheduled retraining
# pipeline, once through Airflow (`airflow dags test` on its SQLite database) and once through
# Prefect (the flow as a script, on Prefect's ephemeral server). Both train with DDP on 2 ranks
# through sparktorch_ops and publish to the same model registry (.state/registry), promoting a
# model only when it beats the current one. State lives under .state/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/venv.sh
source scripts/env.sh
mkdir -p .state
export SPARKTORCH_REGISTRY="${SPARKTORCH_REGISTRY:-$root/.state/registry}"

echo "== Airflow: airflow dags test retrain_digits"
export AIRFLOW_HOME="$root/.state/airflow"
export AIRFLOW__CORE__DAGS_FOLDER="$root/dags"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
airflow db migrate > "$root/.state/airflow-db-migrate.log" 2>&1
airflow dags test retrain_digits

echo "== Prefect: python flows/retrain_digits.py --once"
export PREFECT_HOME="$root/.state/prefect"
export PREFECT_LOCAL_STORAGE_PATH="$root/.state/prefect/storage"
# The ephemeral server gets 20 s to start by default; a loaded machine (seen here) needs more.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-120}"
python flows/retrain_digits.py --once

echo "== registry: $SPARKTORCH_REGISTRY"
cat "$SPARKTORCH_REGISTRY/current.json"
