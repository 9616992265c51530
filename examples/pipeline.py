"""The steps around training that the example pipelines (dags/, flows/) share.

append the day's rows -> (train with sparktorch_ops on the rows up to that day, tracked in
MLflow) -> evaluate -> register a new version of the model in MLflow's registry, moving its
``champion`` alias only when it beats the champion. Everything lives under a state directory:

    <state>/warehouse/digits/ds=YYYY-MM-DD/*.parquet   the training rows, one partition a day
    <state>/data/digits-<seed>.npz                     the held-out test split (fixed)
    <state>/mlflow.db, <state>/mlartifacts/            MLflow (unless MLFLOW_TRACKING_URI is set)
    <state>/champion/digits-cnn-v<N>.pt                the champion's weights, for warm starts

The "arriving data" is simulated from scikit-learn's digits: each day brings a sample of the
training split (chosen by the date, so a rerun of a day writes the same rows) with a little
noise; the test split never enters the table.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# ddp_train (and torch) is imported in the functions that need it: a scheduler parsing the
# DAG imports this module and should not pay for torch.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# MLflow points its loggers at raw stderr, which Airflow's task supervisor records at ERROR:
# leave them to the process's logging (the task log), at their own levels.
os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
log = logging.getLogger(__name__)

# Embedded Spark for the pipelines: 2 task slots on this machine, so 2 barrier ranks.
SPARK_CONF = {"spark.master": "local[2]"}
# What both pipelines run by default, nightly at 03:00 (the DAG's params, the flow's arguments).
SCHEDULE = "0 3 * * *"
DEFAULTS: dict[str, Any] = {
    "epochs": 10,
    "lr": 0.05,
    "batch_size": 64,
    "seed": 0,
    "num_processes": 2,
}
#: The environment variable naming the state directory of both pipelines.
STATE_ENV = "SPARKTORCH_STATE"
ROWS_PER_DAY = 600
# MLflow: the experiment of the training runs, the registered model and its serving alias.
EXPERIMENT = "retrain-digits"
MODEL_NAME = "digits-cnn"
CHAMPION = "champion"


def default_state() -> str:
    """The pipelines' state directory: ``$SPARKTORCH_STATE``, else ``<repo>/.state``."""
    return os.environ.get(STATE_ENV) or str(Path(__file__).resolve().parents[1] / ".state")


def prepare_data(state: str, seed: int = 0) -> str:
    """Write the train/test split of scikit-learn's digits (fixed seed); return its path."""
    import numpy as np
    from ddp_train import load_digits

    path = Path(state) / "data" / f"digits-{seed}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {key: value.numpy() for key, value in load_digits(seed).items()}
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return str(path)


def table_path(state: str) -> str:
    """The Parquet table the pipelines train on (partitioned by ``ds``)."""
    return str(Path(state).resolve() / "warehouse" / "digits")


def training_query(state: str, ds: str) -> str:
    """The rows a run for day ``ds`` trains on: every partition up to and including ``ds``."""
    return f"SELECT pixels, label FROM parquet.`{table_path(state)}` WHERE ds <= '{ds}'"


def append_day(spark: Any, state: str, ds: str, seed: int = 0) -> dict[str, Any]:
    """Write day ``ds``'s rows into the table (replacing only that day's partition, so a retry
    or a rerun of the day writes the same rows once) and the held-out split; return where.

    Returns:
        ``{"table", "holdout", "ds", "day_rows", "days"}``.
    """
    import datetime

    import numpy as np

    day = datetime.date.fromisoformat(ds)
    holdout = prepare_data(state, seed)
    arrays = dict(np.load(holdout))
    rng = np.random.default_rng(day.toordinal())
    picked = rng.choice(len(arrays["y_train"]), size=ROWS_PER_DAY, replace=False)
    pixels = arrays["x_train"][picked].reshape(ROWS_PER_DAY, 64)
    pixels = np.clip(pixels + rng.normal(0.0, 0.05, pixels.shape), 0.0, 1.0).astype("float32")
    rows = [
        (row.tolist(), int(label), ds)
        for row, label in zip(pixels, arrays["y_train"][picked], strict=True)
    ]
    table = table_path(state)
    frame = spark.createDataFrame(rows, "pixels array<float>, label int, ds string")
    (
        frame.write.mode("overwrite")
        .option("partitionOverwriteMode", "dynamic")
        .partitionBy("ds")
        .parquet(table)
    )
    days = spark.read.parquet(table).select("ds").distinct().count()
    return {"table": table, "holdout": holdout, "ds": ds, "day_rows": len(rows), "days": days}


def append_day_on_embedded_spark(state: str, ds: str, seed: int = 0) -> dict[str, Any]:
    """:func:`append_day` on the pipelines' embedded Spark (started and stopped here)."""
    from sparktorch_ops.spark.session import SparkSettings, get_session, stop_session

    handle = get_session(SparkSettings(conf=SPARK_CONF, app_name="retrain-digits-data"))
    try:
        return append_day(handle.session, state, ds, seed)
    finally:
        stop_session(handle)


def evaluate(state_dict: dict[str, Any], data_path: str) -> dict[str, float]:
    """Test accuracy and loss of the weights on the held-out split."""
    import torch
    import torch.nn.functional as F
    from ddp_train import DigitsCNN, load_digits

    data = load_digits(data_path=data_path)
    model = DigitsCNN()
    model.load_state_dict(state_dict)
    model.eval()
    with torch.no_grad():
        logits = model(data["x_test"])
        loss = float(F.cross_entropy(logits, data["y_test"]))
        accuracy = float((logits.argmax(1) == data["y_test"]).float().mean())
    return {"accuracy": accuracy, "loss": loss}


def tracking_uri(state: str) -> str:
    """``MLFLOW_TRACKING_URI`` when set (a shared ``mlflow server``), else a SQLite store under
    the state directory (absolute: MLflow resolves a relative one against the cwd)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or (
        f"sqlite:///{Path(state).resolve() / 'mlflow.db'}"
    )


@contextlib.contextmanager
def using_tracking_uri(state: str) -> Iterator[str]:
    """MLflow's process-wide tracking URI set to the pipeline's for a block, then put back
    (``mlflow.set_tracking_uri`` also writes ``MLFLOW_TRACKING_URI`` into the environment)."""
    import mlflow

    # set_tracking_uri exports the URI too, so the environment tells whether one was set.
    saved = os.environ.get("MLFLOW_TRACKING_URI")
    uri = tracking_uri(state)
    mlflow.set_tracking_uri(uri)
    try:
        yield uri
    finally:
        mlflow.set_tracking_uri(saved)  # None unsets it: MLFLOW_TRACKING_URI rules again
        if saved is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved


class _LinesToLog(io.TextIOBase):
    """A text stream whose lines become INFO records of ``log``."""

    def __init__(self) -> None:
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            if line.strip():
                log.info("%s", line)
        return len(text)

    def flush(self) -> None:
        if self._pending.strip():
            log.info("%s", self._pending)
        self._pending = ""


@contextlib.contextmanager
def notices_logged() -> Iterator[None]:
    """Send what a block prints to stderr to the log at INFO: MLflow prints its notices
    ("Successfully registered model ...", "Created version ...") there, not to a logger."""
    stream = _LinesToLog()
    try:
        with contextlib.redirect_stderr(stream):
            yield
    finally:
        stream.flush()


def ensure_experiment(state: str) -> str:
    """The pipelines' experiment, created with its artifacts under the state directory when the
    store is the embedded SQLite one; its id."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri(state))
    found = client.get_experiment_by_name(EXPERIMENT)
    if found is not None:
        return str(found.experiment_id)
    location = None
    if not os.environ.get("MLFLOW_TRACKING_URI"):  # as tracking_uri() reads it
        location = (Path(state).resolve() / "mlartifacts").as_uri()
    return str(client.create_experiment(EXPERIMENT, artifact_location=location))


def champion(state: str) -> dict[str, Any] | None:
    """The registered model version under the ``champion`` alias: ``version``, ``run_id`` and
    its held-out ``accuracy``; None before the first promotion."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri(state))
    try:
        version = client.get_model_version_by_alias(MODEL_NAME, CHAMPION)
    except MlflowException:  # no registered model, or no alias yet
        return None
    accuracy = client.get_run(version.run_id).data.metrics.get("test_accuracy")
    return {"version": str(version.version), "run_id": version.run_id, "accuracy": accuracy}


def champion_file(state: str) -> str | None:
    """The champion's weights as a local ``torch.save`` file for ``warm_start_from`` (the ranks
    never call MLflow); None before the first promotion."""
    import mlflow
    import torch

    current = champion(state)
    if current is None:
        return None
    with using_tracking_uri(state):
        model = mlflow.pytorch.load_model(f"models:/{MODEL_NAME}/{current['version']}")
    path = Path(state) / "champion" / f"{MODEL_NAME}-v{current['version']}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return str(path)


def register(state: str, run_id: str, state_dict: dict[str, Any], metrics: dict[str, float]) -> str:
    """Log the evaluation and the model on the training's MLflow run and register it as a new
    version of ``digits-cnn`` (no alias moves); the version."""
    import mlflow
    import numpy as np
    import torch
    from ddp_train import DigitsCNN
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri(state))
    for key, value in metrics.items():
        client.log_metric(run_id, f"test_{key}", value)
    model = DigitsCNN()
    model.load_state_dict(state_dict)
    # start_run(run_id=...) refuses a run outside the experiment the process set active
    # (mlflow.set_experiment): make it the run's own for this block, then put it back.
    from mlflow.tracking import fluent

    experiment_id = client.get_run(run_id).info.experiment_id
    active_experiment = fluent._active_experiment_id
    fluent._active_experiment_id = experiment_id
    try:
        with using_tracking_uri(state), mlflow.start_run(run_id=run_id), notices_logged():
            info = mlflow.pytorch.log_model(
                model,
                name="model",
                registered_model_name=MODEL_NAME,
                # A torch.export graph: loads without this repo's code and without unpickling
                # anything. Two rows in the example: a batch of one would fix the batch size.
                serialization_format="pt2",
                input_example=np.zeros((2, 1, 8, 8), dtype="float32"),
                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
            )
    finally:
        fluent._active_experiment_id = active_experiment
    return str(info.registered_model_version)


def promote_if_better(
    state: str, version: str, accuracy: float, previous: dict[str, Any] | None
) -> bool:
    """Move ``champion`` to ``version`` if its accuracy beats ``previous`` (the champion before,
    or None); whether it moved."""
    from mlflow.tracking import MlflowClient

    promoted = previous is None or accuracy > (previous["accuracy"] or 0.0)
    if promoted:
        MlflowClient(tracking_uri(state)).set_registered_model_alias(MODEL_NAME, CHAMPION, version)
    return promoted


def publish(
    state: str, run_id: str, state_dict: dict[str, Any], metrics: dict[str, float]
) -> dict[str, Any]:
    """Register the trained model (:func:`register`) and move the ``champion`` alias to it only
    if it beats the champion.

    Returns:
        ``{"version", "run_id", "metrics", "promoted", "previous"}`` (``previous``: the
        champion before, or None).
    """
    previous = champion(state)
    version = register(state, run_id, state_dict, metrics)
    promoted = promote_if_better(state, version, metrics["accuracy"], previous)
    return {
        "version": version,
        "run_id": run_id,
        "metrics": metrics,
        "promoted": promoted,
        "previous": previous,
    }


def publish_best(state: str, candidates: list[dict[str, Any]]) -> dict[str, Any]:
    """A sweep's end: register every candidate (``run_id``, ``state_dict``, ``metrics`` and its
    ``params``) as a version, then move ``champion`` to the most accurate one only if it beats
    the champion.

    Returns:
        ``{"versions": [{"version", "run_id", "params", "metrics"}...], "best": one of them,
        "promoted", "previous"}``.
    """
    previous = champion(state)
    versions = [
        {
            "version": register(state, c["run_id"], c["state_dict"], c["metrics"]),
            "run_id": c["run_id"],
            "params": c["params"],
            "metrics": c["metrics"],
        }
        for c in candidates
    ]
    best = max(versions, key=lambda v: v["metrics"]["accuracy"])
    promoted = promote_if_better(state, best["version"], best["metrics"]["accuracy"], previous)
    return {"versions": versions, "best": best, "promoted": promoted, "previous": previous}
