"""Test DAG: barrier mode on the Spark of an Airflow connection, then on the default fallback.

Run in its own process (one SparkContext per process): ``airflow dags test sto_cluster``, with
``AIRFLOW_CONN_SPARK_CLUSTER`` pointing at a standalone master.
"""

from __future__ import annotations

import os
import socket

import pendulum
from airflow.sdk import DAG

from sparktorch_ops.airflow import TorchDistributorOperator

HISTORY = "http://history.example:18080"


def where_am_i() -> dict[str, object]:
    """Rank 0 says how the run was laid out."""
    print(f"training started on rank {os.environ['RANK']}", flush=True)
    return {
        "world_size": int(os.environ["WORLD_SIZE"]),
        "host": socket.gethostname(),
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
    }


with DAG(
    dag_id="sto_cluster",
    schedule=None,
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
) as dag:
    on_cluster = TorchDistributorOperator(
        task_id="on_cluster",
        train=where_am_i,
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        conn_id="spark_cluster",
        spark_conf={"spark.sparktorch.historyServer.url": HISTORY},
        start_timeout=120,
    )
    # The default connection does not exist here: local Spark, in the same task process once
    # the first task has stopped its session.
    default_conn = TorchDistributorOperator(
        task_id="default_conn",
        train=where_am_i,
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        trigger_rule="all_done",
    )
    on_cluster >> default_conn
