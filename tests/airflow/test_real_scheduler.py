"""Under Airflow's real components: the scheduler with the LocalExecutor, the DAG processor and
the API server (harness/airflow_services.py), on SQLite. The example DAG runs on its
schedule; barrier-mode training is marked failed, times out and is retried, and no process of
a stopped try is left.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from harness.airflow_services import (
    AirflowServices,
    RankMarkers,
    RankWatcher,
    running_airflow,
    seconds_until_gone,
)
from tests.airflow.conftest import ROOT, TEST_DAGS

FAULT_DAGS = ("sto_scheduled_mark_failed", "sto_scheduled_timeout", "sto_scheduled_flaky")
ERROR_LEVELS = {"error", "critical", "exception", "fatal"}


@pytest.fixture(scope="module")
def airflow_services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowServices]:
    """The three components on a fresh home; the example DAG and tests/airflow/dags/sto_scheduled.py
    in its DAGs folder; pipeline state under the home."""
    home = tmp_path_factory.mktemp("airflow-services")
    extra = {"SPARKTORCH_STATE": str(home / "state"), "MLFLOW_TRACKING_URI": None}
    dag_files = [
        ROOT / "dags" / "retrain_digits.py",
        ROOT / "dags" / "sweep_digits.py",
        TEST_DAGS / "sto_scheduled.py",
    ]
    with running_airflow(home, dag_files, extra) as services:
        yield services


@pytest.fixture(scope="module")
def fault_runs(
    airflow_services: AirflowServices, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """One run of each fault DAG, triggered together (they train side by side)."""
    markers = RankMarkers(tmp_path_factory.mktemp("markers"))
    runs = {}
    for dag_id in FAULT_DAGS:
        airflow_services.wait_for_dag(dag_id)
        airflow_services.unpause(dag_id)
        runs[dag_id] = airflow_services.trigger(dag_id, {"markers": str(markers.path)})
    watcher = RankWatcher(airflow_services, markers, list(FAULT_DAGS))
    yield markers, runs, watcher
    watcher.stop()


def _levels(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(str(r.get("level", "")).lower(), str(r.get("event", ""))) for r in records]


def _errors(records: list[dict[str, Any]]) -> list[str]:
    return [event for level, event in _levels(records) if level in ERROR_LEVELS]


def test_the_example_dag_runs_on_its_schedule(
    airflow_services: AirflowServices, fault_runs: Any
) -> None:
    """Unpaused, the scheduler starts the nightly run (catchup=False: the latest interval);
    every task succeeds, the model is registered and promoted, and the logs are clean.
    (``fault_runs`` only starts the fault DAGs first, so that they train alongside.)"""
    dag_id = "retrain_digits"
    airflow_services.wait_for_dag(dag_id)
    airflow_services.unpause(dag_id)
    run = airflow_services.wait_until(
        "the scheduled run", lambda: airflow_services.runs(dag_id), 120
    )[0]
    assert run["run_type"] == "scheduled"
    run_id = run["dag_run_id"]
    assert airflow_services.wait_for_run(dag_id, run_id, timeout=1200) == "success", (
        airflow_services.task_states(dag_id, run_id)
    )
    states = airflow_services.task_states(dag_id, run_id)
    assert set(states.values()) == {"success"} and len(states) == 5, states
    finished = airflow_services.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")
    print(
        f"\nretrain_digits under the scheduler: {finished['start_date']} -> {finished['end_date']}"
    )

    publish = airflow_services.api(
        "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/publish/xcomEntries/return_value"
    )["value"]
    assert publish["version"] in (1, "1") and publish["promoted"] is True, publish

    train = _levels(airflow_services.task_log(dag_id, run_id, "train", 1))
    rank_lines = [(level, event) for level, event in train if event.startswith("[rank ")]
    assert any(event.startswith("[rank 0|") for _, event in rank_lines), train[-40:]
    # Ranks' stdout at INFO; their stderr (warnings, progress) at WARNING; nothing at ERROR.
    assert {level for level, _ in rank_lines} <= {"info", "warning"}, rank_lines
    assert any(level == "info" and "epoch" in event for level, event in rank_lines)
    for task_id in states:
        errors = _errors(airflow_services.task_log(dag_id, run_id, task_id, 1))
        assert errors == [], f"{task_id} succeeded but logged at ERROR: {errors}"
    # Spark's own lines and MLflow's notices are there, at their levels.
    assert ("warning", "spark jvm: Using incubator modules: jdk.incubator.vector") in train
    published = _levels(airflow_services.task_log(dag_id, run_id, "publish", 1))
    assert ("info", "Successfully registered model 'digits-cnn'.") in published, published


def test_marking_a_training_task_failed_stops_every_process_of_the_try(
    airflow_services: AirflowServices, fault_runs: Any
) -> None:
    _, runs, watcher = fault_runs
    dag_id = "sto_scheduled_mark_failed"
    processes, run_marker = watcher.processes(dag_id)
    assert len(processes) >= 4, processes  # the ranks, their launcher(s), the task process
    assert airflow_services.run_state(dag_id, runs[dag_id]) == "running"
    airflow_services.mark_failed(dag_id, runs[dag_id], "train")
    gone_after = seconds_until_gone(processes, run_marker, timeout=60)
    print(f"\nmark failed: the last process of the try was gone after {gone_after:.1f} s")
    assert airflow_services.task_instance(dag_id, runs[dag_id], "train")["state"] == "failed"
    assert airflow_services.wait_for_run(dag_id, runs[dag_id], timeout=120) == "failed"


def test_execution_timeout_stops_every_process_of_the_try(
    airflow_services: AirflowServices, fault_runs: Any
) -> None:
    _, runs, watcher = fault_runs
    dag_id = "sto_scheduled_timeout"
    # The try may have timed out already (the tests before this one take minutes).
    processes, run_marker = watcher.processes(dag_id)
    assert len(processes) >= 4  # the ranks, their launcher(s), the task process at least
    assert airflow_services.wait_for_run(dag_id, runs[dag_id], timeout=400) == "failed"
    seconds_until_gone(processes, run_marker, timeout=30)
    log = airflow_services.task_log(dag_id, runs[dag_id], "train", 1)
    assert any("timed out" in event.lower() for _, event in _levels(log)), _levels(log)[-30:]


def test_a_failed_training_try_is_retried_and_the_retry_trains(
    airflow_services: AirflowServices, fault_runs: Any
) -> None:
    markers, runs, _ = fault_runs
    dag_id = "sto_scheduled_flaky"
    assert airflow_services.wait_for_run(dag_id, runs[dag_id], timeout=600) == "success"
    instance = airflow_services.task_instance(dag_id, runs[dag_id], "train")
    assert (instance["state"], instance["try_number"]) == ("success", 2)
    assert len(markers.ranks(dag_id, 1)) >= 1 and len(markers.ranks(dag_id, 2)) == 2
    first = _levels(airflow_services.task_log(dag_id, runs[dag_id], "train", 1))
    assert any("fails on the first try" in event for _, event in first), first[-30:]
    second = airflow_services.task_log(dag_id, runs[dag_id], "train", 2)
    assert any(event.startswith("[rank 0|") for _, event in _levels(second))
    assert _errors(second) == []
    xcom = airflow_services.api(
        "GET",
        f"/dags/{dag_id}/dagRuns/{runs[dag_id]}/taskInstances/train/xcomEntries/return_value",
    )["value"]
    assert xcom["value"] == "trained on try 2", xcom


def test_the_sweep_dag_trains_its_learning_rates_at_once(
    airflow_services: AirflowServices,
) -> None:
    """The mapped trainings run side by side (LocalExecutor, parallelism 4), each with its own
    MLflow run, and the best is promoted only if it beats the champion."""
    from datetime import datetime

    dag_id = "sweep_digits"
    airflow_services.wait_for_dag(dag_id)
    airflow_services.unpause(dag_id)
    run_id = airflow_services.trigger(dag_id, {"epochs": 1})
    assert airflow_services.wait_for_run(dag_id, run_id, timeout=900) == "success", (
        airflow_services.task_states(dag_id, run_id)
    )
    mapped = airflow_services.api(
        "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/train/listMapped"
    )["task_instances"]
    assert sorted(ti["map_index"] for ti in mapped) == [0, 1, 2]
    assert {ti["state"] for ti in mapped} == {"success"}
    starts = [datetime.fromisoformat(ti["start_date"]) for ti in mapped]
    ends = [datetime.fromisoformat(ti["end_date"]) for ti in mapped]
    assert max(starts) < min(ends), list(zip(starts, ends, strict=True))  # all three overlapped
    record = airflow_services.api(
        "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/publish/xcomEntries/return_value"
    )["value"]
    versions = record["versions"]
    assert [v["params"]["lr"] for v in versions] == [0.02, 0.05, 0.1]
    assert len({v["run_id"] for v in versions}) == 3  # an MLflow run per mapped instance
    assert len({v["version"] for v in versions}) == 3
    best = max(versions, key=lambda v: v["metrics"]["accuracy"])
    assert record["best"]["version"] == best["version"]
    previous = record["previous"]
    beats = previous is None or best["metrics"]["accuracy"] > (previous["accuracy"] or 0.0)
    assert record["promoted"] is beats
