"""The example retraining flow end to end, in this process under the session's Prefect server
(served deployments of it: test_served.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.prefect.conftest import flow_run_artifacts, flow_run_logs, run_ids, task_runs
from tests.support.procs import wait_until_gone

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "flows"))


@pytest.fixture(scope="module")
def example_flow_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The example flow run end to end once (2 epochs): its final state and state directory."""
    from retrain_digits import retrain_digits

    state_dir = tmp_path_factory.mktemp("state")
    state = retrain_digits(state=str(state_dir), epochs=2, day="2025-03-02", return_state=True)
    return state, state_dir


def test_retrain_digits_flow_publishes_and_reports(example_flow_run: tuple[Any, Path]) -> None:
    from mlflow.tracking import MlflowClient

    state, state_dir = example_flow_run
    assert state.is_completed(), state.message
    record = state.result()
    assert record["promoted"] is True and record["previous"] == "none"
    assert record["version"] == "1" and 0.0 <= record["metrics"]["accuracy"] <= 1.0
    # MLflow: the flow's run holds the model and its scores; the training run nests under it.
    client = MlflowClient(f"sqlite:///{state_dir / 'mlflow.db'}")
    assert client.get_model_version_by_alias("digits-cnn", "champion").run_id == record["run_id"]
    flow_mlflow_run = client.get_run(record["run_id"])
    assert flow_mlflow_run.data.metrics["test_accuracy"] == record["metrics"]["accuracy"]
    (training,) = client.search_runs(
        [flow_mlflow_run.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{record['run_id']}'",
    )
    assert training.info.status == "FINISHED" and "prefect.task_run_id" in training.data.tags
    assert [m.step for m in client.get_metric_history(training.info.run_id, "loss")] == [0, 1]

    flow_run_id = state.state_details.flow_run_id
    runs = {run.name.rsplit("-", 1)[0]: run for run in task_runs(flow_run_id, count=4)}
    assert set(runs) == {"append_data", "train-digits", "evaluate", "publish"}
    assert [p.name for p in (state_dir / "warehouse" / "digits").glob("ds=*")] == ["ds=2025-03-02"]
    assert all(run.state.is_completed() for run in runs.values())

    artifacts = flow_run_artifacts(flow_run_id)
    assert artifacts["train-digits-progress"].data == 100
    rows = json.loads(artifacts["train-digits-metrics"].data)
    assert [(row["step"], row["rank"]) for row in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(isinstance(row["loss"], float) for row in rows)
    assert rows[-1]["progress"] == 1.0
    summary = artifacts["train-digits-summary"].data
    for text in (
        "completed",
        "| Processes | 2 |",
        "barrier",
        "| Input | 600 rows from sql:",
        "loss",
        "persisted in Prefect result storage at",
        f"| MLflow run | `{training.info.run_id}` |",
    ):
        assert text in summary, text
    stored = summary.split("persisted in Prefect result storage at `", 1)[1].split("`", 1)[0]
    assert Path(stored).is_file()  # the trained value really is in result storage
    assert "](http://" in artifacts["train-digits-spark-ui"].data  # barrier mode: the Spark UI
    model_card = artifacts["retrain-digits-model"].data
    assert "digits-cnn v1: now champion" in model_card

    logs = flow_run_logs(flow_run_id)
    lines = [log.message for log in logs if log.task_run_id == runs["train-digits"].id]
    assert any(line.startswith("[rank 0|") and "epoch 1: loss" in line for line in lines)
    [run_id] = run_ids(logs)
    assert wait_until_gone(run_id, timeout=15) == []


def test_the_flow_and_the_dag_share_state_directory_defaults_and_schedule(
    tmp_path: Path,
) -> None:
    """Both pipelines read $SPARKTORCH_STATE and examples/pipeline.py's defaults and schedule
    (the DAG's side: tests/airflow/test_retrain_dag.py)."""
    probe = (
        "import inspect, json, sys; sys.path.insert(0, 'flows'); import retrain_digits as f; "
        "import pipeline; p = inspect.signature(f.retrain_digits.fn).parameters; "
        "print(json.dumps({'state': p['state'].default, 'defaults': {k: p[k].default for k in "
        "pipeline.DEFAULTS}, 'pipeline': pipeline.DEFAULTS, 'schedule': pipeline.SCHEDULE}))"
    )
    env = {**os.environ, "SPARKTORCH_STATE": str(tmp_path / "shared-state")}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["state"] == str(tmp_path / "shared-state")
    assert found["defaults"] == found["pipeline"]
    assert found["schedule"] == "0 3 * * *"
