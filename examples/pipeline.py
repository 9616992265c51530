"""The steps around training that the example pipelines (dags/, flows/) share.

prepare data -> (train with sparktorch_ops) -> evaluate -> publish a versioned model, promoted
only when it beats the current one. Everything lives under a registry directory:

    <registry>/data/digits-<seed>.npz
    <registry>/models/<version>/model.pt, metrics.json
    <registry>/current.json            the promoted version and its metrics
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ddp_train import DigitsCNN, load_digits


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
