"""The example DAG ``dags/retrain_digits.py``: it loads, and it runs end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.airflow.conftest import ROOT


def test_example_dag_loads_without_import_errors() -> None:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(ROOT / "dags"))
    assert bag.import_errors == {}
    dag = bag.get_dag("retrain_digits")
    assert dag is not None
    assert dag.catchup is False
    assert dag.schedule == dag.timetable.expression == "0 3 * * *"
    assert dag.start_date is not None and dag.start_date.tzinfo is not None
    assert {t.task_id: sorted(t.downstream_task_ids) for t in dag.tasks} == {
        "append_data": ["evaluate", "train"],
        "champion": ["train"],
        "train": ["evaluate", "publish"],
        "evaluate": ["publish"],
        "publish": [],
    }
    import pipeline  # examples/: on sys.path once the DAG file is parsed

    train = dag.get_task("train")
    assert type(train).__name__ == "TorchDistributorOperator"
    assert (train.local_mode, train.use_gpu) == (False, False)
    assert train.num_processes == "{{ params.num_processes }}"
    assert {name: dag.params[name] for name in pipeline.DEFAULTS} == pipeline.DEFAULTS
    assert dag.params["state"] == pipeline.default_state()
    assert train.spark_conf["spark.master"] == "local[2]"
    assert "WHERE ds <= '{{ ds if ds is defined and ds else dag_run.run_after" in train.input_sql


def test_a_run_without_a_logical_date_is_for_the_day_it_was_triggered() -> None:
    """Airflow 3's REST API and ``airflow dags trigger`` start runs with no logical date:
    ``{{ ds }}`` is then None, and the pipeline's day is the trigger's."""
    from types import SimpleNamespace

    import pendulum
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(ROOT / "dags")).get_dag("retrain_digits")
    assert dag is not None
    sql = dag.get_task("train").input_sql
    env = dag.get_template_env()
    run = SimpleNamespace(run_after=pendulum.datetime(2026, 3, 4, 5, tz="UTC"))
    context: dict[str, Any] = {
        "dag_run": run,
        "ti": SimpleNamespace(xcom_pull=lambda **_: {"table": "t"}),
    }
    # Without a logical date the context has no ds at all (Airflow's templates are strict).
    assert env.from_string(sql).render(**context).endswith("WHERE ds <= '2026-03-04'")
    context["ds"] = None
    assert env.from_string(sql).render(**context).endswith("WHERE ds <= '2026-03-04'")
    context["ds"] = "2026-01-02"
    assert env.from_string(sql).render(**context).endswith("WHERE ds <= '2026-01-02'")


@pytest.fixture(scope="session")
def example_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The state directory (table, MLflow store, champion) that the example runs share."""
    return tmp_path_factory.mktemp("example-state")


@pytest.fixture
def example_dag_runs(
    capfd: pytest.CaptureFixture[str], run_dag: Any, example_state: Path
) -> dict[int, Any]:
    """The example DAG run end to end three times on one state directory, by day of March
    2025, memoized for the session: the 2nd first (6 epochs: it trains from scratch, is
    registered and promoted), then the 1st backfilled late with a diverging learning rate (it
    sees its own day only; registered, not promoted), then the 3rd (every day so far)."""
    import pendulum

    runs = {}
    for day, conf in ((2, {"epochs": 6}), (1, {"epochs": 1, "lr": 50.0}), (3, {"epochs": 1})):
        runs[day] = run_dag(
            capfd,
            "retrain_digits",
            logical_date=pendulum.datetime(2025, 3, day, 3, tz="UTC"),
            state=str(example_state),
            **conf,
        )
    return runs


def test_example_dag_trains_tracks_and_registers(
    example_dag_runs: dict[int, Any], example_state: Path
) -> None:
    from mlflow.tracking import MlflowClient

    outcome = example_dag_runs[2]
    assert outcome.state == "success"
    train = outcome.xcom("train")
    assert (train["num_processes"], train["mode"]) == (2, "barrier")
    assert (example_state / "warehouse" / "digits" / "ds=2025-03-02").is_dir()
    assert train["input"]["rows"] == 600 and train["input"]["columns"] == ["pixels", "label"]
    # The weights are not JSON: they went to the run's result location, not into XCom.
    assert "value" not in train
    assert train["value_uri"].startswith((example_state / "runs").as_uri())
    assert "torch.Tensor" in train["value_stored_because"]
    assert train["metrics"]["loss"] > 0 and train["progress"] == 1.0
    assert train["checkpoint"]["warm_start_from"] is None  # the first run: from scratch
    log = outcome.task_log("train")
    assert "[rank 0|" in log and "epoch 5: loss" in log

    # One MLflow run per training, in the embedded SQLite store under the state directory.
    client = MlflowClient(f"sqlite:///{example_state / 'mlflow.db'}")
    run = client.get_run(train["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["airflow.dag_id"] == "retrain_digits"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(6))
    metrics = outcome.xcom("evaluate")
    assert 0.5 < metrics["accuracy"] <= 1.0
    assert client.get_run(run.info.run_id).data.metrics["test_accuracy"] == metrics["accuracy"]
    published = outcome.xcom("publish")
    assert published["promoted"] is True and published["version"] == "1"


def test_a_worse_model_is_registered_but_the_champion_stays(
    example_dag_runs: dict[int, Any], example_state: Path
) -> None:
    from mlflow.tracking import MlflowClient

    first, worse = example_dag_runs[2], example_dag_runs[1]
    assert worse.state == "success"
    # Warm-started from the champion's weights, then diverged (lr=50).
    assert worse.xcom("train")["checkpoint"]["warm_start_from"].startswith(
        str(example_state / "champion")
    )
    record = worse.xcom("publish")
    assert record["version"] == "2" and record["promoted"] is False
    assert record["previous"]["version"] == "1"
    assert worse.xcom("evaluate")["accuracy"] < first.xcom("evaluate")["accuracy"]
    # The champion stayed v1 until the next run (the 3rd's publish saw it), which may move it.
    after = example_dag_runs[3].xcom("publish")
    assert after["version"] == "3" and after["previous"]["version"] == "1"
    client = MlflowClient(f"sqlite:///{example_state / 'mlflow.db'}")
    champion = client.get_model_version_by_alias("digits-cnn", "champion").version
    assert str(champion) == ("3" if after["promoted"] else "1")


def test_each_scheduled_run_trains_on_the_days_up_to_its_logical_date(
    example_dag_runs: dict[int, Any], example_state: Path
) -> None:
    # March 2nd first; March 1st backfilled late sees only its own day, not March 2nd's rows.
    rows = {day: run.xcom("train")["input"]["rows"] for day, run in example_dag_runs.items()}
    assert rows == {2: 600, 1: 600, 3: 1800}
    assert example_dag_runs[3].state == "success"
    partitions = sorted(p.name for p in (example_state / "warehouse" / "digits").glob("ds=*"))
    assert partitions == ["ds=2025-03-01", "ds=2025-03-02", "ds=2025-03-03"]
