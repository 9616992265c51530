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


def test_example_dag_trains_tracks_and_promotes_only_a_better_model(
    capfd: pytest.CaptureFixture[str], run_dag: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from mlflow.tracking import MlflowClient

    state = tmp_path_factory.mktemp("state")
    outcome = run_dag(capfd, "retrain_digits", state=str(state), epochs=6)
    assert outcome.state == "success"

    train = outcome.xcom("train")
    assert (train["num_processes"], train["mode"]) == (2, "barrier")
    day = outcome.logical_date.strftime("%Y-%m-%d")
    assert (state / "warehouse" / "digits" / f"ds={day}").is_dir()
    assert train["input"]["rows"] == 600 and train["input"]["columns"] == ["pixels", "label"]
    # The weights are not JSON: they went to the run's result location, not into XCom.
    assert "value" not in train
    assert train["value_uri"].startswith((state / "runs").as_uri())
    assert "torch.Tensor" in train["value_stored_because"]
    assert train["metrics"]["loss"] > 0 and train["progress"] == 1.0
    assert "[rank 0|" in outcome.task_log("train") and "epoch 5: loss" in outcome.task_log("train")

    # One MLflow run per training, in the embedded SQLite store under the state directory.
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    run = client.get_run(train["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["airflow.dag_id"] == "retrain_digits"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(6))
    metrics = outcome.xcom("evaluate")
    assert 0.5 < metrics["accuracy"] <= 1.0
    assert (
        run.info.run_id
        and client.get_run(run.info.run_id).data.metrics["test_accuracy"] == (metrics["accuracy"])
    )
    published = outcome.xcom("publish")
    assert published["promoted"] is True and published["version"] == "1"
    assert str(client.get_model_version_by_alias("digits-cnn", "champion").version) == "1"

    # A worse model (a diverging learning rate) is registered, but the champion stays.
    worse = run_dag(capfd, "retrain_digits", state=str(state), epochs=1, lr=50.0)
    assert worse.state == "success"
    assert worse.xcom("train")["checkpoint"]["warm_start_from"] is not None  # from the champion
    record = worse.xcom("publish")
    assert record["version"] == "2" and record["promoted"] is False
    assert worse.xcom("evaluate")["accuracy"] < metrics["accuracy"]
    assert str(client.get_model_version_by_alias("digits-cnn", "champion").version) == "1"


def test_each_scheduled_run_trains_on_the_days_up_to_its_logical_date(
    airflow_db: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import pendulum

    from tests.airflow.conftest import load_dag, read_xcom

    state = tmp_path_factory.mktemp("state")
    dag = load_dag("retrain_digits")
    seen, warm = [], []
    # March 2nd first; March 1st backfilled late sees only its own day, not March 2nd's rows.
    for day in (2, 1, 3):
        run = dag.test(
            logical_date=pendulum.datetime(2025, 3, day, 3, tz="UTC"),
            run_conf={"state": str(state), "epochs": 1},
        )
        assert str(run.state) == "success"
        summary = read_xcom(run.dag_id, run.run_id, "train", "return_value")
        seen.append(summary["input"]["rows"])
        warm.append(summary["checkpoint"]["warm_start_from"])
    assert seen == [600, 600, 1800]
    # The first run trains from scratch; later ones warm-start from the champion's weights.
    assert warm[0] is None and warm[1] is not None and warm[1].startswith(str(state / "champion"))
    partitions = sorted(p.name for p in (state / "warehouse" / "digits").glob("ds=*"))
    assert partitions == ["ds=2025-03-01", "ds=2025-03-02", "ds=2025-03-03"]
