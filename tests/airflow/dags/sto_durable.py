"""Test DAG: durable and deferred trainings under ``dag.test()`` (tests/airflow/test_durable.py).

``stored_then_crash`` trains once; its first try then fails in ``post_execute`` (after the
summary is stored, before Airflow pushes the XCom, as a worker dying there would), and the retry
returns the stored summary without training. ``not_durable`` fails its first try and trains
afresh on the second, as before durable retries. ``deferred`` trains detached while its task
waits in the trigger (``deferrable=True``).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import pendulum
from airflow.sdk import DAG

from sparktorch_ops.airflow import TorchDistributorOperator


def count_training(directory: str, try_number: int | str, fail_first: bool) -> str:
    """Append a line to ``<directory>/trained`` per training; fail the first try if asked."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "trained"), "a") as handle:
        handle.write(f"try {try_number}\n")
    print(f"rank {os.environ['RANK']} trained on try {try_number}", flush=True)
    if fail_first and int(try_number) == 1:
        raise RuntimeError("the first try fails")
    return f"trained on try {try_number}"


def fail_on_the_first_try(context: Any, result: Any) -> None:
    if context["ti"].try_number == 1:
        raise RuntimeError("the worker died after the training's summary was stored")


with DAG(
    dag_id="sto_durable",
    schedule=None,
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
    params={"dir": "/tmp", "mlflow": ""},
) as dag:
    retry = {"retries": 1, "retry_delay": datetime.timedelta(seconds=0)}
    TorchDistributorOperator(
        task_id="stored_then_crash",
        train=count_training,
        train_args=["{{ params.dir }}/stored", "{{ ti.try_number }}", False],
        use_gpu=False,
        post_execute=fail_on_the_first_try,
        **retry,  # type: ignore[arg-type]
    )
    TorchDistributorOperator(
        task_id="not_durable",
        train=count_training,
        train_args=["{{ params.dir }}/not_durable", "{{ ti.try_number }}", True],
        use_gpu=False,
        durable=False,
        mlflow_tracking_uri="{{ params.mlflow }}",
        mlflow_experiment="sto-not-durable",
        **retry,  # type: ignore[arg-type]
    )
    TorchDistributorOperator(
        task_id="deferred",
        train=count_training,
        train_args=["{{ params.dir }}/deferred", "{{ ti.try_number }}", False],
        num_processes=2,
        use_gpu=False,
        deferrable=True,
    )
