"""Nightly retraining with Prefect: append the day's data -> train (DDP, 2 ranks, on Spark) ->
evaluate -> register the model in MLflow, promoting it only if it beats the champion.

The data step appends the run's day to a Parquet table partitioned by ``ds`` (a rerun of the
day replaces only that day's partition); training runs in barrier mode on an embedded Spark
(``local[2]``: two barrier tasks, one DDP rank each) on every day up to the run's, each rank
reading its equal share with ``sparktorch_ops.data.partition_loader``. The model is
examples/ddp_train.py's CNN on scikit-learn's digits; the steps around training are
examples/pipeline.py's. Each flow run is one MLflow run (experiment ``retrain-digits``) with the
training run nested under it (its metric curves, logged by the driver); the model and its
held-out scores are logged on the flow's run, registered as a new version of ``digits-cnn``, and
the ``champion`` alias moves to it only when its accuracy is higher. Training warm-starts from
the champion. Everything lives under ``--state`` (default ``$SPARKTORCH_STATE``, else
``<repo>/.state``, as for the DAG; MLflow: ``MLFLOW_TRACKING_URI`` when set, else
``<state>/mlflow.db``). Defaults and schedule are examples/pipeline.py's, shared with the DAG.

    python flows/retrain_digits.py --once            # one run now (Prefect's ephemeral server)
    python flows/retrain_digits.py --once --day 2025-03-01     # the run for a past day
    python flows/retrain_digits.py                   # serve: a run every night at 03:00
    python flows/retrain_digits.py --cron "*/30 * * * *" --epochs 5

Served, the flow runs on the schedule until the process is stopped (Ctrl-C); cancelling a run
in the UI stops its training and leaves no process behind.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from sparktorch_ops.prefect import run_torch_distributor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import ddp_train  # noqa: E402
import pipeline  # noqa: E402

DEFAULT_STATE = pipeline.default_state()  # $SPARKTORCH_STATE, else <repo>/.state (as the DAG)
DEFAULTS = pipeline.DEFAULTS

# The training task as this flow uses it: its own name (and so artifact keys train-digits-*),
# one retry of the whole distributed job, and an upper bound on its time.
train_digits = run_torch_distributor.with_options(
    name="train-digits", retries=1, retry_delay_seconds=5, timeout_seconds=3600
)


@task(cache_policy=NO_CACHE)
def append_data(state: str, day: str, seed: int) -> dict[str, Any]:
    """Append the day's rows to the Parquet table (embedded Spark); write the held-out split."""
    written = pipeline.append_day_on_embedded_spark(state, day, seed)
    get_run_logger().info("%(day_rows)d rows for %(ds)s in %(table)s (%(days)d days)", written)
    return written


@task(cache_policy=NO_CACHE)
def evaluate(state_dict: dict[str, Any], data_path: str) -> dict[str, float]:
    """Test accuracy and loss of the trained weights on the held-out split."""
    metrics = pipeline.evaluate(state_dict, data_path)
    get_run_logger().info("test accuracy %.4f, loss %.4f", metrics["accuracy"], metrics["loss"])
    return metrics


@task(cache_policy=NO_CACHE)
def publish(
    state: str, run_id: str, state_dict: dict[str, Any], metrics: dict[str, float]
) -> dict[str, Any]:
    """Log the model and scores on the flow's MLflow run, register a new version, and move
    ``champion`` to it only if it beats the champion."""
    record = pipeline.publish(state, run_id, state_dict, metrics)
    previous = record["previous"]
    before = f"v{previous['version']} ({previous['accuracy']:.4f})" if previous else "none"
    verdict = "now champion" if record["promoted"] else "not promoted (the champion is better)"
    name = f"{pipeline.MODEL_NAME} v{record['version']}"
    get_run_logger().info(
        "%s (accuracy %.4f) %s; champion before: %s", name, metrics["accuracy"], verdict, before
    )
    create_markdown_artifact(
        key="retrain-digits-model",
        description="The model version this run registered",
        markdown=(
            f"### {name}: {verdict}\n\n"
            "| | |\n|---|---|\n"
            f"| MLflow run | `{run_id}` |\n"
            f"| Test accuracy | {metrics['accuracy']:.4f} |\n"
            f"| Test loss | {metrics['loss']:.4f} |\n"
            f"| Champion before this run | {before} |\n"
        ),
    )
    return {**{k: v for k, v in record.items() if k != "previous"}, "previous": before}


def _scheduled_day() -> str:
    """The day this run is for: its scheduled start (today for a run started by hand)."""
    scheduled = flow_run.get_scheduled_start_time()
    return str(scheduled.date().isoformat())


@flow(name="retrain-digits")
def retrain_digits(
    state: str = DEFAULT_STATE,
    epochs: int = DEFAULTS["epochs"],
    lr: float = DEFAULTS["lr"],
    batch_size: int = DEFAULTS["batch_size"],
    seed: int = DEFAULTS["seed"],
    num_processes: int = DEFAULTS["num_processes"],
    day: str | None = None,
) -> dict[str, Any]:
    """Retrain the digits model with DDP on Spark and register it, promoting it if better.

    Args:
        state: directory holding the table, the held-out split and the MLflow store.
        epochs: training epochs.
        lr: SGD learning rate.
        batch_size: per-rank batch size.
        seed: data split and initialisation seed.
        num_processes: DDP ranks, one per barrier task (the embedded Spark has 2 slots).
        day: the day (YYYY-MM-DD) whose data this run appends and trains up to (default: the
            run's scheduled day).

    Returns:
        The registered version: version, run_id, metrics, promoted, previous (the champion
        before, in words).
    """
    import mlflow

    day = day or _scheduled_day()
    data = append_data(state, day, seed)
    experiment_id = pipeline.ensure_experiment(state)
    champion = pipeline.champion_file(state)
    logger = get_run_logger()
    logger.info(
        f"training warm-starts from the champion's weights {champion}"
        if champion
        else "no champion yet: training starts from scratch"
    )
    # The flow's MLflow run: the training run nests under it; the model is logged on it.
    with (
        pipeline.using_tracking_uri(state),
        mlflow.start_run(experiment_id=experiment_id, run_name=f"retrain-digits {day}") as run,
    ):
        mlflow.set_tags({"prefect.flow_run_id": str(flow_run.get_id()), "ds": day})
        trained = train_digits(
            ddp_train.train_on_partition,
            train_kwargs={"epochs": epochs, "lr": lr, "batch_size": batch_size, "seed": seed},
            input_sql=pipeline.training_query(state, day),
            num_processes=num_processes,
            local_mode=False,
            use_gpu=False,
            spark_conf=pipeline.SPARK_CONF,
            # The champion's weights before epoch 0; a retry resumes from its checkpoints.
            warm_start_from=champion,
            mlflow_experiment=pipeline.EXPERIMENT,
            mlflow_tracking_uri=pipeline.tracking_uri(state),
        )
        metrics = evaluate(trained["state_dict"], data["holdout"])
    record = publish(state, run.info.run_id, trained["state_dict"], metrics)
    return record


def main(argv: list[str] | None = None) -> int:
    """Run the flow once (``--once``) or serve it on a cron schedule."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--once", action="store_true", help="run the flow once and exit")
    parser.add_argument(
        "--state", default=DEFAULT_STATE, help="pipeline state directory ($SPARKTORCH_STATE)"
    )
    parser.add_argument("--epochs", type=int, default=DEFAULTS["epochs"])
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    parser.add_argument("--num-processes", type=int, default=DEFAULTS["num_processes"])
    parser.add_argument("--day", default=None, help="YYYY-MM-DD (default: the run's day)")
    parser.add_argument("--cron", default=pipeline.SCHEDULE, help="schedule when serving")
    parser.add_argument("--name", default="nightly", help="deployment name when serving")
    args = parser.parse_args(argv)
    params: dict[str, Any] = {
        "state": str(Path(args.state).resolve()),
        "epochs": args.epochs,
        "lr": args.lr,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "num_processes": args.num_processes,
    }
    if args.day:
        params["day"] = args.day
    if args.once:
        state = retrain_digits(**params, return_state=True)
        if not state.is_completed():
            print(f"retrain-digits: {state.name}: {state.message}", file=sys.stderr)
            return 1
        record = state.result()
        print(
            f"retrain-digits: digits-cnn v{record['version']} accuracy "
            f"{record['metrics']['accuracy']:.4f} "
            f"{'now champion' if record['promoted'] else 'not promoted'} (MLflow run "
            f"{record['run_id']})"
        )
        return 0
    retrain_digits.serve(name=args.name, cron=args.cron, parameters=params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
