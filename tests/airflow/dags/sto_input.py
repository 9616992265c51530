"""Test DAG: the ranks train on a templated SQL query, read on a local[2] Spark session."""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import DAG

from sparktorch_ops.airflow import TorchDistributorOperator


def rows_seen(batch_size: int) -> dict[str, Any]:
    """Rank code: one epoch of partition_loader; the distinct ids all ranks saw, and the sum."""
    import torch.distributed as dist

    from sparktorch_ops.data import partition_loader

    dist.init_process_group("gloo")
    ids: list[int] = []
    total = 0.0
    for batch in partition_loader(batch_size):
        ids += batch["id"].tolist()
        total += float(batch["x"].sum())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ids)
    dist.destroy_process_group()
    distinct = sorted({i for rank_ids in gathered for i in rank_ids})
    return {"rows": len(distinct), "max_id": distinct[-1], "rank0_sum": total}


with DAG(
    dag_id="sto_input",
    schedule=None,
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
    params={"n": 12},
) as dag:
    TorchDistributorOperator(
        task_id="on_sql",
        train=rows_seen,
        train_args=[4],
        num_processes=2,
        use_gpu=False,
        input_sql="SELECT id, CAST(id AS DOUBLE) AS x FROM range({{ params.n }}) "
        "WHERE '{{ ds_nodash }}' LIKE '20%'",
        spark_conf={"spark.master": "local[2]", "spark.ui.enabled": "false"},
    )
