"""``run_torch_distributor``: a Prefect task that runs distributed PyTorch training.

The task is thin: it turns its parameters (and a :class:`SparkCluster` block) into the core's
job (:func:`sparktorch_ops.job.build_job`, with Prefect's run logger and the artifact recorder
as ``on_metrics``), launches it, and writes the artifacts. Prefect's timeouts and a served
run's cancellation reach the core's waiting thread, which stops every process of the run.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prefect import get_run_logger, task
from prefect.context import TaskRunContext

from sparktorch_ops import options
from sparktorch_ops.distributor import launch_job
from sparktorch_ops.driver.packing import describe
from sparktorch_ops.job import build_job
from sparktorch_ops.options import DEFAULT_MAX_RESULT_BYTES
from sparktorch_ops.prefect.artifacts import TrainingReport
from sparktorch_ops.prefect.blocks import SparkCluster, resolve_tracking_uri, session_settings
from sparktorch_ops.prefect.task_run import (
    TASK_RUN_RESULT_KEY,
    default_checkpoint_dir,
    mlflow_tags,
    result_location,
    retry_unless_bad_input,
    training_of,
)
from sparktorch_ops.spark.dataframe import DataInput

TrainObject = Callable[..., Any] | str | os.PathLike[str]


@task(
    name="run_torch_distributor",
    cache_policy=TASK_RUN_RESULT_KEY,
    persist_result=True,
    retry_condition_fn=retry_unless_bad_input,
)
@options.documented("task")
def run_torch_distributor(
    train: TrainObject,
    train_args: Sequence[Any] | None = None,
    train_kwargs: Mapping[str, Any] | None = None,
    *,
    num_processes: int = 1,
    local_mode: bool = True,
    use_gpu: bool = True,
    spark_master: str | None = None,
    spark_conf: Mapping[str, Any] | None = None,
    cluster: SparkCluster | str | None = None,
    env: Mapping[str, str] | None = None,
    max_restarts: int = 0,
    max_failures: int = 0,
    min_processes: int | None = None,
    torchrun_args: Sequence[str] | None = None,
    timeout: float | datetime.timedelta | None = None,
    start_timeout: float | datetime.timedelta | None = None,
    stall_timeout: float | datetime.timedelta | None = None,
    log_ranks: Sequence[int] | None = None,
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    max_local_processes: int | None = None,
    allow_unencrypted_channel: bool = False,
    channel_host: str | None = None,
    detached: bool = False,
    run_dir: str | None = None,
    artifact_key: str | None = None,
    artifacts: bool = True,
    dataframe: Any = None,
    input_sql: str | None = None,
    input_table: str | None = None,
    input_path: str | None = None,
    input_format: str = "parquet",
    checkpoint_dir: str | None = None,
    warm_start_from: str | None = None,
    mlflow_experiment: str | None = None,
    mlflow_tracking_uri: str | None = None,
    mlflow_all_ranks: bool = False,
    durable: bool = True,
) -> Any:
    """Run a training function or script on ``num_processes`` ranks; return rank 0's value.

    A Prefect task: set retries, timeouts and names with ``.with_options(...)``. A retry
    reruns the whole job (``durable``: resuming into the same training); ``timeout_seconds``
    and cancelling the flow run stop it, every process gone. Rank output goes to the task's
    log (``[rank N|host]``); artifacts ``<key>-progress``, ``<key>-metrics``,
    ``<key>-summary`` and, with Spark, ``<key>-spark-ui`` and ``<key>-mlflow``. The result is
    persisted under a key unique to the task run. ``timeout`` is the core's limit on the
    training, apart from Prefect's ``timeout_seconds`` on the whole task. Without
    ``checkpoint_dir``, the task run has its own under Prefect's local storage path
    (``.../sparktorch_ops/checkpoints/<flow run>/<task>``). ``mlflow_tracking_uri`` may also
    name a saved :class:`~sparktorch_ops.prefect.MlflowServer` block. The input
    (``dataframe``, ``input_*``) is not part of any cache key.

    Args:
        train: a function (run as ``train(*train_args, **train_kwargs)`` on every rank) or the
            path of a script (run under torchrun with ``train_args`` as its argv).
        train_args: the function's positional arguments, or the script's arguments.
        train_kwargs: the function's keyword arguments (not for scripts).
        <launch options>

    Returns:
        Rank 0's return value (a function) or rank 0's stdout (a script).

    Raises:
        ConfigError: bad arguments, before anything starts (not retried).
        TrainingFailedError: a rank failed; the message names it, with its traceback tail
            (TrainingStalledError: no rank showed progress for ``stall_timeout``).
        StartTimeoutError, TrainingTimeoutError: ``start_timeout`` or ``timeout`` ran out.
    """
    logger = get_run_logger()
    ctx = TaskRunContext.get()
    report = TrainingReport(ctx, logger, artifact_key, artifacts)
    data = DataInput.given(dataframe, input_sql, input_table, input_path, input_format)
    launch = {
        **options.values_of("task", locals()),
        "checkpoint_dir": checkpoint_dir or default_checkpoint_dir(ctx),
        "mlflow_tracking_uri": resolve_tracking_uri(mlflow_tracking_uri),
    }
    job = build_job(
        train=train,  # type: ignore[arg-type]
        train_args=train_args,
        train_kwargs=train_kwargs,
        spark=session_settings(spark_master, spark_conf, cluster),
        mlflow_tags=mlflow_tags(ctx),
        logger=logger,
        on_metrics=report.recorder.on_metrics if report.recorder is not None else None,
        on_event=report.on_event,
        data=data,
        training=training_of(ctx, logger) if durable else None,
        **launch,
    )
    report.start(describe(job.payload), job.options.num_processes, job.mode, use_gpu)
    try:
        result = launch_job(job)
    except BaseException as exc:
        report.failed(exc)
        raise
    report.completed(result, result_location(ctx, result.value))
    return result.value
