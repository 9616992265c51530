"""Under Airflow's real components: the scheduler with the LocalExecutor, the DAG processor, the
API server and the triggerer (harness/airflow_services.py), on SQLite. The example DAG runs on
its schedule; barrier-mode training is marked failed, times out, and has its task process
SIGKILLed and is retried (a durable training), and no process of a stopped try is left; a
deferred training frees its slot, outlives a triggerer's SIGKILL, and stops when cleared,
marked failed or timed out.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from harness.airflow_services import (
    AirflowServices,
    RankMarkers,
    RankWatcher,
    running_airflow,
    seconds_until_gone,
    task_process_tree,
)
from tests.airflow.conftest import MIGRATED_DB, ROOT, TEST_DAGS

FAULT_DAGS = ("sto_scheduled_mark_failed", "sto_scheduled_timeout", "sto_scheduled_durable")
DEFERRED_DAGS = ("sto_deferred_train", "sto_deferred_stopped", "sto_deferred_timeout")
ERROR_LEVELS = {"error", "critical", "exception", "fatal"}


@pytest.fixture(scope="module")
def airflow_services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowServices]:
    """The three components on a fresh home; the example DAG and tests/airflow/dags/sto_scheduled.py
    in its DAGs folder; pipeline state under the home."""
    home = tmp_path_factory.mktemp("airflow-services")
    extra = {
        "SPARKTORCH_STATE": str(home / "state"),
        "MLFLOW_TRACKING_URI": None,
        "RETRAIN_DIGITS_DEFERRABLE": "true",  # the example as it ships
        # The example DAG, the sweep's three trainings and the fault DAGs run side by side.
        "AIRFLOW__CORE__PARALLELISM": "10",
        # A triggerer SIGKILLed: its successor takes its triggers over within seconds.
        "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "1",
        "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "5",
    }
    dag_files = [
        ROOT / "dags" / "retrain_digits.py",
        ROOT / "dags" / "sweep_digits.py",
        TEST_DAGS / "sto_scheduled.py",
        TEST_DAGS / "sto_deferred.py",
    ]
    with running_airflow(home, dag_files, extra, migrated_db=MIGRATED_DB) as services:
        yield services


class KillAfterStep3:
    """SIGKILLs the task process of ``sto_scheduled_durable``'s first try as soon as its step 3
    checkpoint is committed, whichever test runs then (as an OOM kill would: no ``on_kill``)."""

    def __init__(self, airflow: AirflowServices, markers: RankMarkers) -> None:
        self.dag_id = "sto_scheduled_durable"
        self.killed_at: float | None = None
        self.error: str | None = None
        self._airflow, self._markers = airflow, markers
        self._thread = threading.Thread(target=self._kill, daemon=True)
        self._thread.start()

    def _kill(self) -> None:
        marker = self._markers.path / f"{self.dag_id}.1.committed3"
        deadline = time.monotonic() + 900
        try:
            while not marker.exists():
                if time.monotonic() > deadline:
                    self.error = "step 3's checkpoint was never committed"
                    return
                time.sleep(0.1)
            rank_pid = self._markers.ranks(self.dag_id, 1)[0][0]
            scheduler = self._airflow.processes["scheduler"].pid
            task_process = task_process_tree(rank_pid, scheduler)[-1]
            os.kill(task_process.pid, signal.SIGKILL)
            self.killed_at = time.time()  # wall clock: compared with marker files' mtimes
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="module")
def fault_runs(
    airflow_services: AirflowServices, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """One run of each fault DAG, triggered together (they train side by side)."""
    markers = RankMarkers(tmp_path_factory.mktemp("markers"))
    mlflow = f"sqlite:///{markers.path / 'mlflow.db'}"
    runs = {}
    for dag_id in FAULT_DAGS:
        airflow_services.wait_for_dag(dag_id)
        airflow_services.unpause(dag_id)
        conf = {"markers": str(markers.path), "mlflow": mlflow}
        runs[dag_id] = airflow_services.trigger(dag_id, conf)
    watcher = RankWatcher(airflow_services, markers, list(FAULT_DAGS))
    killer = KillAfterStep3(airflow_services, markers)
    yield markers, runs, watcher, killer
    watcher.stop()


@pytest.fixture(scope="module")
def deferred_runs(
    airflow_services: AirflowServices, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RankMarkers, dict[str, str]]]:
    """The deferred trainings, triggered with the others (they train until told to end, or
    until cleared), and the one-slot pool the first one and ``sto_deferred_other`` share
    (a deferred task holds no slot of it: Airflow's default, ``include_deferred=False``).
    Afterwards any of their runs still going (a test failed) is cancelled: detached, they
    would outlive Airflow's processes."""
    from sparktorch_ops.detached import RunHandle

    markers = RankMarkers(tmp_path_factory.mktemp("deferred-markers"))
    airflow_services.api(
        "POST", "/pools", {"name": "one_slot", "slots": 1, "include_deferred": False}, ok=(201,)
    )
    conf = {"markers": str(markers.path), "mlflow": f"sqlite:///{markers.path / 'mlflow.db'}"}
    runs = {}
    for dag_id in (*DEFERRED_DAGS, "sto_deferred_other"):
        airflow_services.wait_for_dag(dag_id)
        airflow_services.unpause(dag_id)
    for dag_id in DEFERRED_DAGS:
        runs[dag_id] = airflow_services.trigger(dag_id, conf)
    yield markers, runs
    handles = [RunHandle(p.parent) for p in airflow_services.home.rglob("run.json")]
    for handle in handles:
        handle.cancel("the test is over")
    for handle in handles:
        with contextlib.suppress(Exception):  # a cancelled or failed run raises its error
            handle.wait(timeout=60)


def _deferred_and_training(
    airflow: AirflowServices, markers: RankMarkers, dag_id: str, run_id: str
) -> list[Path]:
    """Wait until ``dag_id``'s task is deferred and both its ranks train; their markers."""

    def ready() -> list[Path] | None:
        found = sorted(markers.path.glob(f"{dag_id}.rank*"))
        deferred = airflow.task_instance(dag_id, run_id, "train")["state"] == "deferred"
        return found if deferred and len(found) == 2 else None

    return list(airflow.wait_until(f"{dag_id} deferred and training", ready, 600, every=0.5))


@pytest.fixture(scope="module")
def sweep_run(airflow_services: AirflowServices, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A run of the sweep DAG, one epoch, on a state directory of its own (so that the example
    DAG's run registers the first version of the model), triggered alongside the others."""
    dag_id = "sweep_digits"
    airflow_services.wait_for_dag(dag_id)
    airflow_services.unpause(dag_id)
    state = tmp_path_factory.mktemp("sweep-state")
    run_id: str = airflow_services.trigger(dag_id, {"epochs": 1, "state": str(state)})
    return run_id


@pytest.fixture(scope="module")
def scheduled_example(airflow_services: AirflowServices) -> str:
    """The example DAG unpaused: the scheduler starts its nightly run; its id."""
    dag_id = "retrain_digits"
    airflow_services.wait_for_dag(dag_id)
    airflow_services.unpause(dag_id)
    return dag_id


@pytest.fixture(scope="module", autouse=True)
def everything_trains_alongside(
    fault_runs: Any, sweep_run: str, deferred_runs: Any, scheduled_example: str
) -> None:
    """Whichever test runs first starts every DAG: they train side by side while the tests,
    one after another, act on them and check them (those that act first; the triggerer's
    SIGKILL once the example's deferred training is over)."""


def _levels(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(str(r.get("level", "")).lower(), str(r.get("event", ""))) for r in records]


def _errors(records: list[dict[str, Any]]) -> list[str]:
    return [event for level, event in _levels(records) if level in ERROR_LEVELS]


def _stopped(
    airflow: AirflowServices, markers: RankMarkers, dag_id: str, run_id: str, how: str
) -> list[Path]:
    """Wait until the task is deferred and training, stop it ``how`` (``clear`` or
    ``mark_failed``), and wait until none of that training's processes is left; its markers."""
    ranks = _deferred_and_training(airflow, markers, dag_id, run_id)
    run_marker = ranks[0].read_text().split()[1]
    processes = [psutil.Process(int(path.read_text().split()[0])) for path in ranks]
    if how == "clear":
        airflow.api(
            "POST",
            f"/dags/{dag_id}/clearTaskInstances",
            {"dry_run": False, "dag_run_id": run_id, "task_ids": ["train"], "only_failed": False},
        )
    else:
        airflow.mark_failed(dag_id, run_id, "train")
    gone_after = seconds_until_gone(processes, run_marker, timeout=90)
    print(f"\n{how}: the deferred training's last process was gone after {gone_after:.1f} s")
    return ranks


def test_clearing_or_marking_a_deferred_training_failed_stops_it_with_nothing_left(
    airflow_services: AirflowServices, deferred_runs: Any
) -> None:
    """Clearing the deferred task calls its trigger's on_kill: the cancel request stops the
    training with none of its processes left, and the next try starts it over (once, even when
    it reattached before the request landed). Marking that try failed stops it the same way,
    and the run fails without another try."""
    markers, runs = deferred_runs
    dag_id, run_id = "sto_deferred_stopped", runs["sto_deferred_stopped"]
    first = _stopped(airflow_services, markers, dag_id, run_id, "clear")
    for path in first:  # try 2's ranks are the ones marked from now on
        path.unlink()
    _stopped(airflow_services, markers, dag_id, run_id, "mark_failed")
    assert airflow_services.wait_for_run(dag_id, run_id, timeout=120) == "failed"
    instance = airflow_services.task_instance(dag_id, run_id, "train")
    assert (instance["state"], instance["try_number"]) == ("failed", 2)
    assert len(list(markers.path.glob(f"{dag_id}.rank*"))) == 2  # try 2 trained, once


def test_marking_a_training_task_failed_stops_every_process_of_the_try(
    airflow_services: AirflowServices, fault_runs: Any
) -> None:
    _, runs, watcher, _ = fault_runs
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
    _, runs, watcher, _ = fault_runs
    dag_id = "sto_scheduled_timeout"
    # The try may have timed out already (the tests before this one take minutes).
    processes, run_marker = watcher.processes(dag_id)
    assert len(processes) >= 4  # the ranks, their launcher(s), the task process at least
    assert airflow_services.wait_for_run(dag_id, runs[dag_id], timeout=400) == "failed"
    seconds_until_gone(processes, run_marker, timeout=30)
    log = airflow_services.task_log(dag_id, runs[dag_id], "train", 1)
    assert any("timed out" in event.lower() for _, event in _levels(log)), _levels(log)[-30:]


def test_a_training_whose_task_process_is_killed_is_continued_by_the_retry(
    airflow_services: AirflowServices, fault_runs: Any
) -> None:
    """SIGKILL of the task process (no on_kill runs) right after step 3's checkpoint: the retry
    resumes from step 3 into the same MLflow run, which ends FINISHED with every step's
    metric; nothing of the killed try is left."""
    from mlflow.tracking import MlflowClient

    markers, runs, watcher, killer = fault_runs
    dag_id = "sto_scheduled_durable"
    run_id = runs[dag_id]
    airflow_services.wait_until(
        "the kill after step 3's checkpoint", lambda: killer.killed_at or killer.error, 900
    )
    assert killer.error is None, killer.error
    processes, run_marker = watcher.processes(dag_id, 1)
    airflow_services.wait_until(
        "the retry's ranks", lambda: len(markers.ranks(dag_id, 2)) == 2, 300, every=0.2
    )
    assert killer.killed_at is not None
    retried = max((markers.path / f"{dag_id}.2.rank{r}").stat().st_mtime for r in (0, 1))
    print(f"\nSIGKILL of the task process -> training again: {retried - killer.killed_at:.1f} s")
    seconds_until_gone(processes, run_marker, timeout=60)
    assert airflow_services.wait_for_run(dag_id, run_id, timeout=400) == "success"
    instance = airflow_services.task_instance(dag_id, run_id, "train")
    assert (instance["state"], instance["try_number"]) == ("success", 2)
    xcom = airflow_services.api(
        "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/train/xcomEntries/return_value"
    )["value"]
    assert xcom["value"] == {"start": 3, "ran": [4, 5], "total": 15.0}, xcom

    client = MlflowClient(f"sqlite:///{Path(markers.path) / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sto-durable")
    tracked = client.search_runs([experiment.experiment_id], f"tags.`airflow.run_id` = '{run_id}'")
    assert len(tracked) == 1, [(r.info.run_id, r.info.status) for r in tracked]
    run = tracked[0]
    assert run.info.run_id == xcom["mlflow_run_id"] and run.info.status == "FINISHED"
    assert run.data.tags["sparktorch_ops.tries"] == "1,2"
    assert run.data.tags["sparktorch_ops.training_id"] == xcom["training_id"]
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "total")]
    assert sorted(set(steps)) == [0, 1, 2, 3, 4, 5], steps  # step 3's included
    second_log = airflow_services.task_log(dag_id, run_id, "train", 2)
    second = _levels(second_log)
    line = (
        f"sparktorch_ops: try 2 of the training {xcom['training_id']}: resuming from step 3 "
        f"(checkpoint), MLflow run {run.info.run_id}"
    )
    assert ("info", line) in second, second[-40:]
    assert _errors(second_log) == []
    filled = [event for _, event in second if "were missing from MLflow run" in event]
    print(f"replayed from the checkpoint: {filled or 'nothing was missing'}")


def test_execution_timeout_holds_while_deferred_and_stops_the_training(
    airflow_services: AirflowServices, deferred_runs: Any
) -> None:
    """The trigger cancels the detached training when the task's execution_timeout runs out:
    the task fails as timed out, and none of the training's processes is left."""
    markers, runs = deferred_runs
    dag_id, run_id = "sto_deferred_timeout", runs["sto_deferred_timeout"]
    assert airflow_services.wait_for_run(dag_id, run_id, timeout=300) == "failed"
    ranks = sorted(markers.path.glob(f"{dag_id}.rank*"))
    assert len(ranks) == 2, ranks  # both ranks trained before the deadline
    assert seconds_until_gone([], ranks[0].read_text().split()[1], timeout=60) >= 0
    records = [json.dumps(r) for r in airflow_services.task_log(dag_id, run_id, "train", 1)]
    assert any("execution_timeout ran out: cancelling the training" in r for r in records)
    assert any("AirflowTaskTimeout" in r for r in records), records[-20:]


def test_the_sweep_dag_trains_its_learning_rates_at_once(
    airflow_services: AirflowServices, sweep_run: str
) -> None:
    """The mapped trainings run side by side (LocalExecutor), each with its own MLflow run, and
    the best is promoted only if it beats the champion."""
    from datetime import datetime

    dag_id, run_id = "sweep_digits", sweep_run
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


def test_a_deferred_training_frees_its_slot_and_outlives_a_triggerer_killed_mid_training(
    airflow_services: AirflowServices, deferred_runs: Any, scheduled_example: str
) -> None:
    """deferrable=True in a one-slot pool: while the barrier training runs detached, another
    DAG's task runs in that slot and finishes; the triggerer is SIGKILLed and started again,
    and its successor sees the same training to its end: one try, one training, one MLflow
    run, its ranks' lines in the task's log."""
    from mlflow.tracking import MlflowClient

    markers, runs = deferred_runs
    dag_id, run_id = "sto_deferred_train", runs["sto_deferred_train"]
    ranks = _deferred_and_training(airflow_services, markers, dag_id, run_id)

    def example_trained() -> bool:  # its log is checked for stray warnings: not this kill's
        runs = airflow_services.runs(scheduled_example)
        if not runs:
            return False
        states = airflow_services.task_states(scheduled_example, runs[0]["dag_run_id"])
        return states.get("train") in ("success", "failed", "upstream_failed")

    airflow_services.wait_until("the example's training to end", example_trained, 900)
    other = airflow_services.trigger("sto_deferred_other", {"markers": str(markers.path)})
    assert airflow_services.wait_for_run("sto_deferred_other", other, timeout=300) == "success"
    assert airflow_services.task_instance(dag_id, run_id, "train")["state"] == "deferred"

    triggerer = airflow_services.processes["triggerer"]
    os.killpg(triggerer.pid, signal.SIGKILL)
    triggerer.wait(30)
    killed = time.time()
    airflow_services.start("triggerer")
    (markers.path / f"{dag_id}.finish").write_text("")
    assert airflow_services.wait_for_run(dag_id, run_id, timeout=300) == "success"
    print(f"\ntriggerer SIGKILLed -> the deferred task done: {time.time() - killed:.1f} s")
    instance = airflow_services.task_instance(dag_id, run_id, "train")
    assert (instance["state"], instance["try_number"]) == ("success", 1)
    assert sorted(markers.path.glob(f"{dag_id}.rank*")) == ranks  # trained once
    xcom = airflow_services.api(
        "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/train/xcomEntries/return_value"
    )["value"]
    assert xcom["value"]["steps"] > 0 and xcom["mode"] == "barrier"
    client = MlflowClient(f"sqlite:///{markers.path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sto-deferred")
    tracked = client.search_runs([experiment.experiment_id], f"tags.`airflow.run_id` = '{run_id}'")
    assert [r.info.status for r in tracked] == ["FINISHED"]
    log = _levels(airflow_services.task_log(dag_id, run_id, "train", 1))
    assert any(e.startswith("sparktorch_ops: deferring while the training") for _, e in log)
    # The training's own lines, forwarded by the trigger into the try's trigger logs (by
    # each triggerer that ran it: from the start again after the restart).
    started = [e for _, e in log if e.endswith("started 2 ranks in barrier mode")]
    assert len(started) == 2, log[-30:]


def test_the_example_dag_runs_on_its_schedule(
    airflow_services: AirflowServices, scheduled_example: str
) -> None:
    """Unpaused, the scheduler starts the nightly run (catchup=False: the latest interval);
    every task succeeds, the model is registered and promoted, and the logs are clean. (Last:
    the other tests act on their DAGs while it runs.)"""
    dag_id = scheduled_example
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
    # Deferred, as the example ships: the training's lines come through the trigger's log.
    assert any(event.startswith("sparktorch_ops: deferring while") for _, event in train)
    rank_lines = [(level, event) for level, event in train if event.startswith("[rank ")]
    assert any(event.startswith("[rank 0|") for _, event in rank_lines), train[-40:]
    # Ranks' stdout at INFO; their stderr (warnings, progress) at WARNING; nothing at ERROR.
    assert {level for level, _ in rank_lines} <= {"info", "warning"}, rank_lines
    assert any(level == "info" and "epoch" in event for level, event in rank_lines)
    for task_id in states:
        errors = _errors(airflow_services.task_log(dag_id, run_id, task_id, 1))
        assert errors == [], f"{task_id} succeeded but logged at ERROR: {errors}"
    # Spark's own lines and MLflow's notices are there, at their levels; what every Spark JVM
    # warns of as it starts is INFO, and the rest of the example's log has no warning.
    assert ("info", "spark jvm: Using incubator modules: jdk.incubator.vector") in train
    for task_id in states:
        warnings = [
            event
            for level, event in _levels(airflow_services.task_log(dag_id, run_id, task_id, 1))
            if level == "warning"
            and not event.startswith("[rank ")
            # Several applications train at once here: each after the first takes another port.
            and not event.startswith("spark Utils: Service 'SparkUI' could not bind on port")
        ]
        assert warnings == [], f"{task_id} logged warnings not about the training: {warnings}"
    published = _levels(airflow_services.task_log(dag_id, run_id, "publish", 1))
    assert ("info", "Successfully registered model 'digits-cnn'.") in published, published
