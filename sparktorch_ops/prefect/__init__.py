"""Prefect integration: the ``run_torch_distributor`` task, its artifacts and a cluster block.

    from sparktorch_ops.prefect import run_torch_distributor

    train = run_torch_distributor.with_options(name="train-digits", retries=1)

    @flow
    def nightly():
        model = train(my_train_fn, train_kwargs={"epochs": 5}, num_processes=2,
                      local_mode=True, use_gpu=False)

Prefect is imported only by this subpackage; the core never imports it.
"""

from __future__ import annotations

from sparktorch_ops.prefect.artifacts import RunArtifacts, RunSummary, artifact_keys
from sparktorch_ops.prefect.blocks import MlflowServer, SparkCluster
from sparktorch_ops.prefect.task import run_torch_distributor
from sparktorch_ops.prefect.task_run import (
    TASK_RUN_RESULT_KEY,
    TaskRunResultKey,
    retry_unless_bad_input,
)
from sparktorch_ops.spark.session import validate_master

__all__ = [
    "TASK_RUN_RESULT_KEY",
    "MlflowServer",
    "RunArtifacts",
    "RunSummary",
    "SparkCluster",
    "TaskRunResultKey",
    "artifact_keys",
    "retry_unless_bad_input",
    "run_torch_distributor",
    "validate_master",
]
