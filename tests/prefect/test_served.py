"""Served deployments under the session's real Prefect server: the example retraining flow run
to completion through its deployment, and barrier-mode (and local) training cancelled through
the API. Each flow runs in a Prefect runner subprocess (``flow.serve``), which starts every
flow run as a subprocess of its own, as in production."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.prefect_served import (
    ServedFlow,
    describe,
    flow_run_process,
    process_tree,
    spawned_processes,
    wait_for,
    wait_for_deployment,
    wait_for_final_state,
)
from harness.procs import alive, processes_with_marker, wait_until_gone
from tests.prefect.conftest import flow_run_artifacts, flow_run_logs, run_ids, task_runs

ROOT = Path(__file__).resolve().parents[2]
RETRAIN_SCRIPT = ROOT / "flows" / "retrain_digits.py"
SLEEPY_SCRIPT = Path(__file__).with_name("served_flow.py")
# A schedule that does not fire while the tests run: only the runs the tests create run.
NEVER_NOW = "0 3 1 1 *"
SLEEPY_DEPLOYMENT = "served-test"


def _seconds_until(condition: Any, started: float, timeout: float) -> float | None:
    """Seconds from ``started`` (a ``time.monotonic()``) until ``condition()`` holds, polled
    every 0.1 s; None when it does not hold ``timeout`` seconds after ``started``."""
    while True:
        if condition():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            return None
        time.sleep(0.1)


@pytest.mark.timeout(900)
def test_served_retrain_digits_runs_a_deployment_to_completion(
    prefect_runner: Callable[..., Any], tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client

    state_dir = tmp_path / "state"
    args = [
        "--name",
        "served-test",
        "--cron",
        NEVER_NOW,
        "--epochs",
        "1",
        "--state",
        str(state_dir),
    ]
    # The run's state and MLflow store (<state>/mlflow.db) and the runner's working directory
    # (Spark's scratch) all stay under tmp_path.
    env = {"MLFLOW_TRACKING_URI": None, "SPARKTORCH_STATE": None}
    with (
        prefect_runner(
            RETRAIN_SCRIPT,
            args,
            workdir=tmp_path / "serve",
            cwd=tmp_path,
            env=env,
        ) as served,
        get_client(sync_client=True) as client,
    ):
        deployment = wait_for_deployment(client, "retrain-digits/served-test", served)
        assert deployment.parameters["state"] == str(state_dir.resolve())
        flow_run = client.create_flow_run_from_deployment(deployment.id)
        final = wait_for_final_state(client, flow_run.id, timeout=720, interval=1.0)
        assert final.is_completed(), f"{final}: {final.message}\n{served.log()}"
        # The flow run's process (and every process it started: two embedded Sparks, the
        # ranks) exits after Completed; its last log records are sent on the way out.
        wait_for(
            lambda: not spawned_processes(served),
            60,
            "the flow run's processes to exit",
        )
        assert served.running()  # the runner serves on

    runs = {run.name.rsplit("-", 1)[0]: run for run in task_runs(flow_run.id, count=4)}
    assert set(runs) == {"append_data", "train-digits", "evaluate", "publish"}
    assert all(run.state.is_completed() for run in runs.values())

    artifacts = flow_run_artifacts(flow_run.id)
    assert {
        "train-digits-progress",
        "train-digits-metrics",
        "train-digits-summary",
        "train-digits-spark-ui",
        "retrain-digits-model",
    } <= set(artifacts), sorted(artifacts)
    assert artifacts["train-digits-progress"].data == 100
    rows = json.loads(artifacts["train-digits-metrics"].data)
    assert [(row["step"], row["rank"]) for row in rows] == [(0, 0), (0, 1)]  # 1 epoch, 2 ranks
    assert all(isinstance(row["loss"], float) for row in rows) and rows[-1]["progress"] == 1.0
    assert "digits-cnn v1: now champion" in artifacts["retrain-digits-model"].data
    assert "](http://" in artifacts["train-digits-spark-ui"].data  # barrier mode: the Spark UI

    # The run used the state directory it was served with, nothing else.
    assert len(list((state_dir / "warehouse" / "digits").glob("ds=*"))) == 1
    # MLflow: the flow's run holds the model and its score; the training run nests under it.
    registry = MlflowClient(f"sqlite:///{state_dir / 'mlflow.db'}")
    champion = registry.get_model_version_by_alias("digits-cnn", "champion")
    assert str(champion.version) == "1"
    flow_mlflow_run = registry.get_run(champion.run_id)
    assert 0.0 <= flow_mlflow_run.data.metrics["test_accuracy"] <= 1.0
    (training,) = registry.search_runs(
        [flow_mlflow_run.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{champion.run_id}'",
    )
    assert training.info.status == "FINISHED" and "prefect.task_run_id" in training.data.tags
    assert [m.step for m in registry.get_metric_history(training.info.run_id, "loss")] == [0]

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

    logs = flow_run_logs(flow_run.id)
    training = [log for log in logs if log.task_run_id == runs["train-digits"].id]
    # Rank 0 prints each epoch's loss (rank 1 prints nothing); its stdout is logged at INFO.
    assert any(
        log.message.startswith("[rank 0|") and "epoch 0: loss" in log.message and log.level == 20
        for log in training
    )
    errors = [f"{log.level} {log.name}: {log.message[:500]}" for log in logs if log.level >= 40]
    assert errors == [], "ERROR records in a successful run:\n" + "\n".join(errors)
    [run_id] = run_ids(logs)
    assert wait_until_gone(run_id, timeout=15) == []


@pytest.fixture(scope="module")
def served_sleepy(
    prefect_runner: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServedFlow]:
    """``tests/prefect/served_flow.py`` served as ``sleepy-training/served-test``."""
    workdir = tmp_path_factory.mktemp("served-sleepy")
    with prefect_runner(SLEEPY_SCRIPT, [SLEEPY_DEPLOYMENT], workdir=workdir, cwd=workdir) as served:
        yield served


@pytest.mark.parametrize("local_mode", [True, False], ids=["local", "barrier"])
def test_cancelling_a_served_run_leaves_no_process_behind(
    served_sleepy: ServedFlow,
    local_mode: bool,
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    markers = tmp_path / "markers"
    markers.mkdir()
    with get_client(sync_client=True) as client:
        deployment = wait_for_deployment(
            client, f"sleepy-training/{SLEEPY_DEPLOYMENT}", served_sleepy
        )
        flow_run = client.create_flow_run_from_deployment(
            deployment.id, parameters={"marker_dir": str(markers), "local_mode": local_mode}
        )
        wait_for(
            lambda: (markers / "rank0").exists() and (markers / "rank1").exists(),
            240,
            "both ranks to start",
        )
        run_id = (markers / "rank0").read_text()
        ranks = processes_with_marker(run_id)
        flow_run_proc = flow_run_process(served_sleepy, ranks)
        assert flow_run_proc is not None, describe(ranks)
        # Everything the flow run started: its process and its descendants (in barrier mode
        # Spark's JVM and Python workers, the torchrun agents) and its ranks.
        started = process_tree([flow_run_proc, *ranks])
        names = describe(started)
        # describe(): "PID NAME: COMMAND LINE" (the ranks name themselves torch-rank-N)
        assert sum(" torch-rank-" in line for line in names) == 2, names
        if not local_mode:
            assert any(" java: " in line for line in names), names
            assert any("pyspark.daemon" in line for line in names), names

        requested = time.monotonic()
        client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
        ranks_gone_s = _seconds_until(lambda: not processes_with_marker(run_id), requested, 30)
        all_gone_s = _seconds_until(lambda: not alive(started), requested, 30)
        # Nothing else the runner started either (a process reparented before the snapshot).
        _seconds_until(lambda: not spawned_processes(served_sleepy), requested, 30)
        final = wait_for_final_state(client, flow_run.id, timeout=60)
    mode = "local" if local_mode else "barrier"
    record_property("last_rank_gone_after_cancel_s", ranks_gone_s)
    record_property("all_gone_after_cancel_s", all_gone_s)
    print(
        f"\n{mode} mode: cancel request -> last rank gone {ranks_gone_s} s, every process of "
        f"the flow run gone {all_gone_s} s ({len(started)} processes)"
    )
    assert final.is_cancelled(), final
    assert wait_until_gone(run_id, timeout=0) == [], "ranks left 30 s after the cancel request"
    assert alive(started) == [], describe(alive(started))
    assert spawned_processes(served_sleepy) == [], describe(spawned_processes(served_sleepy))
    assert served_sleepy.running()  # the runner itself keeps serving
