"""TorchDistributor, the public facade: a job is validated and packed here, then run by
:class:`sparktorch_ops.driver.run.Run` (prepare -> launch -> supervise -> finish) or planned
without I/O (:func:`plan_job`, the dry run, from the same facts and planner as a run).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sparktorch_ops import events, options
from sparktorch_ops.detached.handle import RunHandle
from sparktorch_ops.driver.launch import gather_facts
from sparktorch_ops.driver.packing import describe
from sparktorch_ops.driver.planning import plan_run
from sparktorch_ops.driver.run import Run, new_run_id
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.job import CancelToken, TrainingJob
from sparktorch_ops.options import DEFAULT_MAX_RESULT_BYTES
from sparktorch_ops.results import MetricRecord, RunResult
from sparktorch_ops.spark import session as spark_support
from sparktorch_ops.spark.dataframe import DataInput, check_dataframe
from sparktorch_ops.spark.session import SparkSettings
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire.plan import RunPlan


@options.documented("distributor")
class TorchDistributor:
    """Run a PyTorch training function or script with torchrun, locally or on Spark.

    A drop-in for ``pyspark.ml.torch.distributor.TorchDistributor`` (same defaults, same
    ``run``), plus ``launch`` (a :class:`RunResult`), ``plan`` (a dry run), ``cancel`` and the
    options below.

    Args:
        <launch options>
    """

    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = True,
        use_gpu: bool = True,
        *,
        spark: Any = None,
        env: Mapping[str, str] | None = None,
        max_restarts: int = 0,
        max_failures: int = 0,
        min_processes: int | None = None,
        torchrun_args: Iterable[str] | None = None,
        logger: Any = None,
        on_metrics: Callable[[MetricRecord], None] | None = None,
        on_event: Callable[[events.PhaseEvent], None] | None = None,
        start_timeout: float | datetime.timedelta | None = None,
        timeout: float | datetime.timedelta | None = None,
        stall_timeout: float | datetime.timedelta | None = None,
        log_ranks: Iterable[int] | None = None,
        allow_unencrypted_channel: bool = False,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        max_local_processes: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        warm_start_from: str | os.PathLike[str] | None = None,
        mlflow_experiment: str | None = None,
        mlflow_tracking_uri: str | None = None,
        mlflow_all_ranks: bool = False,
        channel_host: str | None = None,
        detached: bool = False,
        run_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.spec = LaunchSpec(**options.values_of("distributor", locals()))
        self.spark = spark
        self._tokens: list[CancelToken] = []

    @property
    def num_processes(self) -> int:
        """Total number of ranks."""
        return self.spec.num_processes

    @property
    def local_mode(self) -> bool:
        """Whether ranks run on the driver."""
        return self.spec.local_mode

    @property
    def use_gpu(self) -> bool:
        """Whether each rank gets a GPU."""
        return self.spec.use_gpu

    def job(
        self, train_object: Callable[..., Any] | str | os.PathLike[str], *args: Any, **kwargs: Any
    ) -> TrainingJob:
        """The validated, packed job that ``run`` would launch (nothing starts).

        Raises:
            ConfigError: a bad train object or arguments.
        """
        return self._job(CancelToken(), train_object, args, kwargs)

    def _job(
        self,
        token: CancelToken,
        train_object: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        data: DataInput | None = None,
    ) -> TrainingJob:
        if isinstance(train_object, os.PathLike):
            train_object = os.fspath(train_object)
        settings = SparkSettings(session=self.spark, stop_created_session=False)
        return TrainingJob(train_object, args, kwargs, self.spec, settings, token, data=data)

    def run(
        self, train_object: Callable[..., Any] | str | os.PathLike[str], *args: Any, **kwargs: Any
    ) -> Any:
        """Run ``train_object`` on every rank; return rank 0's result.

        Args:
            train_object: a function (called as ``fn(*args, **kwargs)`` on every rank) or the
                path of a script (run like ``torchrun script *args``).
            *args: the function's positional arguments, or the script's command-line arguments.
            **kwargs: the function's keyword arguments.

        Returns:
            Rank 0's return value for a function; rank 0's stdout for a script.

        Raises:
            ConfigError: bad arguments, before anything starts (ResourceError for slots/GPUs).
            TrainingFailedError: a rank failed; the first failure is the root cause.
            StartTimeoutError, TrainingTimeoutError: a limit ran out; the run was torn down.
            TrainingCancelledError: ``cancel()`` was called; the run was torn down.
        """
        return self.launch(train_object, *args, **kwargs).value

    def launch(
        self, train_object: Callable[..., Any] | str | os.PathLike[str], *args: Any, **kwargs: Any
    ) -> RunResult:
        """Like :meth:`run`, but return the whole :class:`RunResult`."""
        return self._launch(train_object, args, kwargs)

    def _launch(
        self, train: Any, args: tuple[Any, ...], kwargs: dict[str, Any], data: Any = None
    ) -> RunResult:
        token = CancelToken()
        self._tokens.append(token)  # from here on, cancel() reaches this run (packing too)
        try:
            return launch_job(self._job(token, train, args, kwargs, data))
        finally:
            self._tokens.remove(token)

    def train_on_dataframe(
        self, train_function: Callable[..., Any] | str, dataframe: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """Run ``train_function`` on every rank with ``dataframe`` shared out; return rank 0's
        result.

        The DataFrame is checked first (one Spark job: an empty DataFrame, or a column that
        cannot become a tensor, is a ``ConfigError`` naming it), then laid out over the ranks
        whatever its partitioning: each rank reads its own shard with
        :func:`sparktorch_ops.data.partition_loader` (or pyspark's
        ``_get_spark_partition_data_loader``). Every rank has the same rows per epoch.
        ``_train_on_dataframe`` is the same method, under pyspark's name.

        Raises:
            As :meth:`run`.
        """
        return self.launch_on_dataframe(train_function, dataframe, *args, **kwargs).value

    _train_on_dataframe = train_on_dataframe

    def launch_on_dataframe(
        self, train_function: Callable[..., Any] | str, dataframe: Any, *args: Any, **kwargs: Any
    ) -> RunResult:
        """Like :meth:`train_on_dataframe`, but return the whole :class:`RunResult` (its
        ``input`` holds the rows and columns trained on)."""
        check_dataframe(dataframe)
        return self._launch(train_function, args, kwargs, DataInput(dataframe=dataframe))

    def submit(
        self, train_object: Callable[..., Any] | str | os.PathLike[str], *args: Any, **kwargs: Any
    ) -> RunHandle:
        """Start ``train_object`` detached and return its :class:`RunHandle` at once: its
        driver runs in a process of its own, which outlives this one, its state in
        ``run_dir`` (``RunHandle(run_dir)`` reattaches from anywhere). A ``run_dir`` that holds
        the same training already is reattached to, not trained again.

        Raises:
            ConfigError: bad arguments (``detached=True`` is needed).
            RunDirectoryError: ``run_dir`` holds another training or is not usable.
        """
        return self._submit(self._job(CancelToken(), train_object, args, kwargs))

    def submit_on_dataframe(
        self, train_function: Callable[..., Any] | str, dataframe: Any, *args: Any, **kwargs: Any
    ) -> RunHandle:
        """Like :meth:`submit`, with ``dataframe`` shared out as by :meth:`train_on_dataframe`
        (written as Parquet into the run directory first: the detached driver's own session
        reads it there)."""
        check_dataframe(dataframe)
        data = DataInput(dataframe=dataframe)
        return self._submit(self._job(CancelToken(), train_function, args, kwargs, data))

    def _submit(self, job: TrainingJob) -> RunHandle:
        from sparktorch_ops.detached.submit import submit

        if not self.spec.detached:
            raise ConfigError(
                "detached",
                "submit() starts a detached run: create the distributor with detached=True "
                "(run() and launch() wait for it)",
            )
        return submit(job)

    def plan(
        self, train_object: Callable[..., Any] | str | os.PathLike[str], *args: Any, **kwargs: Any
    ) -> RunPlan:
        """A dry run: the plan ``run`` would follow, with nothing started.

        Facts that need I/O (the channel's port, hosts, the task's GPUs, the rendezvous port)
        appear as placeholders, and the run's secret is not in the plan;
        ``plan(...).to_dict()`` is JSON-safe.

        Raises:
            ConfigError: what ``run`` would reject before launching.
        """
        return plan_job(self.job(train_object, *args, **kwargs))

    def stacks(self, run_id: str | None = None) -> dict[int, str]:
        """Where every rank of a run in progress is, by rank: the first line says where its
        training thread is (``in fn (train.py:40) <- time.sleep(60)``), then every thread's
        stack follows. Takes up to about 2 s; safe from any thread. Empty when no run of this
        distributor has ranks running.

        Args:
            run_id: which run (its id is in its log lines and events); needed only when several
                runs are in progress.

        Raises:
            ConfigError: several runs are in progress and ``run_id`` does not pick one.
        """
        running = {token.run_id: token for token in list(self._tokens) if token.run_id}
        if run_id is None and len(running) > 1:
            raise ConfigError(
                "run_id",
                f"{len(running)} runs are in progress ({', '.join(sorted(running))}): "
                "pass run_id= to say which one's stacks to take",
            )
        if run_id is not None and run_id not in running:
            raise ConfigError(
                "run_id",
                f"no run {run_id!r} of this distributor is in progress"
                + (f" (running: {', '.join(sorted(running))})" if running else ""),
            )
        token = running.get(run_id) if run_id is not None else next(iter(running.values()), None)
        stacks = token.stacks() if token is not None else None
        return stacks or {}

    def cancel(self) -> None:
        """Cancel every run of this distributor in progress; do nothing when none is.

        Safe from any thread and from a signal handler on the main thread: it only sets a flag
        that the run's own thread acts on, and the caller of ``run`` then raises
        :class:`TrainingCancelledError` once everything of the run is gone.
        """
        for token in list(self._tokens):
            token.cancel("cancel() was called")


def launch_job(job: TrainingJob) -> RunResult:
    """Run a job to its end; cancel it with ``job.cancel_token``. A detached job runs in a
    driver process of its own, waited on here (:mod:`sparktorch_ops.detached`).

    Raises:
        As :meth:`TorchDistributor.run`.
    """
    if job.options.detached:
        from sparktorch_ops.detached.submit import launch_detached

        result: RunResult = launch_detached(job)
        return result
    return Run(job).execute()


def plan_job(job: TrainingJob) -> RunPlan:
    """The plan of a job without I/O, from the facts a run gathers (:func:`gather_facts`):
    placeholders for what only a launch finds out."""
    spec = job.options
    conf_value: Callable[[str], str | None] | None = None
    if not spec.local_mode:
        # From the job's session when it has one (read, not started), else from the settings
        # it would start with; Spark's defaults otherwise.
        session = job.spark.session
        if session is not None:
            source = spark_support.conf_source(session)
            conf_value = lambda key: spark_support.conf_value(source, key)  # noqa: E731
        else:
            conf = {str(k): str(v) for k, v in job.spark.conf.items()}
            conf_value = conf.get
    facts = gather_facts(spec, new_run_id(), conf_value=conf_value)
    return plan_run(spec, describe(job.payload), facts)
