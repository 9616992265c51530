"""Test DAGs run by the real scheduler (tests/airflow/test_real_scheduler.py): barrier-mode
training on an embedded Spark (``local[2]``) that is marked failed, times out, or whose task
process is SIGKILLed mid-training and is retried.

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


def _mark(markers: str, name: str) -> None:
    """Write ``<markers>/<name>`` (this process's pid and the run marker) atomically."""
    path = os.path.join(markers, name)
    with open(path + ".tmp", "w") as handle:
        handle.write(f"{os.getpid()} {os.environ['SPARKTORCH_OPS_RUN_ID']}")
    os.replace(path + ".tmp", path)


def announce_and_train(markers: str, name: str, try_number: int | str, seconds: float) -> str:
    """Write this rank's marker, print a line, then train (sleep) ``seconds``."""
    rank, try_number = os.environ["RANK"], int(try_number)  # a rendered template: a str
    _mark(markers, f"{name}.{try_number}.rank{rank}")
    print(f"training started on rank {rank} (try {try_number})", flush=True)
    time.sleep(seconds)
    return f"trained on try {try_number}"


def train_until_killed(markers: str, name: str, try_number: int | str, steps: int) -> dict:
    """A step counter saved every step, each step's ``total`` reported; the first try marks
    ``<name>.1.committed3`` once step 3's checkpoint is committed, then waits to be killed.

    (The loop of tests/support/checkpointed.py, written out: under the real scheduler neither
    the DAG processor nor the ranks can import ``tests``.)
    """
    import torch
    import torch.distributed as dist

    from sparktorch_ops import checkpoint, report

    rank, try_number = os.environ["RANK"], int(try_number)
    _mark(markers, f"{name}.{try_number}.rank{rank}")
    dist.init_process_group("gloo")
    try:
        state = {"total": torch.zeros(1)}
        start = checkpoint.load_latest(state)
        ran = []
        for step in range(0 if start is None else start + 1, steps):
            state["total"] += step
            report(step=step, total=float(state["total"]))
            checkpoint.save(state, step)
            ran.append(step)
            if try_number == 1 and step == 3:
                if rank == "0":
                    _mark(markers, f"{name}.1.committed3")
                time.sleep(600)  # the test SIGKILLs the task process now
        return {"start": start, "ran": ran, "total": float(state["total"])}
    finally:
        dist.destroy_process_group()


def _dag(
    dag_id: str, seconds: float, train: object = announce_and_train, **task_args: object
) -> DAG:
    with DAG(
        dag_id=dag_id,
        schedule=None,
        start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
        catchup=False,
        params={"markers": "/tmp", "mlflow": ""},
    ) as dag:
        TorchDistributorOperator(
            task_id="train",
            train=train,  # type: ignore[arg-type]
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
# execution_timeout ends it while it trains: long enough for its session and ranks to start
# beside the module's other DAGs on the slowest machines here (about two minutes).
sto_scheduled_timeout = _dag(
    "sto_scheduled_timeout", 600, execution_timeout=datetime.timedelta(seconds=180)
)
# The test SIGKILLs the first try's task process mid-training; the retry continues the training.
sto_scheduled_durable = _dag(
    "sto_scheduled_durable",
    6,
    train_until_killed,
    retries=1,
    retry_delay=datetime.timedelta(seconds=0),
    mlflow_tracking_uri="{{ params.mlflow }}",
    mlflow_experiment="sto-durable",
)
