"""Test DAG: TorchDistributorOperator mapped with ``.partial().expand()`` and
``.expand_kwargs()``: over a function's arguments, over ``num_processes``, and over a script's
arguments (tests/airflow/test_mapped.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pendulum
from airflow.sdk import DAG

from sparktorch_ops.airflow import TorchDistributorOperator

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "echo_arg.py")


def scaled(factor: float) -> dict[str, Any]:
    """Rank 0's value: its argument and the run's size."""
    return {"factor": factor, "world_size": int(os.environ["WORLD_SIZE"])}


with DAG(
    dag_id="sto_mapped",
    schedule=None,
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
) as dag:
    TorchDistributorOperator.partial(task_id="over_args", train=scaled, use_gpu=False).expand(
        train_args=[[0.1], [0.2]]
    )
    TorchDistributorOperator.partial(
        task_id="over_processes", train=scaled, train_args=[1.0], use_gpu=False
    ).expand(num_processes=[1, 2])
    TorchDistributorOperator.partial(
        task_id="over_script", train=SCRIPT, use_gpu=False
    ).expand_kwargs([{"train_args": ["first"]}, {"train_args": ["second"]}])
