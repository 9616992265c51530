"""Durable trainings under ``dag.test()``: a summary stored before the try died is returned
by the retry without training; ``durable=False`` trains afresh on every try. (The SIGKILL of a
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
