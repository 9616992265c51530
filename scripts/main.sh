#!/usr/bin/env bash
# Set up (or refresh) the virtualenv and run the main job: the example scheduled retraining
# pipeline, once through Airflow (`airflow dags test` on its SQLite database) and once through
# Prefect (the flow as a script, on Prefect's ephemeral server). Both append the day's rows to a
# Parquet table, train with DDP in barrier mode on an embedded Spark (local[2]) through
# sparktorch_ops, track the training in MLflow (sqlite:///.state/mlflow.db unless
# MLFLOW_TRACKING_URI is set) and register the model there, moving its `champion` alias only when
# it beats the champion. State lives under .state/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/venv.sh
source scripts/env.sh
mkdir -p .state
export SPARKTORCH_STATE="${SPARKTORCH_STATE:-$root/.state}"

echo "== Airflow: airflow dags test retrain_digits"
# `dags test` serves Airflow's execution API in process through Starlette's test client, which
# warns that it wants httpx2: a note to Airflow's maintainers, not to whoever runs the DAG.
export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore::UserWarning:fastapi.testclient"
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
python flows/retrain_digits.py --once --state "$SPARKTORCH_STATE"

echo "== MLflow: the champion of digits-cnn"
python - <<'PY'
import os, sys
sys.path.insert(0, "examples")
import pipeline
state = os.environ["SPARKTORCH_STATE"]
print(f"{pipeline.champion(state)} in {pipeline.tracking_uri(state)}")
print(f"UI: mlflow ui --backend-store-uri {pipeline.tracking_uri(state)}")
PY
