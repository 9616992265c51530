#!/usr/bin/env bash
# Environment shared by the main job and the tests: loopback-only Spark, the venv's Python on
# the executors, quiet Prefect telemetry, local state under .state/.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$root/.venv/bin:$PATH"
export SPARK_LOCAL_IP=127.0.0.1
export PYSPARK_PYTHON="$root/.venv/bin/python"
export PYSPARK_DRIVER_PYTHON="$root/.venv/bin/python"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PYTHONUNBUFFERED=1
