"""Test DAGs of deferred trainings under the real scheduler (tests/airflow/test_real_scheduler.py).

``sto_deferred_train`` trains detached in barrier mode on an embedded Spark, deferred, in the
one-slot pool ``one_slot``; its ranks report a step every half second until the test writes
``<markers>/<dag id>.finish`` (so the test decides when it ends: after another DAG's task has
used the slot, and after a restart of the triggerer). ``sto_deferred_other`` is that other DAG: one task
in the same pool. ``sto_deferred_stopped`` trains deferred until the test clears it, and its
next try until the test marks it failed; ``sto_deferred_timeout`` until its
``execution_timeout`` runs out.
"""

from __future__ import annotations

import datetime
import os
import time

import pendulum
from airflow.sdk import DAG, task

from sparktorch_ops.airflow import TorchDistributorOperator

SPARK = {"spark.master": "local[2]", "spark.ui.enabled": "false"}
POOL = "one_slot"


def _mark(markers: str, name: str) -> None:
    path = os.path.join(markers, name)
    with open(path + ".tmp", "w") as handle:
        handle.write(f"{os.getpid()} {os.environ['SPARKTORCH_OPS_RUN_ID']}")
    os.replace(path + ".tmp", path)


def train_until_told(markers: str, name: str) -> dict[str, int]:
    """Mark this rank (``<name>.rank<N>.<pid>``: one per training), then report a step every
    half second until ``<markers>/<name>.finish`` exists (10 minutes at most)."""
    import torch.distributed as dist

    from sparktorch_ops import report

    rank = os.environ["RANK"]
    _mark(markers, f"{name}.rank{rank}.{os.getpid()}")
    dist.init_process_group("gloo")
    step, deadline = 0, time.monotonic() + 600
    while time.monotonic() < deadline:
        finish = [os.path.exists(os.path.join(markers, f"{name}.finish"))]
        dist.broadcast_object_list(finish, src=0)  # every rank stops at the same step
        if finish[0]:
            break
        report(step=step, loss=1.0 / (step + 1))
        step += 1
        time.sleep(0.5)
    dist.destroy_process_group()
    return {"steps": step}


def _train(dag_id: str, **task_args: object) -> DAG:
    with DAG(
        dag_id=dag_id,
        schedule=None,
        start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
        catchup=False,
        params={"markers": "/tmp", "mlflow": ""},
    ) as dag:
        TorchDistributorOperator(
            task_id="train",
            train=train_until_told,
            train_args=["{{ params.markers }}", dag_id],
            num_processes=2,
            local_mode=False,
            use_gpu=False,
            spark_conf=SPARK,
            deferrable=True,
            **task_args,  # type: ignore[arg-type]
        )
    return dag


sto_deferred_train = _train(
    "sto_deferred_train",
    pool=POOL,
    mlflow_tracking_uri="{{ params.mlflow }}",
    mlflow_experiment="sto-deferred",
)
sto_deferred_stopped = _train("sto_deferred_stopped")
# Long enough for the ranks to start on the slowest machines here while the other DAGs start
# and train (their sessions took about two minutes there).
sto_deferred_timeout = _train(
    "sto_deferred_timeout", execution_timeout=datetime.timedelta(seconds=150)
)

with DAG(
    dag_id="sto_deferred_other",
    schedule=None,
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
    params={"markers": "/tmp"},
) as sto_deferred_other:

    @task(pool=POOL)
    def use_the_slot(markers: str) -> float:
        """Note when it ran (in the pool's only slot)."""
        now = time.time()
        with open(os.path.join(markers, "other.ran"), "w") as handle:
            handle.write(str(now))
        return now

    use_the_slot("{{ params.markers }}")
