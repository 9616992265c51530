"""sparktorch_ops: run torchrun training on Spark, from Airflow and Prefect.

Importing this package imports neither pyspark, torch, Airflow nor Prefect; each is imported
when first needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparktorch_ops.errors import (
    ChannelError,
    CheckpointError,
    ConfigError,
    ResourceError,
    ResultTooLargeError,
    SparkJobKilledError,
    SparkTorchError,
    StartTimeoutError,
    TrainingCancelledError,
    TrainingFailedError,
    TrainingStalledError,
    TrainingTimeoutError,
)
from sparktorch_ops.lightning import lightning_trainer_kwargs
from sparktorch_ops.rank.reporting import report
from sparktorch_ops.results import MetricRecord, RankFailure, RunResult
from sparktorch_ops.wire import VERSION

if TYPE_CHECKING:
    from sparktorch_ops.deepspeed import DeepspeedTorchDistributor
    from sparktorch_ops.distributor import TorchDistributor

__version__ = VERSION

__all__ = [
    "ChannelError",
    "CheckpointError",
    "ConfigError",
    "DeepspeedTorchDistributor",
    "MetricRecord",
    "RankFailure",
    "ResourceError",
    "ResultTooLargeError",
    "RunResult",
    "SparkJobKilledError",
    "SparkTorchError",
    "StartTimeoutError",
    "TorchDistributor",
    "TrainingCancelledError",
    "TrainingFailedError",
    "TrainingStalledError",
    "TrainingTimeoutError",
    "lightning_trainer_kwargs",
    "report",
]


def __getattr__(name: str) -> Any:
    # The distributor pulls in pyspark; keep `import sparktorch_ops` (done by
    # every rank for report()) as light as the names it needs.
    if name == "TorchDistributor":
        from sparktorch_ops.distributor import TorchDistributor

        return TorchDistributor
    if name == "DeepspeedTorchDistributor":
        from sparktorch_ops.deepspeed import DeepspeedTorchDistributor

        return DeepspeedTorchDistributor
    raise AttributeError(f"module 'sparktorch_ops' has no attribute {name!r}")
