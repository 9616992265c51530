"""The example retraining flow end to end, and cancelling a served flow run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.prefect.conftest import flow_run_artifacts, flow_run_logs, run_ids, task_runs
from tests.support.procs import wait_until_gone

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "flows"))


def test_retrain_digits_flow_publishes_and_reports(state_dir: Path) -> None:
    from mlflow.tracking import MlflowClient
    from retrain_digits import retrain_digits

    state = retrain_digits(state=str(state_dir), epochs=2, day="2025-03-02", return_state=True)
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


@pytest.fixture
def served_flow(prefect_api: str, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``tests/prefect/served_flow.py`` served by a Prefect runner in a subprocess."""
    env = dict(os.environ)
    env.update(
        PREFECT_API_URL=prefect_api,
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_RUNNER_POLL_FREQUENCY="2",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("served_flow.py"))],
        cwd=str(ROOT),
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def _wait_for(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_cancelling_a_served_flow_run_stops_the_training(
    served_flow: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Cancelling

    markers = tmp_path / "markers"
    markers.mkdir()
    with get_client(sync_client=True) as client:

        def deployment() -> Any:
            assert served_flow.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                return client.read_deployment_by_name("sleepy-training/test")
            except ObjectNotFound:
                return None

        found = _wait_for(deployment, 90, "the served deployment")
        flow_run = client.create_flow_run_from_deployment(
            found.id, parameters={"marker_dir": str(markers)}
        )
        _wait_for(
            lambda: (markers / "rank0").exists() and (markers / "rank1").exists(),
            120,
            "both ranks to start",
        )
        run_id = (markers / "rank0").read_text()
        client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
        final = _wait_for(
            lambda: (s := client.read_flow_run(flow_run.id).state) and s.is_final() and s,
            60,
            "the flow run to end",
        )
    assert final.is_cancelled(), final
    assert wait_until_gone(run_id, timeout=30) == []
    assert served_flow.poll() is None  # the runner itself keeps serving


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
