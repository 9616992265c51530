"""Test DAG: barrier mode over Spark Connect, from a ``spark_connect`` Airflow connection.

Run in its own process (``airflow dags test sto_connect``, with ``AIRFLOW_CONN_SPARK_CONNECT_TEST``
naming a Spark Connect server), so that the test process gets no Connect client state and no
SparkContext of its own is reused instead of the Connect session.
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import DAG

from sparktorch_ops.airflow import TorchDistributorOperator


def all_reduce_ranks() -> dict[str, object]:
    """Every rank adds ``rank + 1`` with gloo; rank 0 returns the sum and the world size."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    print(f"training started on rank {rank}", flush=True)
    dist.init_process_group("gloo")
    try:
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        print(f"rank {rank} all-reduced {total.item():g}", flush=True)
        return {"sum": total.item(), "world_size": dist.get_world_size()}
    finally:
        dist.destroy_process_group()


with DAG(
    dag_id="sto_connect",
    schedule=None,
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
) as dag:
    TorchDistributorOperator(
        task_id="over_connect",
        train=all_reduce_ranks,
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        conn_id="spark_connect_test",
        start_timeout=120,
    )
