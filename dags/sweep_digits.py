"""A learning-rate sweep of the digits CNN: the day's data -> one training per learning rate, in
parallel (dynamic task mapping) -> evaluate each -> register each in MLflow, promoting the best
only if it beats the champion.

``train`` is :class:`~sparktorch_ops.airflow.TorchDistributorOperator` mapped over
``train_kwargs`` (one learning rate each, ``LEARNING_RATES``): each mapped task instance runs in
its own task process with its own embedded Spark (``local[1]``: one barrier task, one rank) and
has its own result, checkpoint directory and MLflow run (tagged with ``airflow.map_index``).
``max_active_tis_per_dag`` bounds how many train at once (the executor's parallelism and pools
bound it too). ``evaluate`` is mapped over the trainings' summaries; ``publish`` registers every
candidate as a version of ``digits-cnn`` and moves ``champion`` to the most accurate one only if
it beats the current champion. The steps around training are the nightly DAG's
(``examples/pipeline.py``), on the same state directory.

    airflow dags test sweep_digits -c '{"epochs": 2}'

Under a scheduler the mapped trainings overlap as far as the executor allows (``LocalExecutor``
with ``parallelism`` >= 3 runs all three at once).
"""

from __future__ import annotations

import datetime
import logging
import sys
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, Param, task

from sparktorch_ops.airflow import TorchDistributorOperator

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = str(REPO / "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import pipeline  # noqa: E402  (the steps and defaults both pipelines share)

log = logging.getLogger("airflow.task")
LEARNING_RATES = (0.02, 0.05, 0.1)
RESULTS = "{{ params.state }}/runs"
DAY = "{{ ds if ds is defined and ds else dag_run.run_after.strftime('%Y-%m-%d') }}"
defaults = pipeline.DEFAULTS


def train_digits(**kwargs: Any) -> dict[str, Any]:
    """Run on every rank: ``examples/ddp_train.py``'s DDP ``train_on_partition(**kwargs)``."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import ddp_train

    result: dict[str, Any] = ddp_train.train_on_partition(**kwargs)
    return result


with DAG(
    dag_id="sweep_digits",
    description="Train the digits CNN for several learning rates at once; promote the best",
    schedule=None,
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
        "batch_size": Param(
            defaults["batch_size"], type="integer", minimum=1, description="per-rank batch size"
        ),
        "seed": Param(defaults["seed"], type="integer", description="split and init seed"),
    },
    tags=["sparktorch_ops", "ml"],
    doc_md=__doc__,
) as dag:

    @task
    def append_data(state: str, day: str, seed: int) -> dict[str, Any]:
        """Append the day's rows to the Parquet table (embedded Spark); write the held-out split."""
        return pipeline.append_day_on_embedded_spark(state, day, seed=int(seed))

    @task
    def champion(state: str) -> dict[str, Any]:
        """MLflow's tracking URI and experiment (every training warm-starts from scratch: the
        sweep compares learning rates, not continuations)."""
        pipeline.ensure_experiment(state)
        return {"tracking_uri": pipeline.tracking_uri(state), "experiment": pipeline.EXPERIMENT}

    data = append_data("{{ params.state }}", DAY, "{{ params.seed }}")
    tracking = champion("{{ params.state }}")

    train = TorchDistributorOperator.partial(
        task_id="train",
        train=train_digits,
        input_sql="SELECT pixels, label FROM parquet.`"
        "{{ ti.xcom_pull(task_ids='append_data')['table'] }}` WHERE ds <= '" + DAY + "'",
        num_processes=1,
        local_mode=False,
        use_gpu=False,
        spark_conf={"spark.master": "local[1]"},
        mlflow_experiment="{{ ti.xcom_pull(task_ids='champion')['experiment'] }}",
        mlflow_tracking_uri="{{ ti.xcom_pull(task_ids='champion')['tracking_uri'] }}",
        result_location=RESULTS,
        max_active_tis_per_dag=len(LEARNING_RATES),
        timeout=datetime.timedelta(minutes=20),
        execution_timeout=datetime.timedelta(minutes=30),
    ).expand(
        train_kwargs=[
            {
                "epochs": "{{ params.epochs }}",
                "lr": lr,
                "batch_size": "{{ params.batch_size }}",
                "seed": "{{ params.seed }}",
            }
            for lr in LEARNING_RATES
        ]
    )
    [data, tracking] >> train

    @task
    def evaluate(summary: dict[str, Any], data: dict[str, Any], results: str) -> dict[str, float]:
        """Accuracy and loss of one training's weights on the held-out split."""
        from sparktorch_ops.airflow import load_result

        trained = load_result(summary, result_location=results)
        return pipeline.evaluate(trained["state_dict"], data["holdout"])

    @task
    def publish(
        summaries: list[dict[str, Any]], metrics: list[dict[str, float]], state: str, results: str
    ) -> dict[str, Any]:
        """Register every training as a version; move ``champion`` to the best if it beats it."""
        from sparktorch_ops.airflow import load_result

        candidates = [
            {
                "run_id": summary["mlflow_run_id"],
                "state_dict": load_result(summary, result_location=results)["state_dict"],
                "metrics": scores,
                "params": {"lr": lr},
            }
            for summary, scores, lr in zip(summaries, metrics, LEARNING_RATES, strict=True)
        ]
        record: dict[str, Any] = pipeline.publish_best(state, candidates)
        best, previous = record["best"], record["previous"] or {}
        log.info(
            "%s v%s (lr %s): accuracy %.4f, the best of %d (champion before: %s): %s",
            pipeline.MODEL_NAME,
            best["version"],
            best["params"]["lr"],
            best["metrics"]["accuracy"],
            len(candidates),
            f"v{previous['version']} {previous['accuracy']:.4f}" if previous else "none",
            "now champion" if record["promoted"] else "the champion stays",
        )
        return record

    scores = evaluate.partial(data=data, results=RESULTS).expand(summary=train.output)
    publish(train.output, scores, "{{ params.state }}", RESULTS)


if __name__ == "__main__":
    dag.test()
