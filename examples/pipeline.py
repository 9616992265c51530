"""The steps around training that the example pipelines (dags/, flows/) share.

append the day's rows -> (train with sparktorch_ops on the rows up to that day) -> evaluate ->
publish a versioned model, promoted only when it beats the current one. Everything lives under
a registry directory:

    <registry>/warehouse/digits/ds=YYYY-MM-DD/*.parquet   the training rows, one partition a day
    <registry>/data/holdout-<seed>.npz                     the held-out test split (fixed)
    <registry>/models/<version>/model.pt, metrics.json
    <registry>/current.json            the promoted version and its metrics

The "arriving data" is simulated from scikit-learn's digits: each day brings a sample of the
training split (chosen by the date, so a rerun of a day writes the same rows) with a little
noise; the test split never enters the table.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ddp_train import DigitsCNN, load_digits

# Embedded Spark for the pipelines: 2 task slots on this machine, so 2 barrier ranks.
SPARK_CONF = {"spark.master": "local[2]"}
ROWS_PER_DAY = 600


def prepare_data(registry: str, seed: int = 0) -> str:
    """Write the train/test split of scikit-learn's digits (fixed seed); return its path."""
    import numpy as np

    path = Path(registry) / "data" / f"digits-{seed}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {key: value.numpy() for key, value in load_digits(seed).items()}
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return str(path)


def table_path(registry: str) -> str:
    """The Parquet table the pipelines train on (partitioned by ``ds``)."""
    return str(Path(registry).resolve() / "warehouse" / "digits")


def training_query(registry: str, ds: str) -> str:
    """The rows a run for day ``ds`` trains on: every partition up to and including ``ds``."""
    return f"SELECT pixels, label FROM parquet.`{table_path(registry)}` WHERE ds <= '{ds}'"


def append_day(spark: Any, registry: str, ds: str, seed: int = 0) -> dict[str, Any]:
    """Write day ``ds``'s rows into the table (replacing only that day's partition, so a retry
    or a rerun of the day writes the same rows once) and the held-out split; return where.

    Returns:
        ``{"table", "holdout", "ds", "day_rows", "days"}``.
    """
    import datetime

    import numpy as np

    day = datetime.date.fromisoformat(ds)
    holdout = prepare_data(registry, seed)
    arrays = dict(np.load(holdout))
    rng = np.random.default_rng(day.toordinal())
    picked = rng.choice(len(arrays["y_train"]), size=ROWS_PER_DAY, replace=False)
    pixels = arrays["x_train"][picked].reshape(ROWS_PER_DAY, 64)
    pixels = np.clip(pixels + rng.normal(0.0, 0.05, pixels.shape), 0.0, 1.0).astype("float32")
    rows = [
        (row.tolist(), int(label), ds)
        for row, label in zip(pixels, arrays["y_train"][picked], strict=True)
    ]
    table = table_path(registry)
    frame = spark.createDataFrame(rows, "pixels array<float>, label int, ds string")
    (
        frame.write.mode("overwrite")
        .option("partitionOverwriteMode", "dynamic")
        .partitionBy("ds")
        .parquet(table)
    )
    days = spark.read.parquet(table).select("ds").distinct().count()
    return {"table": table, "holdout": holdout, "ds": ds, "day_rows": len(rows), "days": days}


def append_day_on_embedded_spark(registry: str, ds: str, seed: int = 0) -> dict[str, Any]:
    """:func:`append_day` on the pipelines' embedded Spark (started and stopped here)."""
    from sparktorch_ops.spark import SparkSettings, get_session, stop_session

    handle = get_session(SparkSettings(conf=SPARK_CONF, app_name="retrain-digits-data"))
    try:
        return append_day(handle.session, registry, ds, seed)
    finally:
        stop_session(handle)


def evaluate(state_dict: dict[str, Any], data_path: str) -> dict[str, float]:
    """Test accuracy and loss of the weights on the held-out split."""
    import torch
    import torch.nn.functional as F

    data = load_digits(data_path=data_path)
    model = DigitsCNN()
    model.load_state_dict(state_dict)
    model.eval()
    with torch.no_grad():
        logits = model(data["x_test"])
        loss = float(F.cross_entropy(logits, data["y_test"]))
        accuracy = float((logits.argmax(1) == data["y_test"]).float().mean())
    return {"accuracy": accuracy, "loss": loss}


def current_model(registry: str) -> dict[str, Any] | None:
    """The promoted model's record, or None before the first promotion."""
    path = Path(registry) / "current.json"
    if not path.exists():
        return None
    record: dict[str, Any] = json.loads(path.read_text())
    return record


def champion_file(registry: str) -> str | None:
    """The promoted model's weights file (what the next training warm-starts from), or None."""
    current = current_model(registry)
    if current is None or not Path(current["path"]).is_file():
        return None
    return str(current["path"])


def publish(
    registry: str, state_dict: dict[str, Any], metrics: dict[str, float], version: str
) -> dict[str, Any]:
    """Save the model as ``version``; promote it when its accuracy beats the current model's.

    Returns:
        ``{"version", "path", "metrics", "promoted", "previous"}``.
    """
    import torch

    target = Path(registry) / "models" / version
    target.mkdir(parents=True, exist_ok=True)
    model_path = target / "model.pt"
    torch.save(state_dict, model_path)
    (target / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    previous = current_model(registry)
    promoted = previous is None or metrics["accuracy"] > previous["metrics"]["accuracy"]
    record = {"version": version, "path": str(model_path), "metrics": metrics}
    if promoted:
        current = Path(registry) / "current.json"
        tmp = current.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
        os.replace(tmp, current)
    return {**record, "promoted": promoted, "previous": previous}
