"""Nightly retraining of the digits CNN: append the day's data -> DDP training on Spark ->
evaluate -> publish.

``append_data`` writes the logical date's rows into a Parquet table partitioned by ``ds``
(``examples/pipeline.py``; a rerun of the day replaces only that day's partition). ``train`` is
:class:`~sparktorch_ops.airflow.TorchDistributorOperator` in barrier mode on an embedded Spark
(``local[2]``: two barrier tasks, one DDP rank each) with the templated ``input_sql`` selecting
every day up to ``{{ ds }}``; each rank trains on its equal share through
``sparktorch_ops.data.partition_loader`` (``examples/ddp_train.py``'s ``train_on_partition``).
The trained ``state_dict`` is not JSON, so the operator writes it to its result location and its
XCom holds the URI; ``evaluate`` reads it back from there and scores it on the held-out split.
``publish`` saves a versioned model with its metrics in the registry and promotes it only if it
beats the current one.

Run it once, end to end, without a scheduler::

    export AIRFLOW_HOME=$PWD/.state/airflow AIRFLOW__CORE__DAGS_FOLDER=$PWD/dags \
        AIRFLOW__CORE__LOAD_EXAMPLES=False
    airflow db migrate && airflow dags test retrain_digits

The registry is ``$SPARKTORCH_REGISTRY`` (default ``<repo>/.state/registry``), or the run's
``registry`` param (``airflow dags test retrain_digits -c '{"registry": "/tmp/reg"}'``).
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
DEFAULT_REGISTRY = os.environ.get("SPARKTORCH_REGISTRY", str(REPO / ".state" / "registry"))
log = logging.getLogger("airflow.task")
# Where the operator writes the trained weights; load_result reads only from under it.
RESULTS = "{{ params.registry }}/runs"


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


def _spark_conf() -> dict[str, str]:
    _examples()
    import pipeline

    return dict(pipeline.SPARK_CONF)


with DAG(
    dag_id="retrain_digits",
    description="Retrain the digits CNN with DDP (2 processes) and promote it if it is better",
    schedule="0 3 * * *",
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
        "registry": Param(DEFAULT_REGISTRY, type="string", description="model registry dir"),
        "epochs": Param(10, type="integer", minimum=1, description="training epochs"),
        "seed": Param(0, type="integer", description="data split and initialisation seed"),
    },
    tags=["sparktorch_ops", "ml"],
    doc_md=__doc__,
) as dag:

    @task
    def append_data(registry: str, day: str, seed: int) -> dict[str, Any]:
        """Append the day's rows to the Parquet table (embedded Spark); write the held-out split."""
        _examples()
        import pipeline

        written = pipeline.append_day_on_embedded_spark(registry, day, seed=int(seed))
        log.info("%(day_rows)d rows for %(ds)s in %(table)s (%(days)d days)", written)
        return written

    data = append_data("{{ params.registry }}", "{{ ds }}", "{{ params.seed }}")

    @task
    def champion(registry: str) -> str | None:
        """The promoted model's weights file: training warm-starts from it (None: scratch)."""
        _examples()
        import pipeline

        path = pipeline.champion_file(registry)
        if path:
            log.info("training warm-starts from the promoted model %s", path)
        else:
            log.info("no promoted model yet: training starts from scratch")
        return path

    warm = champion("{{ params.registry }}")

    train = TorchDistributorOperator(
        task_id="train",
        train=train_digits,
        train_kwargs={"epochs": "{{ params.epochs }}", "seed": "{{ params.seed }}"},
        # Every day up to this run's logical date; Spark lays the rows out over the ranks.
        input_sql="SELECT pixels, label FROM parquet.`"
        "{{ ti.xcom_pull(task_ids='append_data')['table'] }}` WHERE ds <= '{{ ds }}'",
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        spark_conf=_spark_conf(),
        # Weights of the promoted model before epoch 0; a retry of this task resumes from its
        # own checkpoints instead (under result_location, kept across tries).
        warm_start_from="{{ ti.xcom_pull(task_ids='champion') }}",
        # The state_dict is not JSON: it goes here and the XCom carries its URI.
        result_location=RESULTS,
        timeout=datetime.timedelta(minutes=20),
        execution_timeout=datetime.timedelta(minutes=30),
    )
    [data, warm] >> train

    @task
    def evaluate(summary: dict[str, Any], data: dict[str, Any], results: str) -> dict[str, float]:
        """Accuracy and loss of the trained weights on the held-out split."""
        _examples()
        import pipeline

        from sparktorch_ops.airflow import load_result

        trained = load_result(summary, result_location=results)
        metrics: dict[str, float] = pipeline.evaluate(trained["state_dict"], data["holdout"])
        metrics["train_rows"] = float(summary["input"]["rows"])
        metrics["train_loss"] = float(trained["losses"][-1])
        return metrics

    @task
    def publish(
        summary: dict[str, Any],
        metrics: dict[str, float],
        registry: str,
        version: str,
        results: str,
    ) -> dict[str, Any]:
        """Save the model as a new version; promote it only if it beats the current one."""
        _examples()
        import pipeline

        from sparktorch_ops.airflow import load_result

        trained = load_result(summary, result_location=results)
        record: dict[str, Any] = pipeline.publish(registry, trained["state_dict"], metrics, version)
        previous = record.get("previous") or {}
        verdict = "promoted" if record["promoted"] else "kept the current model"
        log.info(
            "model %s: accuracy %.4f (current: %s): %s",
            version,
            metrics["accuracy"],
            previous.get("metrics", {}).get("accuracy", "none"),
            verdict,
        )
        return {k: v for k, v in record.items() if k != "previous"}

    metrics = evaluate(train.output, data, RESULTS)
    publish(
        train.output,
        metrics,
        "{{ params.registry }}",
        "{{ dag_run.run_after.strftime('%Y%m%dT%H%M%S') }}",
        RESULTS,
    )


if __name__ == "__main__":
    dag.test()
