"""``run_torch_distributor``: a Prefect task that runs distributed PyTorch training.

The task is thin: it checks its arguments, builds a :class:`~sparktorch_ops.TorchDistributor`
(with Prefect's run logger and the artifact recorder as ``on_metrics``), starts the Spark
session for barrier mode, launches, and writes the artifacts. Everything else is the core's.

Cancellation: the core's waiting thread sleeps in short steps, so Prefect's task timeout (an
exception injected into that thread, or SIGALRM on the main thread) and the SIGTERM a Prefect
runner sends to cancel a served flow run both reach it within ~50 ms; it then cancels the Spark
job, kills every process of the run and re-raises. Should the flow-run process be killed
outright, the ranks die with it (parent-death signal and channel watchdog in the core).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import CachePolicy
from prefect.client.schemas.objects import TaskRun
from prefect.context import TaskRunContext
from prefect.states import State

from sparktorch_ops import spark as spark_support
from sparktorch_ops.distributor import TorchDistributor
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.prefect.artifacts import (
    RunArtifacts,
    RunSummary,
    check_artifact_key,
    describe_error,
    key_from_name,
)
from sparktorch_ops.prefect.blocks import (
    SparkCluster,
    spark_session,
    validate_conf,
    validate_master,
)

TrainObject = Callable[..., Any] | str | os.PathLike[str]


@dataclass
class TaskRunResultKey(CachePolicy):
    """A result key unique to each task run: results are persisted, never reused by another run.

    Training is not something to skip because a similar call ran before, so no inputs go into
    the key (nor could a Spark session, a logger or a callback); a retry of the same task run
    reruns the job because a failed attempt stores nothing.
    """

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        """``sparktorch-ops-<task run id>``."""
        return self.key_for(task_ctx.task_run.id)

    @staticmethod
    def key_for(task_run_id: Any) -> str:
        """The storage key of a task run's result."""
        return f"sparktorch-ops-{task_run_id}"


TASK_RUN_RESULT_KEY = TaskRunResultKey()


def retry_unless_bad_input(task: Any, task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect ``retry_condition_fn``: retry everything except bad arguments (ConfigError)."""
    return not isinstance(state.data, ConfigError)


@dataclass(frozen=True)
class _SparkTarget:
    master: str | None
    conf: dict[str, str]
    app_name: str


def _check_train(
    train: object, train_args: object, train_kwargs: object
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if train_args is None:
        train_args = ()
    if isinstance(train_args, (str, bytes)) or not isinstance(train_args, Sequence):
        raise ConfigError("train_args", f"must be a list or tuple of arguments, got {train_args!r}")
    if train_kwargs is not None and not isinstance(train_kwargs, Mapping):
        raise ConfigError("train_kwargs", f"must be a mapping or None, got {train_kwargs!r}")
    kwargs = dict(train_kwargs or {})
    if callable(train):
        return tuple(train_args), kwargs
    if isinstance(train, (str, os.PathLike)):
        path = Path(train).expanduser()
        if not path.is_file():
            raise ConfigError(
                "train",
                f"script {os.fspath(train)!r} does not exist (resolved: {path.resolve()}, "
                f"working directory {os.getcwd()})",
            )
        if kwargs:
            raise ConfigError(
                "train_kwargs",
                f"a script takes command-line arguments only; pass {sorted(kwargs)} as "
                "'--name=value' strings in train_args",
            )
        return tuple(str(a) for a in train_args), {}
    raise ConfigError(
        "train",
        f"must be a callable or the path of a Python script, got {type(train).__name__}",
    )


def _spark_target(
    master: str | None, conf: Mapping[str, Any] | None, cluster: SparkCluster | str | None
) -> _SparkTarget | None:
    checked_conf = validate_conf(conf, "spark_conf")
    if cluster is not None:
        if master is not None:
            raise ConfigError(
                "spark_master",
                "give either spark_master or cluster (a SparkCluster block), not both",
            )
        if isinstance(cluster, str):
            try:
                loaded: Any = SparkCluster.load(cluster)
            except ValueError as exc:
                raise ConfigError(
                    "cluster", f"no SparkCluster block named {cluster!r}: {exc}"
                ) from None
            cluster = loaded
        if not isinstance(cluster, SparkCluster):
            raise ConfigError(
                "cluster", f"must be a SparkCluster block or its name, got {cluster!r}"
            )
        merged = {**cluster.spark_conf(), **checked_conf}
        return _SparkTarget(cluster.master, merged, cluster.app_name)
    if master is None and not checked_conf:
        return None
    checked_master = validate_master(master, "spark_master") if master is not None else None
    return _SparkTarget(checked_master, checked_conf, "sparktorch-ops")


def _result_location(ctx: TaskRunContext | None, value: Any) -> str:
    kind = f"rank 0 returned a `{type(value).__name__}`"
    if ctx is None or not ctx.persist_result:
        return f"{kind}, handed to the flow in memory (result persistence is off)"
    storage = getattr(ctx.result_store, "result_storage", None)
    base = getattr(storage, "basepath", None)
    if isinstance(ctx.task.cache_policy, TaskRunResultKey):
        key = TaskRunResultKey.key_for(ctx.task_run.id)
        where = f"{str(base).rstrip('/')}/{key}" if base else f"key {key}"
        return f"{kind}, persisted in Prefect result storage at `{where}`"
    return f"{kind}, persisted in Prefect result storage" + (f" under `{base}`" if base else "")


def _train_name(train: TrainObject) -> str:
    if callable(train):
        return getattr(train, "__qualname__", None) or repr(train)
    return os.fspath(train)


@task(
    name="run_torch_distributor",
    cache_policy=TASK_RUN_RESULT_KEY,
    persist_result=True,
    retry_condition_fn=retry_unless_bad_input,
)
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
    torchrun_args: Sequence[str] | None = None,
    timeout: float | datetime.timedelta | None = None,
    start_timeout: float | datetime.timedelta | None = None,
    log_ranks: Sequence[int] | None = None,
    artifact_key: str | None = None,
    artifacts: bool = True,
) -> Any:
    """Run a training function or script on ``num_processes`` ranks; return rank 0's value.

    A Prefect task: configure retries, timeouts and names with ``.with_options(...)``, e.g.
    ``run_torch_distributor.with_options(name="train-digits", retries=1,
    timeout_seconds=3600)``. Prefect ``retries`` rerun the whole distributed job;
    ``timeout_seconds`` and cancelling the flow run stop it (Spark job interrupted, every
    process of the run gone). Rank output goes to the task's log, prefixed
    ``[rank N|host]``. Artifacts: ``<key>-progress`` (live, from rank 0's
    ``report(progress=...)``), ``<key>-metrics`` (every ``report()`` per step and rank),
    ``<key>-summary`` and, with Spark, ``<key>-spark-ui``.

    The result is persisted in Prefect's result storage under a key unique to the task run
    (``persist_result=False`` in ``with_options`` keeps it in memory only).

    Args:
        train: a function (run as ``train(*train_args, **train_kwargs)`` on every rank) or the
            path of a script (run under torchrun with ``train_args`` as its argv).
        train_args: the function's positional arguments, or the script's arguments.
        train_kwargs: the function's keyword arguments (not for scripts).
        num_processes: total number of ranks.
        local_mode: True runs the ranks on this machine (no Spark needed); False runs one rank
            per Spark barrier task on ``spark_master``/``cluster`` (or the active session).
        use_gpu: give each rank its own GPU (as pyspark's TorchDistributor, default True;
            ``False`` trains on CPU).
        spark_master: the Spark master URL for barrier mode (see :class:`SparkCluster`).
        spark_conf: Spark conf for the session (applied over the cluster block's conf).
        cluster: a :class:`SparkCluster` block, or the name it was saved under.
        env: extra environment variables for every rank.
        max_restarts: torchrun's worker-group restarts within one run.
        torchrun_args: further torchrun options.
        timeout: seconds (or a timedelta) the training may take (the core stops it; distinct
            from Prefect's ``timeout_seconds``, which covers the whole task).
        start_timeout: seconds (or a timedelta) to wait for slots, executors and the
            rendezvous.
        log_ranks: ranks whose output goes to the log (default: all).
        artifact_key: prefix of the artifact keys (lowercase letters, numbers, dashes);
            default: derived from the task name.
        artifacts: set False to create no artifacts.

    Returns:
        Rank 0's return value (a function) or rank 0's stdout (a script).

    Raises:
        ConfigError: bad arguments, before anything starts (not retried).
        TrainingFailedError: a rank failed; the message names it, with its traceback tail.
        StartTimeoutError, TrainingTimeoutError: ``start_timeout`` or ``timeout`` ran out.
    """
    logger = get_run_logger()
    ctx = TaskRunContext.get()
    task_name = ctx.task.name if ctx is not None else "run_torch_distributor"
    run_name = ctx.task_run.name if ctx is not None else task_name

    prefix = (
        check_artifact_key(artifact_key) if artifact_key is not None else key_from_name(task_name)
    )
    args, kwargs = _check_train(train, train_args, train_kwargs)
    target = _spark_target(spark_master, spark_conf, cluster)
    recorder = (
        RunArtifacts(
            prefix, logger, f"Training progress of {run_name} (rank 0's report(progress=...))"
        )
        if artifacts
        else None
    )
    distributor = TorchDistributor(
        num_processes,
        local_mode,
        use_gpu,
        env=env,
        max_restarts=max_restarts,
        torchrun_args=torchrun_args,
        logger=logger,
        on_metrics=recorder.on_metrics if recorder is not None else None,
        start_timeout=start_timeout,
        timeout=timeout,
        log_ranks=log_ranks,
    )
    if local_mode and target is not None:
        logger.warning(
            "spark_master/spark_conf/cluster are not used with local_mode=True (the ranks run "
            "on this machine); pass local_mode=False to train on the Spark cluster"
        )
    logger.info(
        "launching %s on %d processes in %s mode%s",
        _train_name(train),
        num_processes,
        "local" if local_mode else "barrier",
        f"; artifacts {prefix}-*" if recorder is not None else "",
    )
    if recorder is not None:
        recorder.start()

    session: Any = None
    created = False
    started = time.monotonic()
    ui_url: str | None = None
    app_id: str | None = None
    summary = RunSummary(
        title=run_name,
        status="running",
        num_processes=num_processes,
        mode="local" if local_mode else "barrier",
        use_gpu=use_gpu,
        duration_s=0.0,
    )
    try:
        if not local_mode and target is not None:
            session, created = spark_session(target.master, target.conf, target.app_name, logger)
            distributor.spark = session
        result = distributor.launch(train, *args, **kwargs)
    except BaseException as exc:
        used = session if session is not None or local_mode else spark_support.active_session()
        if used is not None:
            try:
                app_id = used.sparkContext.applicationId
                ui_url = spark_support.ui_url(used.sparkContext)
            except Exception:  # a session that failed half-way: no link then
                app_id = ui_url = None
        summary.status, summary.error = describe_error(
            exc, ctx.task.timeout_seconds if ctx is not None else None
        )
        summary.duration_s = time.monotonic() - started
        summary.app_id, summary.ui_url = app_id, ui_url
        if recorder is not None:
            summary.final_metrics = _rank0_latest(recorder)
            if isinstance(exc, (Exception, asyncio.CancelledError)):
                # Prefect's own timeout arrives as a CancelledError before it becomes
                # TaskRunTimeoutError; other BaseExceptions (the SIGTERM of a cancelled flow
                # run, Ctrl-C) mean the process is going away: no time for artifacts then.
                recorder.finish(
                    summary,
                    completed=False,
                    ui_url=ui_url,
                    ui_description=_ui_description(ui_url, created),
                )
            else:
                recorder.close()
        raise
    finally:
        if created and session is not None:
            logger.info("stopping the Spark session this task started")
            session.stop()

    summary.status = "completed"
    summary.duration_s = result.duration.total_seconds()
    summary.final_metrics = result.final_metrics(0)
    summary.result = _result_location(ctx, result.value)
    summary.run_id = result.run_id
    summary.app_id = result.app_id
    summary.ui_url = result.ui_url
    if recorder is not None:
        recorder.finish(
            summary,
            completed=True,
            ui_url=result.ui_url,
            ui_description=_ui_description(result.ui_url, created),
        )
    logger.info(
        "%d processes finished in %.1f s; final metrics of rank 0: %s",
        result.num_processes,
        summary.duration_s,
        summary.final_metrics or "none reported",
    )
    return result.value


def _rank0_latest(recorder: RunArtifacts) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for record in list(recorder.records):
        if record.rank == 0:
            merged.update(record.values)
    return merged


def _ui_description(url: str | None, created: bool) -> str:
    if url is None:
        return ""
    if "/history/" in url:
        return "The Spark History Server page of the training's application."
    if created:
        return (
            "The driver's live Spark UI: it went away when the task stopped the session; "
            "configure a History Server (SparkCluster.history_server_url) for a lasting link."
        )
    return "The driver's live Spark UI: reachable while the flow run's Spark session lives."
