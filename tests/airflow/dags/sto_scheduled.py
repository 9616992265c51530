"""Test DAGs run by the real scheduler (tests/airflow/test_real_scheduler.py): barrier-mode
training on an embedded Spark (``local[2]``) that is marked failed, times out, or fails once
and is retried.

Each rank writes ``<markers>/<dag>.<try>.rank<N>`` (its pid and the run marker) before it
trains, so the test knows which processes to watch.
"""

from __future__ import annotations

import datetime
import os
import time

import pendulum
from airflow.sdk import DAG

from sparktorch_ops.airflow import TorchDistributorOperator

SPARK = {"spark.master": "local[2]", "spark.ui.enabled": "false"}


def announce_and_train(markers: str, name: str, try_number: int | str, seconds: float) -> str:
    """Write this rank's marker, print a line, then train (sleep) ``seconds``.

    A rank of a DAG whose name ends in ``flaky`` fails on the first try.
    """
    rank, try_number = os.environ["RANK"], int(try_number)  # a rendered template: a str
    path = os.path.join(markers, f"{name}.{try_number}.rank{rank}")
    with open(path + ".tmp", "w") as handle:
        handle.write(f"{os.getpid()} {os.environ['SPARKTORCH_OPS_RUN_ID']}")
    os.replace(path + ".tmp", path)
    print(f"training started on rank {rank} (try {try_number})", flush=True)
    if name.endswith("flaky") and try_number == 1:
        raise RuntimeError(f"rank {rank} fails on the first try")
    time.sleep(seconds)
    return f"trained on try {try_number}"


def _dag(dag_id: str, seconds: float, **task_args: object) -> DAG:
    with DAG(
        dag_id=dag_id,
        schedule=None,
        start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
        catchup=False,
        params={"markers": "/tmp"},
    ) as dag:
        TorchDistributorOperator(
            task_id="train",
            train=announce_and_train,
            train_args=["{{ params.markers }}", dag_id, "{{ ti.try_number }}", seconds],
            num_processes=2,
            local_mode=False,
            use_gpu=False,
            spark_conf=SPARK,
            **task_args,  # type: ignore[arg-type]
        )
    return dag


# Marked failed by the test while it trains.
sto_scheduled_mark_failed = _dag("sto_scheduled_mark_failed", 600)
# execution_timeout ends it while it trains.
sto_scheduled_timeout = _dag(
    "sto_scheduled_timeout", 600, execution_timeout=datetime.timedelta(seconds=75)
)
# The first try fails; Airflow retries it and the second try trains.
sto_scheduled_flaky = _dag(
    "sto_scheduled_flaky", 2, retries=1, retry_delay=datetime.timedelta(seconds=1)
)
