"""What the operator derives from its task instance: MLflow tags, its keys, its checkpoints.

A task instance is (dag, run, task, map index); each of its tries has its own result key and
shares the instance's default checkpoint directory, so a retry resumes and a new DAG run
starts fresh.
"""

from __future__ import annotations

from typing import Any

from sparktorch_ops.airflow import storage


def _map_index(ti: Any) -> int:
    index = getattr(ti, "map_index", -1)
    return -1 if index is None else int(index)


def mlflow_tags(ti: Any) -> dict[str, str]:
    """MLflow tags that find the task try that trained."""
    tags = {
        "airflow.dag_id": ti.dag_id,
        "airflow.run_id": ti.run_id,
        "airflow.task_id": ti.task_id,
        "airflow.try_number": str(ti.try_number),
    }
    if _map_index(ti) >= 0:
        tags["airflow.map_index"] = str(_map_index(ti))
    return tags


def result_key(ti: Any) -> str:
    """Where this try's stored value goes under the result location (see storage)."""
    return storage.result_key(ti.dag_id, ti.run_id, ti.task_id, _map_index(ti), ti.try_number)


def default_location(ti: Any, result_location: str, area: str, training_id: str | None) -> str:
    """The task instance's own directory in ``area`` (``checkpoints``: its ``checkpoint_dir``;
    ``runs``: a deferred training's run directory), kept across its tries; a durable
    training's own under it (a cleared task's new training starts afresh)."""
    location = storage.task_instance_location(
        result_location, area, ti.dag_id, ti.run_id, ti.task_id, _map_index(ti)
    )
    return location if training_id is None else f"{location.rstrip('/')}/{training_id}"
