"""Durable trainings under ``dag.test()``: a summary stored before the try died is returned
by the retry without training; ``durable=False`` trains afresh on every try; a deferred one
trains detached while the trigger waits. (The SIGKILL of a
task process mid-training runs under the real scheduler: test_real_scheduler.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("durable")
    (base / "stored").mkdir()
    (base / "not_durable").mkdir()
    return base


@pytest.fixture
def durable_run(capfd: pytest.CaptureFixture[str], run_dag: Any, directory: Path) -> Any:
    return run_dag(
        capfd, "sto_durable", dir=str(directory), mlflow=f"sqlite:///{directory / 'mlflow.db'}"
    )


def test_a_retry_returns_the_stored_summary_without_training(
    durable_run: Any, directory: Path
) -> None:
    ti = durable_run.task("stored_then_crash")
    assert (ti.state, ti.try_number) == ("success", 2)
    assert (directory / "stored" / "trained").read_text() == "try 1\n"  # trained once
    summary = durable_run.xcom("stored_then_crash")
    assert summary["value"] == "trained on try 1"
    log = durable_run.task_log("stored_then_crash")
    line = (
        f"sparktorch_ops: the training {summary['training_id']} already finished in try 1: "
        "returning its result"
    )
    assert line in log
    assert "sparktorch_ops: try 2" not in log


def test_without_durable_every_try_trains_afresh_into_its_own_mlflow_run(
    durable_run: Any, directory: Path
) -> None:
    from mlflow.tracking import MlflowClient

    ti = durable_run.task("not_durable")
    assert (ti.state, ti.try_number) == ("success", 2)
    assert (directory / "not_durable" / "trained").read_text() == "try 1\ntry 2\n"
    summary = durable_run.xcom("not_durable")
    assert summary["value"] == "trained on try 2" and "training_id" not in summary
    client = MlflowClient(f"sqlite:///{directory / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sto-not-durable")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(run.info.status for run in runs) == ["FAILED", "FINISHED"]
    assert all("sparktorch_ops.tries" not in run.data.tags for run in runs)


def test_a_deferred_training_runs_detached_and_resumes_the_task_with_its_summary(
    durable_run: Any, directory: Path
) -> None:
    """deferrable=True: the try submits the training detached and defers; the trigger watches
    its run directory (forwarding the ranks' lines to the task log) and the task completes
    with the same XCom summary as an attached training."""
    ti = durable_run.task("deferred")
    assert (ti.state, ti.try_number) == ("success", 1)
    assert (directory / "deferred" / "trained").read_text() == "try 1\ntry 1\n"  # 2 ranks, once
    summary = durable_run.xcom("deferred")
    assert summary["value"] == "trained on try 1" and summary["num_processes"] == 2
    assert summary["run_id"].startswith("sparktorch-")
    log = durable_run.log
    assert "sparktorch_ops: deferring while the training training-" in log
    assert "/runs/" in log  # its run directory, under the result location
    assert "rank 1 trained on try 1" in log  # a rank's line, forwarded by the trigger
