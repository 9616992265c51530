"""Nightly retraining of the digits CNN: append the day's data -> DDP training on Spark, tracked
in MLflow -> evaluate -> register the model, promoting it only if it beats the champion.

``append_data`` writes the logical date's rows into a Parquet table partitioned by ``ds``
(``examples/pipeline.py``; a rerun of the day replaces only that day's partition).
``champion`` resolves MLflow's ``champion`` alias of ``digits-cnn`` to a local weights file.
``train`` is :class:`~sparktorch_ops.airflow.TorchDistributorOperator` in barrier mode on an
embedded Spark (``local[2]``: two barrier tasks, one DDP rank each) with the templated
``input_sql`` selecting every day up to the run's (``DAY``: ``{{ ds }}``, or the day a run
without a logical date was triggered); each rank trains on its equal share through
``sparktorch_ops.data.partition_loader`` (``examples/ddp_train.py``'s ``train_on_partition``),
warm-starting from the champion and saving a checkpoint every epoch (a retry resumes); it runs
detached while the task is deferred (``DEFERRABLE``), so it holds no worker slot. The
driver logs the run to MLflow (experiment ``retrain-digits``; the XCom's ``mlflow_run_id``). The
trained ``state_dict`` is not JSON, so the operator writes it to its result location and its
XCom holds the URI; ``evaluate`` scores it on the held-out split, ``publish`` logs the model and
the scores on the same MLflow run, registers a new version and moves ``champion`` to it only if
its accuracy is higher.

Run it once, end to end, without a scheduler::

    export AIRFLOW_HOME=$PWD/.state/airflow AIRFLOW__CORE__DAGS_FOLDER=$PWD/dags \
        AIRFLOW__CORE__LOAD_EXAMPLES=False
    airflow db migrate && airflow dags test retrain_digits

State (table, MLflow store, results) lives in ``$SPARKTORCH_STATE`` (default ``<repo>/.state``)
or the run's ``state`` param (``airflow dags test retrain_digits -c '{"state": "/tmp/st"}'``);
MLflow is ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<state>/mlflow.db``.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pendulum
from airflow.sdk import DAG, Param, task

from sparktorch_ops.airflow import TorchDistributorOperator

# resolve(): the file may be reached through a symlink in another DAGs folder.
REPO = Path(__file__).resolve().parents[1]
EXAMPLES = str(REPO / "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import pipeline  # noqa: E402  (the steps and defaults both pipelines share)

log = logging.getLogger("airflow.task")
# The training runs detached while its task is deferred: no worker slot is held while it trains
# (a triggerer watches it; `airflow dags test` runs the trigger in-process). False (or
# RETRAIN_DIGITS_DEFERRABLE=false): it trains in the task's own process, as an attached run.
DEFERRABLE = os.environ.get("RETRAIN_DIGITS_DEFERRABLE", "true").lower() not in ("0", "false")
# Where the operator writes the trained weights; load_result reads only from under it.
RESULTS = "{{ params.state }}/runs"
# The day a run is for: its logical date; a run triggered without one (the default of Airflow
# 3's REST API and `airflow dags trigger`) is for the day it was triggered.
DAY = "{{ ds if ds is defined and ds else dag_run.run_after.strftime('%Y-%m-%d') }}"


def _examples() -> None:
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)


def train_digits(**kwargs: Any) -> dict[str, Any]:
    """Run on every rank: ``examples/ddp_train.py``'s DDP ``train_on_partition(**kwargs)``.

    torch and the example are imported here, on the ranks, not when the scheduler parses this
    file. (For a cluster, ship the example with the function or install it on the executors.)
    """
    _examples()
    import ddp_train

    result: dict[str, Any] = ddp_train.train_on_partition(**kwargs)
    return result


defaults = pipeline.DEFAULTS

with DAG(
    dag_id="retrain_digits",
    description="Retrain the digits CNN with DDP on Spark; promote it in MLflow if it is better",
    schedule=pipeline.SCHEDULE,
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    default_args={
        "owner": "ml-platform",
        "retries": 1,
        "retry_delay": datetime.timedelta(minutes=5),
    },
    params={
        "state": Param(
            pipeline.default_state(), type="string", description="pipeline state directory"
        ),
        "epochs": Param(defaults["epochs"], type="integer", minimum=1, description="epochs"),
        "lr": Param(defaults["lr"], type="number", exclusiveMinimum=0, description="SGD rate"),
        "batch_size": Param(
            defaults["batch_size"], type="integer", minimum=1, description="per-rank batch size"
        ),
        "seed": Param(defaults["seed"], type="integer", description="split and init seed"),
        "num_processes": Param(
            defaults["num_processes"],
            type="integer",
            minimum=1,
            description="DDP ranks, one per barrier task (the embedded Spark has 2 slots)",
        ),
    },
    tags=["sparktorch_ops", "ml"],
    doc_md=__doc__,
) as dag:

    @task
    def append_data(state: str, day: str, seed: int) -> dict[str, Any]:
        """Append the day's rows to the Parquet table (embedded Spark); write the held-out split."""
        written = pipeline.append_day_on_embedded_spark(state, day, seed=int(seed))
        log.info("%(day_rows)d rows for %(ds)s in %(table)s (%(days)d days)", written)
        return written

    data = append_data("{{ params.state }}", DAY, "{{ params.seed }}")

    @task
    def champion(state: str) -> dict[str, Any]:
        """MLflow's tracking URI and experiment, and the champion's weights as a local file
        (training warm-starts from it; the ranks never call MLflow)."""
        pipeline.ensure_experiment(state)
        current = pipeline.champion(state)
        weights = pipeline.champion_file(state)
        if current is not None:
            log.info(
                "training warm-starts from champion %s v%s (accuracy %.4f): %s",
                pipeline.MODEL_NAME,
                current["version"],
                current["accuracy"],
                weights,
            )
        else:
            log.info("no champion yet: training starts from scratch")
        return {
            "tracking_uri": pipeline.tracking_uri(state),
            "experiment": pipeline.EXPERIMENT,
            "weights": weights,
        }

    model = champion("{{ params.state }}")

    train = TorchDistributorOperator(
        task_id="train",
        train=train_digits,
        train_kwargs={
            "epochs": "{{ params.epochs }}",
            "lr": "{{ params.lr }}",
            "batch_size": "{{ params.batch_size }}",
            "seed": "{{ params.seed }}",
        },
        # Every day up to this run's logical date; Spark lays the rows out over the ranks.
        input_sql="SELECT pixels, label FROM parquet.`"
        "{{ ti.xcom_pull(task_ids='append_data')['table'] }}` WHERE ds <= '" + DAY + "'",
        num_processes="{{ params.num_processes }}",
        local_mode=False,
        use_gpu=False,
        spark_conf=dict(pipeline.SPARK_CONF),
        # The champion's weights before epoch 0; a retry of this task resumes from its own
        # checkpoints instead (under result_location, kept across tries).
        warm_start_from="{{ ti.xcom_pull(task_ids='champion')['weights'] }}",
        mlflow_experiment="{{ ti.xcom_pull(task_ids='champion')['experiment'] }}",
        mlflow_tracking_uri="{{ ti.xcom_pull(task_ids='champion')['tracking_uri'] }}",
        # The state_dict is not JSON: it goes here and the XCom carries its URI.
        result_location=RESULTS,
        timeout=datetime.timedelta(minutes=20),
        execution_timeout=datetime.timedelta(minutes=30),
        deferrable=DEFERRABLE,
    )
    [data, model] >> train

    @task
    def evaluate(summary: dict[str, Any], data: dict[str, Any], results: str) -> dict[str, float]:
        """Accuracy and loss of the trained weights on the held-out split."""
        from sparktorch_ops.airflow import load_result

        trained = load_result(summary, result_location=results)
        metrics: dict[str, float] = pipeline.evaluate(trained["state_dict"], data["holdout"])
        metrics["train_rows"] = float(summary["input"]["rows"])
        metrics["train_loss"] = float(trained["losses"][-1])
        return metrics

    @task
    def publish(
        summary: dict[str, Any], metrics: dict[str, float], state: str, results: str
    ) -> dict[str, Any]:
        """Log the model and scores on the training's MLflow run, register a new version and
        move ``champion`` to it only if it beats the champion."""
        from sparktorch_ops.airflow import load_result

        trained = load_result(summary, result_location=results)
        record: dict[str, Any] = pipeline.publish(
            state, summary["mlflow_run_id"], trained["state_dict"], metrics
        )
        previous = record.get("previous") or {}
        log.info(
            "%s v%s: accuracy %.4f (champion before: %s): %s",
            pipeline.MODEL_NAME,
            record["version"],
            metrics["accuracy"],
            f"v{previous['version']} {previous['accuracy']:.4f}" if previous else "none",
            "now champion" if record["promoted"] else "the champion stays",
        )
        return record

    metrics = evaluate(train.output, data, RESULTS)
    publish(train.output, metrics, "{{ params.state }}", RESULTS)


if __name__ == "__main__":
    dag.test()
