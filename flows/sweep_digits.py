"""A learning-rate sweep of the digits CNN with Prefect: the day's data -> one training per
learning rate, at once (``.map()`` on the flow's thread pool) -> evaluate each -> register each in
MLflow, promoting the best only if it beats the champion.

The trainings share one embedded Spark session in the flow's process (``local[2]``): each is a
1-rank barrier run, so two train at once and the third waits for a free slot (it says so in its
log). Each task run has its own logs, artifacts (``sweep-lr-<n>-*``), checkpoint directory and
MLflow run (tagged with its task run). To bound how many train at once across flows, give the
task a tag and a Prefect global concurrency limit on it (``prefect concurrency-limit create
sweep 2``). The steps around training are the nightly flow's (``examples/pipeline.py``), on the
same state directory.

    python flows/sweep_digits.py --once --epochs 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task, unmapped
from prefect.cache_policies import NO_CACHE

from sparktorch_ops.prefect import run_torch_distributor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import ddp_train  # noqa: E402
import pipeline  # noqa: E402

LEARNING_RATES = (0.02, 0.05, 0.1)
DEFAULTS = pipeline.DEFAULTS


@task(cache_policy=NO_CACHE)
def append_data(state: str, day: str, seed: int) -> dict[str, Any]:
    """Append the day's rows to the Parquet table; write the held-out split."""
    return pipeline.append_day_on_embedded_spark(state, day, seed)


@task(cache_policy=NO_CACHE)
def evaluate(state_dict: dict[str, Any], data_path: str) -> dict[str, float]:
    """Test accuracy and loss of one training's weights on the held-out split."""
    return pipeline.evaluate(state_dict, data_path)


def _mlflow_run_of(state: str, task_run_id: Any) -> str:
    """The MLflow run a training task run made (tagged ``prefect.task_run_id``)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(pipeline.tracking_uri(state))
    experiment = client.get_experiment_by_name(pipeline.EXPERIMENT)
    assert experiment is not None
    found = client.search_runs(
        [experiment.experiment_id], f"tags.`prefect.task_run_id` = '{task_run_id}'"
    )
    if len(found) != 1:
        raise RuntimeError(f"task run {task_run_id} has {len(found)} MLflow runs, not one")
    return str(found[0].info.run_id)


@flow(name="sweep-digits")
def sweep_digits(
    state: str = pipeline.default_state(),
    epochs: int = DEFAULTS["epochs"],
    batch_size: int = DEFAULTS["batch_size"],
    seed: int = DEFAULTS["seed"],
    day: str | None = None,
    learning_rates: tuple[float, ...] = LEARNING_RATES,
) -> dict[str, Any]:
    """Train once per learning rate at once; register each; promote the best if it is better.

    Args:
        state: directory holding the table, the held-out split and the MLflow store.
        epochs: training epochs of each run.
        batch_size: per-rank batch size.
        seed: data split and initialisation seed.
        day: the day (YYYY-MM-DD) whose data this run appends and trains up to (default today).
        learning_rates: one training per rate.

    Returns:
        ``examples/pipeline.py``'s ``publish_best`` record: every version, the best, whether
        it was promoted.
    """
    import datetime

    from sparktorch_ops.spark.session import SparkSettings, get_session, stop_session

    day = day or datetime.date.today().isoformat()
    data = append_data(state, day, seed)
    pipeline.ensure_experiment(state)
    # The one embedded session every training of this flow shares: barrier mode reuses the
    # process's running session (one this flow starts is stopped at its end).
    session = get_session(SparkSettings(conf=pipeline.SPARK_CONF, app_name="sweep-digits"))
    try:
        futures = run_torch_distributor.map(
            unmapped(ddp_train.train_on_partition),
            train_kwargs=[
                {"epochs": epochs, "lr": lr, "batch_size": batch_size, "seed": seed}
                for lr in learning_rates
            ],
            artifact_key=[f"sweep-lr-{index}" for index in range(len(learning_rates))],
            input_sql=unmapped(pipeline.training_query(state, day)),
            num_processes=unmapped(1),
            local_mode=unmapped(False),
            use_gpu=unmapped(False),
            mlflow_experiment=unmapped(pipeline.EXPERIMENT),
            mlflow_tracking_uri=unmapped(pipeline.tracking_uri(state)),
        )
        trained = [future.result() for future in futures]
    finally:
        stop_session(session)
    candidates = [
        {
            "run_id": _mlflow_run_of(state, future.task_run_id),
            "state_dict": result["state_dict"],
            "metrics": evaluate(result["state_dict"], data["holdout"]),
            "params": {"lr": lr},
        }
        for future, result, lr in zip(futures, trained, learning_rates, strict=True)
    ]
    record: dict[str, Any] = pipeline.publish_best(state, candidates)
    best = record["best"]
    get_run_logger().info(
        "%s v%s (lr %s) is the best of %d (accuracy %.4f): %s",
        pipeline.MODEL_NAME,
        best["version"],
        best["params"]["lr"],
        len(candidates),
        best["metrics"]["accuracy"],
        "now champion" if record["promoted"] else "the champion stays",
    )
    return record


def main(argv: list[str] | None = None) -> int:
    """Run the sweep once."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--once", action="store_true", help="run the flow once (the default)")
    parser.add_argument("--state", default=pipeline.default_state())
    parser.add_argument("--epochs", type=int, default=DEFAULTS["epochs"])
    parser.add_argument("--day", default=None, help="YYYY-MM-DD (default: today)")
    args = parser.parse_args(argv)
    state = sweep_digits(
        state=str(Path(args.state).resolve()), epochs=args.epochs, day=args.day, return_state=True
    )
    if not state.is_completed():
        print(f"sweep-digits: {state.name}: {state.message}", file=sys.stderr)
        return 1
    record = state.result()
    best = record["best"]
    print(
        f"sweep-digits: best lr {best['params']['lr']}: digits-cnn v{best['version']} accuracy "
        f"{best['metrics']['accuracy']:.4f} "
        f"{'now champion' if record['promoted'] else 'not promoted'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
