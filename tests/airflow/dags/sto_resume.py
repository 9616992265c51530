"""Test DAG: training that fails after a checkpoint on its first try; the retry resumes."""

from __future__ import annotations

import datetime

import pendulum
from airflow.sdk import DAG

from sparktorch_ops.airflow import TorchDistributorOperator
from tests.support.checkpointed import steps_with_one_failure

with DAG(
    dag_id="sto_resume",
    schedule=None,
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
    params={"marker": "", "results": ""},
) as dag:
    TorchDistributorOperator(
        task_id="train",
        train=steps_with_one_failure,
        train_args=[4, "{{ params.marker }}"],
        num_processes=2,
        use_gpu=False,
        result_location="{{ params.results }}",
        retries=1,
        retry_delay=datetime.timedelta(seconds=0),
    )
