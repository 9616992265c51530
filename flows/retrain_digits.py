"""Nightly retraining with Prefect: append the day's data -> train (DDP, 2 ranks, on Spark) ->
evaluate -> publish.

The data step appends the run's day to a Parquet table partitioned by ``ds`` (a rerun of the
day replaces only that day's partition); training runs in barrier mode on an embedded Spark
(``local[2]``: two barrier tasks, one DDP rank each) on every day up to the run's, each rank
reading its equal share with ``sparktorch_ops.data.partition_loader``. The model is
examples/ddp_train.py's CNN on scikit-learn's digits; the steps around training are
examples/pipeline.py's. A new version is saved every run and promoted to current only when its
held-out accuracy beats the current model's. Everything lives under ``--registry``.

    python flows/retrain_digits.py --once            # one run now (Prefect's ephemeral server)
    python flows/retrain_digits.py --once --day 2025-03-01     # the run for a past day
    python flows/retrain_digits.py                   # serve: a run every night at 03:00
    python flows/retrain_digits.py --cron "*/30 * * * *" --epochs 5

Served, the flow runs on the schedule until the process is stopped (Ctrl-C); cancelling a run
in the UI stops its training and leaves no process behind.
"""

from __future__ import annotations

import argparse
import datetime
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

DEFAULT_REGISTRY = str(ROOT / ".state" / "registry")

# The training task as this flow uses it: its own name (and so artifact keys train-digits-*),
# one retry of the whole distributed job, and an upper bound on its time.
train_digits = run_torch_distributor.with_options(
    name="train-digits", retries=1, retry_delay_seconds=5, timeout_seconds=3600
)


@task(cache_policy=NO_CACHE)
def append_data(registry: str, day: str, seed: int) -> dict[str, Any]:
    """Append the day's rows to the Parquet table (embedded Spark); write the held-out split."""
    written = pipeline.append_day_on_embedded_spark(registry, day, seed)
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
    registry: str, state_dict: dict[str, Any], metrics: dict[str, float], version: str
) -> dict[str, Any]:
    """Save the model as ``version``; promote it only if it beats the current model."""
    record = pipeline.publish(registry, state_dict, metrics, version)
    previous = record["previous"]
    before = "none"
    if previous:
        before = f"{previous['version']} ({previous['metrics']['accuracy']:.4f})"
    verdict = "promoted to current" if record["promoted"] else "not promoted (current is better)"
    get_run_logger().info(
        "model %s (accuracy %.4f) %s; previous current: %s",
        version,
        metrics["accuracy"],
        verdict,
        before,
    )
    create_markdown_artifact(
        key="retrain-digits-model",
        description="The model this run published",
        markdown=(
            f"### Model {version}: {verdict}\n\n"
            "| | |\n|---|---|\n"
            f"| Path | `{record['path']}` |\n"
            f"| Test accuracy | {metrics['accuracy']:.4f} |\n"
            f"| Test loss | {metrics['loss']:.4f} |\n"
            f"| Current before this run | {before} |\n"
        ),
    )
    published = {k: v for k, v in record.items() if k != "previous"}
    published["previous_version"] = previous["version"] if previous else None
    return published


def _scheduled_day() -> str:
    """The day this run is for: its scheduled start (today for a run started by hand)."""
    scheduled = flow_run.get_scheduled_start_time()
    return str(scheduled.date().isoformat())


def _version() -> str:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    run_id = flow_run.get_id()
    return f"{stamp}-{run_id[:8]}" if run_id else stamp


@flow(name="retrain-digits")
def retrain_digits(
    registry: str = DEFAULT_REGISTRY,
    epochs: int = 10,
    lr: float = 0.05,
    batch_size: int = 64,
    seed: int = 0,
    num_processes: int = 2,
    version: str | None = None,
    day: str | None = None,
) -> dict[str, Any]:
    """Retrain the digits model with DDP and publish it, promoting it if it is better.

    Args:
        registry: directory holding data, model versions and ``current.json``.
        epochs: training epochs.
        lr: SGD learning rate.
        batch_size: per-rank batch size.
        seed: data split and initialisation seed.
        num_processes: DDP ranks, one per barrier task (the embedded Spark has 2 slots).
        version: the model version to publish (default: a UTC timestamp and the run id).
        day: the day (YYYY-MM-DD) whose data this run appends and trains up to (default: the
            run's scheduled day).

    Returns:
        The published record: version, path, metrics, promoted, previous_version.
    """
    day = day or _scheduled_day()
    data = append_data(registry, day, seed)
    champion = pipeline.champion_file(registry)
    get_run_logger().info(
        f"training warm-starts from the promoted model {champion}"
        if champion
        else "no promoted model yet: training starts from scratch"
    )
    trained = train_digits(
        ddp_train.train_on_partition,
        train_kwargs={"epochs": epochs, "lr": lr, "batch_size": batch_size, "seed": seed},
        input_sql=pipeline.training_query(registry, day),
        num_processes=num_processes,
        local_mode=False,
        use_gpu=False,
        spark_conf=pipeline.SPARK_CONF,
        # Weights of the promoted model before epoch 0; a retry resumes from its checkpoints.
        warm_start_from=champion,
    )
    metrics = evaluate(trained["state_dict"], data["holdout"])
    return publish(registry, trained["state_dict"], metrics, version or _version())


def main(argv: list[str] | None = None) -> int:
    """Run the flow once (``--once``) or serve it on a cron schedule."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--once", action="store_true", help="run the flow once and exit")
    parser.add_argument("--registry", default=DEFAULT_REGISTRY)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--day", default=None, help="YYYY-MM-DD (default: the run's day)")
    parser.add_argument("--cron", default="0 3 * * *", help="schedule when serving")
    parser.add_argument("--name", default="nightly", help="deployment name when serving")
    args = parser.parse_args(argv)
    params = {
        "registry": str(Path(args.registry).resolve()),
        "epochs": args.epochs,
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
            f"retrain-digits: version {record['version']} accuracy "
            f"{record['metrics']['accuracy']:.4f} "
            f"{'promoted' if record['promoted'] else 'not promoted'} -> {record['path']}"
        )
        return 0
    retrain_digits.serve(name=args.name, cron=args.cron, parameters=params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
