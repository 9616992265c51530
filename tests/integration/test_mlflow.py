"""MLflow tracking (sparktorch_ops.driver.tracking) against real stores: an ``mlflow server`` process
and SQLite tracking stores, with real torchrun ranks (gloo on CPU).

One MLflow run per training run, written by the driver; the ranks never see the tracking URI
or credentials. The rank functions are module-level (cloudpickle ships them by reference).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pytest
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from harness.ports import free_port
from sparktorch_ops import ConfigError, TorchDistributor, TrainingFailedError, report
from tests.support.mlflow_server import MlflowServer, start_mlflow_server

STEPS = 3
# Driver-side settings that must never reach a rank.
SECRET_ENV = {
    "MLFLOW_TRACKING_USERNAME": "alice",
    "MLFLOW_TRACKING_PASSWORD": "not-for-ranks",
    "DATABRICKS_TOKEN": "dapi-not-for-ranks",
}


# -- rank code -----------------------------------------------------------------------------------
def rank_loss(step: int, rank: int, scale: float) -> float:
    return scale / (step + 1) + 10.0 * rank


def train_and_report(steps: int, scale: float = 1.0) -> dict[str, Any]:
    """Every rank reports ``loss`` at steps 0..steps-1; rank 0 gathers what each rank saw of
    the MLflow settings."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        for step in range(steps):
            report(step=step, progress=(step + 1) / steps, loss=rank_loss(step, rank, scale))
        mine = {
            "rank": rank,
            "tracking_uri": os.environ.get("MLFLOW_TRACKING_URI"),
            "secrets": sorted(
                k for k in os.environ if k in SECRET_ENV or k.startswith("MLFLOW_TRACKING_")
            ),
        }
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {"rank": rank, "ranks": everyone}
    finally:
        dist.destroy_process_group()


def report_only(steps: int) -> int:
    """No process group: just ``loss`` reports (cheaper where the ranks need not talk)."""
    rank = int(os.environ["RANK"])
    for step in range(steps):
        report(step=step, loss=rank_loss(step, rank, 1.0))
    return rank


def fail_on_rank1(steps: int) -> int:
    """Reports like :func:`report_only`, then rank 1 raises."""
    rank = report_only(steps)
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def touch(path: str) -> None:
    Path(path).touch()


# -- helpers -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One real ``mlflow server`` for the module (it takes a while to start)."""
    with start_mlflow_server(tmp_path_factory.mktemp("mlflow-server"), timeout=120) as server:
        yield server


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite tracking store for the module (creating one costs seconds of migrations);
    each test uses its own experiment."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow-sqlite').resolve() / 'mlflow.db'}"


@pytest.fixture(autouse=True)
def _clean_mlflow_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No tracking settings leak into or out of a test: mlflow.set_tracking_uri exports
    ``MLFLOW_TRACKING_URI``, so the teardown unsets it again and ends leftover active runs."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    mlflow.set_tracking_uri(None)  # nor one set by an earlier test in this process
    yield
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(None)  # unset again (mlflow takes None)


def only_run(client: MlflowClient, experiment: str) -> Run:
    """The experiment's one run (the training must create exactly one, not one per rank)."""
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"experiment {experiment!r} was not created"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, [(r.info.run_id, r.info.run_name) for r in runs]
    return runs[0]


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def expected_loss(rank: int, scale: float = 1.0) -> list[tuple[int, Any]]:
    return [(step, pytest.approx(rank_loss(step, rank, scale))) for step in range(STEPS)]


# -- tests ---------------------------------------------------------------------------------------
def test_local_run_is_one_mlflow_run_on_the_server_and_ranks_see_no_tracking_env(
    mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    for key, value in SECRET_ENV.items():
        monkeypatch.setenv(key, value)
    result = TorchDistributor(
        num_processes=2, local_mode=True, use_gpu=False, mlflow_experiment="local-server"
    ).launch(train_and_report, STEPS, scale=2.0)

    # Rank side: no tracking URI and no credentials on any rank, though the driver had them.
    ranks = result.value["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["tracking_uri"] for r in ranks] == [None, None]
    assert [r["secrets"] for r in ranks] == [[], []]

    client = MlflowClient(mlflow_server.url)
    run = only_run(client, "local-server")
    assert result.mlflow_run_id == run.info.run_id
    assert result.mlflow_run_url is not None
    assert result.mlflow_run_url.startswith(f"{mlflow_server.url}/#/experiments/")
    assert result.mlflow_run_url.endswith(f"/runs/{run.info.run_id}")
    summary = result.summary()
    assert summary["mlflow_run_id"] == run.info.run_id
    assert summary["mlflow_run_url"] == result.mlflow_run_url

    assert run.info.status == "FINISHED"
    assert history(client, run.info.run_id, "loss") == expected_loss(0, 2.0)
    assert history(client, run.info.run_id, "progress") == [
        (step, pytest.approx((step + 1) / STEPS)) for step in range(STEPS)
    ]
    assert "loss/rank1" not in run.data.metrics  # rank 0's records only by default
    # Timestamps are the ranks' report times (epoch ms), inside the run.
    assert run.info.end_time is not None
    for point in client.get_metric_history(run.info.run_id, "loss"):
        assert run.info.start_time - 1000 <= point.timestamp <= run.info.end_time
    assert run.data.metrics["duration_s"] > 0
    params = run.data.params
    assert params["num_processes"] == "2"
    assert params["mode"] == "local"
    assert params["use_gpu"] == "False"
    assert params["max_restarts"] == "0"
    assert params["train"] == "train_and_report (function)"
    assert params["args"] == "[3]"
    assert params["kwargs.scale"] == "2.0"
    tags = run.data.tags
    assert tags["sparktorch_ops.run_id"] == result.run_id
    assert tags["sparktorch_ops.outcome"] == "succeeded"
    assert "mlflow.parentRunId" not in tags


def test_barrier_run_is_one_mlflow_run_tagged_with_the_spark_app(
    spark: Any, sqlite_store: str
) -> None:
    uri = sqlite_store
    result = TorchDistributor(
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        spark=spark,
        mlflow_experiment="barrier",
        mlflow_tracking_uri=uri,
    ).launch(report_only, STEPS)
    assert result.value == 0
    assert result.mlflow_run_url is None  # not an MLflow server: no UI link

    client = MlflowClient(uri)
    run = only_run(client, "barrier")
    assert result.mlflow_run_id == run.info.run_id
    assert run.info.status == "FINISHED"
    assert history(client, run.info.run_id, "loss") == expected_loss(0)
    assert run.data.params["mode"] == "barrier"
    tags = run.data.tags
    assert tags["spark.app_id"] == spark.sparkContext.applicationId
    assert tags["spark.app_id"] == result.app_id
    assert result.ui_url  # the session fixture runs Spark's UI
    assert tags["spark.ui_url"] == result.ui_url
    assert tags["sparktorch_ops.outcome"] == "succeeded"


def test_training_run_nests_under_the_callers_active_run(sqlite_store: str) -> None:
    uri = sqlite_store
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("outer")
    with mlflow.start_run() as outer:
        result = TorchDistributor(
            num_processes=2,
            local_mode=True,
            use_gpu=False,
            mlflow_experiment="nested",
            mlflow_tracking_uri=uri,
        ).launch(report_only, STEPS)
        active = mlflow.active_run()
        assert active is not None and active.info.run_id == outer.info.run_id

    client = MlflowClient(uri)
    run = only_run(client, "nested")
    assert run.info.run_id == result.mlflow_run_id
    assert run.data.tags["mlflow.parentRunId"] == outer.info.run_id
    assert run.info.status == "FINISHED"
    assert client.get_run(outer.info.run_id).info.status == "FINISHED"  # ended by `with`


def test_failed_training_is_a_failed_mlflow_run(sqlite_store: str) -> None:
    uri = sqlite_store
    distributor = TorchDistributor(
        num_processes=2,
        local_mode=True,
        use_gpu=False,
        mlflow_experiment="failing",
        mlflow_tracking_uri=uri,
    )
    with pytest.raises(TrainingFailedError) as info:
        distributor.launch(fail_on_rank1, STEPS)
    assert "boom from rank 1" in str(info.value)

    client = MlflowClient(uri)
    run = only_run(client, "failing")
    assert run.info.status == "FAILED"
    outcome = run.data.tags["sparktorch_ops.outcome"]
    assert outcome.startswith("TrainingFailedError: "), outcome
    assert "rank 1" in outcome and "ValueError: boom from rank 1" in outcome, outcome
    assert history(client, run.info.run_id, "loss") == expected_loss(0)  # logged before it failed
    assert "duration_s" in run.data.metrics


def test_the_failed_tries_of_a_durable_training_share_one_run_ended_by_the_last(
    sqlite_store: str,
) -> None:
    from sparktorch_ops.distributor import launch_job
    from sparktorch_ops.driver.durable import TrainingTry
    from sparktorch_ops.job import build_job

    uri, stored = sqlite_store, []
    client = MlflowClient(uri)

    def attempt(training: TrainingTry) -> Run:
        job = build_job(
            train=fail_on_rank1,
            train_args=[STEPS],
            num_processes=2,
            use_gpu=False,
            mlflow_experiment="durable-failing",
            mlflow_tracking_uri=uri,
            training=training,
        )
        with pytest.raises(TrainingFailedError):
            launch_job(job)
        return only_run(client, "durable-failing")

    first = attempt(TrainingTry("training-t", 1, (1,), last_try=False, on_mlflow_run=stored.append))
    assert [first.info.run_id] == stored
    assert first.info.status == "RUNNING"  # a retry is to come: it continues this run
    assert first.data.tags["sparktorch_ops.outcome"].startswith("TrainingFailedError: ")
    assert first.data.tags["sparktorch_ops.training_id"] == "training-t"
    assert first.data.tags["sparktorch_ops.tries"] == "1"
    last = attempt(TrainingTry("training-t", 2, (1, 2), last_try=True, mlflow_run_id=stored[0]))
    assert last.info.run_id == first.info.run_id and last.info.status == "FAILED"
    assert last.data.tags["sparktorch_ops.tries"] == "1,2"


def test_a_new_run_that_resumes_a_checkpoint_takes_none_of_the_replayed_metrics(
    sqlite_store: str, tmp_path: Path
) -> None:
    """Without a durable training each try is its own MLflow run: the records the resumed
    checkpoint replays belong to the earlier run's curve, not to the new one."""
    from tests.support.checkpointed import steps_with_one_failure

    client, marker = MlflowClient(sqlite_store), tmp_path / "failed-once"

    def attempt() -> Any:
        return TorchDistributor(
            num_processes=2,
            use_gpu=False,
            checkpoint_dir=str(tmp_path / "checkpoints"),
            mlflow_experiment="resumed-not-durable",
            mlflow_tracking_uri=sqlite_store,
        ).run(steps_with_one_failure, 4, str(marker))

    with pytest.raises(TrainingFailedError):
        attempt()
    assert attempt() == {"start": 1, "ran": [2, 3], "total": 6.0}
    experiment = client.get_experiment_by_name("resumed-not-durable")
    assert experiment is not None
    runs = {r.info.status: r for r in client.search_runs([experiment.experiment_id])}
    steps = {
        status: [m.step for m in client.get_metric_history(run.info.run_id, "total")]
        for status, run in runs.items()
    }
    assert steps == {"FAILED": [0, 1], "FINISHED": [2, 3]}


def test_all_ranks_logs_other_ranks_suffixed(sqlite_store: str) -> None:
    uri = sqlite_store
    result = TorchDistributor(
        num_processes=2,
        local_mode=True,
        use_gpu=False,
        mlflow_experiment="all-ranks",
        mlflow_tracking_uri=uri,
        mlflow_all_ranks=True,
    ).launch(report_only, STEPS)

    client = MlflowClient(uri)
    run = only_run(client, "all-ranks")
    assert run.info.run_id == result.mlflow_run_id
    assert history(client, run.info.run_id, "loss") == expected_loss(0)
    assert history(client, run.info.run_id, "loss/rank1") == expected_loss(1)
    assert "loss/rank0" not in run.data.metrics


def test_unreachable_tracking_server_is_a_config_error_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    marker = tmp_path / "rank-started"
    distributor = TorchDistributor(
        num_processes=2,
        local_mode=True,
        use_gpu=False,
        mlflow_experiment="nowhere",
        mlflow_tracking_uri=f"http://127.0.0.1:{free_port()}",  # nothing listens there
    )
    with pytest.raises(ConfigError) as info:
        distributor.launch(touch, str(marker))
    assert info.value.argument == "mlflow_tracking_uri"
    assert "cannot be used" in info.value.message, info.value.message
    assert not marker.exists()


def test_empty_experiment_name_is_a_config_error_at_construction() -> None:
    with pytest.raises(ConfigError) as info:
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=False, mlflow_experiment="")
    assert info.value.argument == "mlflow_experiment"
