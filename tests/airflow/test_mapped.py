"""TorchDistributorOperator as mapped tasks (``dag.test()`` of tests/airflow/dags/sto_mapped.py):
every mapped instance trains, with its own value, result key and checkpoint directory."""

from __future__ import annotations

from typing import Any

import pytest


def mapped_xcom(dag_id: str, run_id: str, task_id: str, map_index: int) -> Any:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(
                run_id=run_id,
                key="return_value",
                dag_ids=dag_id,
                task_ids=task_id,
                map_indexes=map_index,
            )
        ).first()
        return None if row is None else XComModel.deserialize_value(row)


@pytest.fixture
def mapped(capfd: pytest.CaptureFixture[str], run_dag: Any) -> Any:
    return run_dag(capfd, "sto_mapped")


def summaries(run: Any, task_id: str, count: int) -> list[dict[str, Any]]:
    return [mapped_xcom(run.dag_id, run.run_id, task_id, index) for index in range(count)]


def test_a_function_mapped_over_its_arguments_trains_every_instance(mapped: Any) -> None:
    assert mapped.state == "success", mapped.log[-3000:]
    found = summaries(mapped, "over_args", 2)
    assert [s["value"]["factor"] for s in found] == [0.1, 0.2]
    # Each instance has its own checkpoint directory (keyed by its map index) and run.
    directories = [s["checkpoint"]["dir"] for s in found]
    assert len(set(directories)) == 2
    assert all(f"over_args.{index}~" in d for index, d in enumerate(directories)), directories
    assert len({s["run_id"] for s in found}) == 2


def test_mapped_over_num_processes_and_over_a_scripts_arguments(mapped: Any) -> None:
    sizes = summaries(mapped, "over_processes", 2)
    assert [s["value"]["world_size"] for s in sizes] == [1, 2]
    assert [s["num_processes"] for s in sizes] == [1, 2]
    scripts = summaries(mapped, "over_script", 2)
    assert [s["value"].strip() for s in scripts] == ["script got first", "script got second"]
