"""Airflow integration: :class:`TorchDistributorOperator`, its Spark UI link, result loading.

This is the only place where sparktorch_ops imports Airflow (3.x, ``airflow.sdk``).
"""

from __future__ import annotations

from sparktorch_ops.airflow.links import SparkUILink
from sparktorch_ops.airflow.operator import TorchDistributorOperator, TorchTrainingError
from sparktorch_ops.airflow.storage import load_result

__all__ = ["SparkUILink", "TorchDistributorOperator", "TorchTrainingError", "load_result"]
