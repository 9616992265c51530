"""The example sweep flow (flows/sweep_digits.py) on Prefect's thread pool: its trainings run at
once on the test session's local[2] (the flow's one shared session), each task run with its own
artifacts, checkpoint directory and MLflow run; the best is promoted only if it is better."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.prefect.conftest import flow_run_artifacts, flow_run_logs, task_runs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e  # a whole pipeline run
def test_the_sweep_flow_trains_every_learning_rate_concurrently(
    spark: Any, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.syspath_prepend(str(ROOT / "flows"))
    sys.modules.pop("sweep_digits", None)
    import sweep_digits

    state = sweep_digits.sweep_digits(
        state=str(state_dir), epochs=1, day="2025-03-01", return_state=True
    )
    assert state.is_completed(), state.message
    record = state.result()
    versions = record["versions"]
    assert [v["params"]["lr"] for v in versions] == [0.02, 0.05, 0.1]
    assert len({v["run_id"] for v in versions}) == 3  # an MLflow run per task run
    best = max(versions, key=lambda v: v["metrics"]["accuracy"])
    assert record["best"]["version"] == best["version"] and record["promoted"] is True

    trainings = [
        run for run in task_runs(state.state_details.flow_run_id, 7) if run.name.startswith("run_")
    ]
    assert len(trainings) == 3 and all(run.state.is_completed() for run in trainings)
    # Concurrent: local[2] holds two 1-rank barrier runs at once.
    spans = sorted((run.start_time, run.end_time) for run in trainings)
    assert spans[1][0] < spans[0][1], spans
    artifacts = flow_run_artifacts(state.state_details.flow_run_id)
    assert {f"sweep-lr-{i}-summary" for i in range(3)} <= set(artifacts)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{state_dir / 'mlflow.db'}")
    task_run_ids = {
        str(client.get_run(v["run_id"]).data.tags["prefect.task_run_id"]) for v in versions
    }
    assert task_run_ids == {str(run.id) for run in trainings}


def meet_and_return(directory: str, name: str, runs: int) -> str:
    """Say ``name`` started, then wait (bounded) until all ``runs`` have: they run at once."""
    import time

    Path(directory, f"{name}.started").write_text("")
    deadline = time.monotonic() + 90
    while len(list(Path(directory).glob("*.started"))) < runs:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: the other trainings never started")
        time.sleep(0.05)
    print(f"{name} trained", flush=True)
    return name


def test_mapped_trainings_on_a_process_pool_run_at_once_each_with_its_own_artifacts(
    tmp_path: Path,
) -> None:
    from prefect import flow, unmapped
    from prefect.task_runners import ProcessPoolTaskRunner

    from sparktorch_ops.prefect import run_torch_distributor

    @flow(task_runner=ProcessPoolTaskRunner(max_workers=2))
    def two_at_once(directory: str) -> list[str]:
        futures = run_torch_distributor.map(
            unmapped(meet_and_return),
            train_args=[[directory, "first", 2], [directory, "second", 2]],
            artifact_key=["pool-first", "pool-second"],
            num_processes=unmapped(1),
            use_gpu=unmapped(False),
        )
        return [future.result() for future in futures]

    state = two_at_once(str(tmp_path), return_state=True)
    assert state.is_completed(), state.message
    assert state.result() == ["first", "second"]
    runs = task_runs(state.state_details.flow_run_id, 2)
    assert len(runs) == 2 and all(run.state.is_completed() for run in runs)
    artifacts = flow_run_artifacts(state.state_details.flow_run_id)
    assert {"pool-first-summary", "pool-second-summary"} <= set(artifacts)
    by_run: dict[Any, list[str]] = {}
    for log in flow_run_logs(state.state_details.flow_run_id):
        if log.message.startswith("[rank "):
            by_run.setdefault(log.task_run_id, []).append(log.message.split("] ", 1)[1])
    # Each task run's log has its own rank's line, and only that.
    assert sorted(by_run.values()) == [["first trained"], ["second trained"]], by_run
