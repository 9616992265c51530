"""Test DAG: bad input fails each task at once, with no retry, before anything starts."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pendulum
from airflow.sdk import DAG

from sparktorch_ops import options
from sparktorch_ops.airflow import TorchDistributorOperator

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository (a symlink here)
from tests.support.launch_options import BAD


def never_runs() -> None:
    """A valid training function; the tasks fail before it could start."""
    raise AssertionError("the training must not start")


with DAG(
    dag_id="sto_bad_input",
    schedule=None,
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
    params={"n": "two", "dir": "/nonexistent-sparktorch-dir"},
    # Retryable failures would be retried at once; a bad input must not be.
    default_args={"retries": 3, "retry_delay": datetime.timedelta(seconds=0)},
) as dag:
    TorchDistributorOperator(
        task_id="unknown_conn",
        train=never_runs,
        local_mode=False,
        conn_id="no_such_spark_conn",
        num_processes=2,
        use_gpu=False,
    )
    TorchDistributorOperator(
        task_id="train_not_callable",
        train=42,  # type: ignore[arg-type]
        num_processes=2,
        use_gpu=False,
    )
    TorchDistributorOperator(
        task_id="missing_script",
        train="{{ params.dir }}/train-{{ ds_nodash }}.py",
        num_processes=2,
        use_gpu=False,
    )
    TorchDistributorOperator(
        task_id="num_processes_not_int",
        train=never_runs,
        num_processes="{{ params.n }}",
        use_gpu=False,
    )
    TorchDistributorOperator(
        task_id="two_inputs",
        train=never_runs,
        input_sql="SELECT * FROM range({{ params.n }})",
        input_table="events",
        use_gpu=False,
    )
    # One task per launch option, each with a value the job refuses: the operator passes every
    # option on (the task fails naming it).
    for option in options.on("operator"):
        TorchDistributorOperator(
            task_id=f"bad_{option.name}",
            train=never_runs,
            **{"use_gpu": False, option.name: BAD[option.name]},
        )
