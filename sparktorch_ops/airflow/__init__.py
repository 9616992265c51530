"""Airflow integration: :class:`TorchDistributorOperator`, its Spark UI link, result loading.

This is the only place where sparktorch_ops imports Airflow (3.x, ``airflow.sdk``). The names
below are imported on first use, so Airflow's provider discovery can import
``sparktorch_ops.airflow.provider`` without pulling in the operator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparktorch_ops.airflow.errors import TorchTrainingError
    from sparktorch_ops.airflow.links import MlflowRunLink, SparkUILink
    from sparktorch_ops.airflow.operator import TorchDistributorOperator
    from sparktorch_ops.airflow.storage import (
        ResultExistsError,
        ResultIntegrityError,
        ResultStorageError,
        load_result,
    )

__all__ = [
    "MlflowRunLink",
    "ResultExistsError",
    "ResultIntegrityError",
    "ResultStorageError",
    "SparkUILink",
    "TorchDistributorOperator",
    "TorchTrainingError",
    "load_result",
]

_HOMES = {
    "MlflowRunLink": "sparktorch_ops.airflow.links",
    "SparkUILink": "sparktorch_ops.airflow.links",
    "TorchDistributorOperator": "sparktorch_ops.airflow.operator",
    "TorchTrainingError": "sparktorch_ops.airflow.errors",
    "load_result": "sparktorch_ops.airflow.storage",
    "ResultExistsError": "sparktorch_ops.airflow.storage",
    "ResultIntegrityError": "sparktorch_ops.airflow.storage",
    "ResultStorageError": "sparktorch_ops.airflow.storage",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'sparktorch_ops.airflow' has no attribute {name!r}")
