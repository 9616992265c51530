"""The example DAG ``dags/retrain_digits.py``: it loads, and it runs end to end."""

from __future__ import annotations

import json
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
    train = dag.get_task("train")
    assert type(train).__name__ == "TorchDistributorOperator"
    assert (train.num_processes, train.local_mode, train.use_gpu) == (2, False, False)
    assert train.spark_conf["spark.master"] == "local[2]"
    assert "WHERE ds <= '{{ ds }}'" in train.input_sql


def test_example_dag_trains_evaluates_and_publishes(
    capfd: pytest.CaptureFixture[str], run_dag: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    registry = tmp_path_factory.mktemp("registry")
    outcome = run_dag(capfd, "retrain_digits", registry=str(registry), epochs=6)
    assert outcome.state == "success"

    train = outcome.xcom("train")
    assert (train["num_processes"], train["mode"]) == (2, "barrier")
    day = outcome.logical_date.strftime("%Y-%m-%d")
    assert (registry / "warehouse" / "digits" / f"ds={day}").is_dir()
    assert train["input"]["rows"] == 600 and train["input"]["columns"] == ["pixels", "label"]
    # The weights are not JSON: they went to the run's result location, not into XCom.
    assert "value" not in train
    assert train["value_uri"].startswith((registry / "runs").as_uri())
    assert "torch.Tensor" in train["value_stored_because"]
    assert train["metrics"]["loss"] > 0
    assert train["progress"] == 1.0

    metrics = outcome.xcom("evaluate")
    assert 0.5 < metrics["accuracy"] <= 1.0
    published = outcome.xcom("publish")
    assert published["promoted"] is True  # the first model of an empty registry
    model_dir = Path(published["path"]).parent
    assert model_dir.parent == registry / "models"
    assert json.loads((model_dir / "metrics.json").read_text()) == metrics
    current = json.loads((registry / "current.json").read_text())
    assert current["version"] == published["version"] == model_dir.name
    assert "[rank 0|" in outcome.task_log("train") and "epoch 5: loss" in outcome.task_log("train")


def test_each_scheduled_run_trains_on_the_days_up_to_its_logical_date(
    airflow_db: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import pendulum

    from tests.airflow.conftest import load_dag, read_xcom

    registry = tmp_path_factory.mktemp("registry")
    dag = load_dag("retrain_digits")
    seen, warm = [], []
    # March 2nd first; March 1st backfilled late sees only its own day, not March 2nd's rows.
    for day in (2, 1, 3):
        run = dag.test(
            logical_date=pendulum.datetime(2025, 3, day, 3, tz="UTC"),
            run_conf={"registry": str(registry), "epochs": 1},
        )
        assert str(run.state) == "success"
        summary = read_xcom(run.dag_id, run.run_id, "train", "return_value")
        seen.append(summary["input"]["rows"])
        warm.append(summary["checkpoint"]["warm_start_from"])
    assert seen == [600, 600, 1800]
    # The first run trains from scratch; later ones warm-start from the promoted model.
    current = json.loads((registry / "current.json").read_text())
    assert warm[0] is None and warm[1] is not None and warm[1].startswith(str(registry / "models"))
    assert Path(current["path"]).is_file()
    partitions = sorted(p.name for p in (registry / "warehouse" / "digits").glob("ds=*"))
    assert partitions == ["ds=2025-03-01", "ds=2025-03-02", "ds=2025-03-03"]
