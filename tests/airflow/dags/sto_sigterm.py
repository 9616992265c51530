"""Test DAG: a long run that the test stops with SIGTERM (Airflow's handler calls on_kill)."""

from __future__ import annotations

import os
import time

import pendulum
from airflow.sdk import DAG

from sparktorch_ops.airflow import TorchDistributorOperator


def train_forever() -> None:
    """Each rank announces itself, then trains (sleeps) far longer than the test waits."""
    print(f"training started on rank {os.environ['RANK']}", flush=True)
    time.sleep(600)


with DAG(
    dag_id="sto_sigterm",
    schedule=None,
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
) as dag:
    TorchDistributorOperator(
        task_id="train",
        train=train_forever,
        num_processes=2,
        use_gpu=False,
    )
