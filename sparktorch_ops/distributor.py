"""TorchDistributor: job -> facts -> plan -> launch (local or barrier) -> a RunResult.

A run is driven by :class:`_Run`: its state machine (:mod:`sparktorch_ops.events`) moves through
preparing (Spark session, preflight checks), starting (channel, plan, agents), running and
finishing, and every step is a phase event for the ``on_event`` hook.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import logging
import os
import secrets
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import cloudpickle
import pendulum

from sparktorch_ops import checkpoint, errors, events, options
from sparktorch_ops.driver.certificate import make_certificate
from sparktorch_ops.driver.collector import RunCollector
from sparktorch_ops.driver.facts import gather_facts
from sparktorch_ops.driver.packing import describe
from sparktorch_ops.driver.planning import (
    barrier_layout,
    check_slots,
    plan_run,
    select_local_gpus,
)
from sparktorch_ops.driver.tracking import MlflowTracker, start_tracking
from sparktorch_ops.events import RunState, RunStateMachine
from sparktorch_ops.job import CancelToken, TrainingJob
from sparktorch_ops.launchers.barrier import BarrierLauncher
from sparktorch_ops.launchers.base import Launcher
from sparktorch_ops.launchers.connect import ConnectBarrierLauncher, known_slots
from sparktorch_ops.launchers.local import LocalLauncher
from sparktorch_ops.options import DEFAULT_MAX_RESULT_BYTES
from sparktorch_ops.outcome import outcome_of
from sparktorch_ops.results import MetricRecord, RunResult
from sparktorch_ops.spark import session as spark_support
from sparktorch_ops.spark.dataframe import DataInput, PreparedInput, check_dataframe, prepare_input
from sparktorch_ops.spark.session import SparkSettings
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire.channel import ChannelServer
from sparktorch_ops.wire.payload import FunctionCall
from sparktorch_ops.wire.plan import RunPlan
from sparktorch_ops.wire.tls import ChannelCertificate

_POLL_S = 0.05
_DRAIN_S = 10.0
_COLLATERAL_S = 3.0
_EXIT_REPORT_S = 2.0
_SPARK_CAUSE_S = 3.0  # how long a lost barrier task's Spark error may take to arrive
_default_logger = logging.getLogger("sparktorch_ops")


def _machine_gpu_count() -> int:
    """GPUs this machine has; torch is imported only when a GPU driver is present."""
    if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")):
        return 0
    import torch

    return int(torch.cuda.device_count())


class _ConsoleOutput:
    """Rank lines on the driver's stdout/stderr while runs without a logger are in progress.

    With no ``logger=`` and no handler configured for the ``sparktorch_ops`` logger (a plain
    script, a notebook), INFO records would be dropped; torchrun prints its ranks' output, so
    a run does too: stdout lines to stdout, stderr lines (WARNING) to stderr. A configured
    handler (or one anywhere up the logger tree) takes over.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved_level = logging.NOTSET
        self._handlers: list[logging.Handler] = []

    def acquire(self) -> bool:
        """Attach the handlers if nothing handles our logger; True when this call uses them."""
        with self._lock:
            if self._users == 0:
                if _default_logger.hasHandlers():
                    return False
                out = logging.StreamHandler(sys.stdout)
                out.addFilter(lambda record: record.levelno < logging.WARNING)
                err = logging.StreamHandler(sys.stderr)
                err.setLevel(logging.WARNING)
                self._handlers = [out, err]
                for handler in self._handlers:
                    handler.setFormatter(logging.Formatter("%(message)s"))
                    _default_logger.addHandler(handler)
                self._saved_level = _default_logger.level
                _default_logger.setLevel(logging.INFO)
            self._users += 1
            return True

    def release(self) -> None:
        """Detach the handlers once the last run that uses them is over."""
        with self._lock:
            self._users -= 1
            if self._users == 0:
                for handler in self._handlers:
                    _default_logger.removeHandler(handler)
                self._handlers = []
                _default_logger.setLevel(self._saved_level)


_console = _ConsoleOutput()


def _driver_latest_step(directory: str, log: logging.Logger) -> int | None:
    """The latest complete checkpoint's step as the driver sees it (None when it cannot look:
    a directory only the executors reach)."""
    try:
        return checkpoint.latest_step(directory=directory)
    except Exception as exc:
        log.warning(
            "sparktorch_ops: cannot list checkpoints in %s from the driver: %s", directory, exc
        )
        return None


def _new_run_id() -> str:
    return f"sparktorch-{uuid.uuid4().hex[:16]}"


@options.documented("distributor")
class TorchDistributor:
    """Run a PyTorch training function or script with torchrun, locally or on Spark.

    A drop-in for ``pyspark.ml.torch.distributor.TorchDistributor`` (same defaults, same
    ``run``), plus ``launch`` (a :class:`RunResult`), ``plan`` (a dry run), ``cancel`` and the
    options below.

    Args:
        <launch options>
        spark: the SparkSession (default: the active one; barrier mode creates one if none).
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
        torchrun_args: Iterable[str] | None = None,
        logger: Any = None,
        on_metrics: Callable[[MetricRecord], None] | None = None,
        on_event: Callable[[events.PhaseEvent], None] | None = None,
        start_timeout: float | datetime.timedelta | None = None,
        timeout: float | datetime.timedelta | None = None,
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
        token = CancelToken()
        self._tokens.append(token)  # from here on, cancel() reaches this run (packing too)
        try:
            return launch_job(self._job(token, train_object, args, kwargs))
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
        token = CancelToken()
        self._tokens.append(token)
        try:
            data = DataInput(dataframe=dataframe)
            return launch_job(self._job(token, train_function, args, kwargs, data))
        finally:
            self._tokens.remove(token)

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

    def cancel(self) -> None:
        """Cancel every run of this distributor in progress; do nothing when none is.

        Safe from any thread and from a signal handler on the main thread: it only sets a flag
        that the run's own thread acts on, and the caller of ``run`` then raises
        :class:`TrainingCancelledError` once everything of the run is gone.
        """
        for token in list(self._tokens):
            token.cancel("cancel() was called")


def launch_job(job: TrainingJob) -> RunResult:
    """Run a job to its end; cancel it with ``job.cancel_token``.

    Raises:
        As :meth:`TorchDistributor.run`.
    """
    return _Run(job).execute()


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
    facts = gather_facts(spec, _new_run_id(), conf_value=conf_value)
    return plan_run(spec, describe(job.payload), facts)


class _Run:
    """One launch: a helper thread drives it while the caller's thread waits in plain Python."""

    def __init__(self, job: TrainingJob) -> None:
        self.job = job
        self.spec = job.options
        self.run_id = _new_run_id()
        self.log = self.spec.logger or _default_logger
        self.machine = RunStateMachine(self.run_id, self._on_event, self.log)
        self.done = False
        self.outcome: RunResult | BaseException | None = None
        self.tracker: MlflowTracker | None = None

    def execute(self) -> RunResult:
        self._check_cancelled()  # cancelled while the job was being built
        if self.spec.tracked:  # here: MLflow's active run is the caller thread's
            job = self.job
            self.tracker = start_tracking(
                self.spec, self.run_id, describe(job.payload), job.args, job.kwargs, self.log
            )
        try:
            outcome = self._execute()
        except BaseException as exc:
            if self.tracker is not None:
                self.tracker.finish(exc)
            raise
        if self.tracker is not None:
            self.tracker.finish(outcome)
            outcome = dataclasses.replace(
                outcome, mlflow_run_id=self.tracker.run_id, mlflow_run_url=self.tracker.url
            )
        return outcome

    # The run's observers: MLflow (when tracked), then the caller's hooks.
    def _on_metrics(self, record: MetricRecord) -> None:
        if self.tracker is not None:
            self.tracker.on_metrics(record)
        if self.spec.on_metrics is not None:
            self.spec.on_metrics(record)

    def _on_event(self, event: events.PhaseEvent) -> None:
        if self.tracker is not None:
            self.tracker.on_event(event)
        if self.spec.on_event is not None:
            self.spec.on_event(event)

    def _execute(self) -> RunResult:
        context = contextvars.copy_context()
        thread = threading.Thread(
            target=context.run, args=(self._drive,), name=self.run_id, daemon=True
        )
        thread.start()
        try:
            while not self.done:
                time.sleep(_POLL_S)
        except BaseException as exc:
            # Interrupted (Ctrl-C, an orchestrator's timeout or kill): stop the run, then let
            # the interruption propagate.
            self.job.cancel_token.cancel(
                f"the waiting thread was interrupted by {type(exc).__name__}"
            )
            deadline = time.monotonic() + 60
            while not self.done and time.monotonic() < deadline:
                try:
                    time.sleep(_POLL_S)
                except BaseException:
                    continue
            raise
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        assert self.outcome is not None
        return self.outcome

    def _drive(self) -> None:
        console = self.spec.logger is None and _console.acquire()
        try:
            self.outcome = self._prepare_and_launch()
            final = RunState.SUCCEEDED
        except BaseException as exc:
            self.outcome = exc
            final = _final_state(exc)
        finally:
            if console:
                _console.release()
        try:
            self.machine.finish(final)  # the final event reaches on_event before run() returns
        finally:
            self.done = True

    def _check_cancelled(self) -> None:
        reason = self.job.cancel_token.reason
        if reason is not None:
            raise errors.TrainingCancelledError(reason)

    def _prepare_and_launch(self) -> RunResult:
        spec, machine = self.spec, self.machine
        started_at = pendulum.now("UTC")
        started = time.monotonic()
        machine.to(RunState.PREPARING)
        machine.emit(events.PAYLOAD_PACKED, payload=describe(self.job.payload))
        if spec.local_mode and self.job.data is not None:
            return self._launch_local_on_data(started_at, started)
        if spec.local_mode:
            if self.job.spark.configured:
                self.log.warning(
                    "sparktorch_ops: the Spark master and settings are not used with "
                    "local_mode=True (the ranks run on this machine); pass local_mode=False "
                    "to train on the Spark cluster"
                )
            return self._launch(started_at, started, None, self._local_gpus())
        handle = spark_support.get_session(self.job.spark, self.log)
        try:
            session = handle.session
            sc = spark_support.conf_source(session)  # a Connect session stands in for a context
            machine.emit(
                events.SESSION_READY,
                app_id=spark_support.app_id(sc),
                ui_url=spark_support.ui_url(sc),
                master=spark_support.master_of(sc),
                created=handle.created,
                connect=spark_support.is_connect_session(session),
            )
            self._check_cancelled()
            if spark_support.is_connect_session(session):
                self._preflight_connect(session)
            else:
                self._preflight(sc)
            data = self._prepare_data(session)
            return self._launch(started_at, started, sc, None, data)
        finally:
            try:
                spark_support.stop_session(handle)
            except Exception:  # must not hide the run's own outcome
                self.log.warning("sparktorch_ops: could not stop Spark", exc_info=True)

    def _launch_local_on_data(self, started_at: pendulum.DateTime, started: float) -> RunResult:
        """Local mode with DataFrame input: the DataFrame's own session (or one from the
        job's settings for SQL, a table or a path) streams it to the driver."""
        data = self.job.data
        assert data is not None
        if data.dataframe is not None:
            prepared = self._prepare_data(data.dataframe.sparkSession)
            return self._launch(started_at, started, None, self._local_gpus(), prepared)
        handle = spark_support.get_session(self.job.spark, self.log)
        try:
            prepared = self._prepare_data(handle.session)
            return self._launch(started_at, started, None, self._local_gpus(), prepared)
        finally:
            try:
                spark_support.stop_session(handle)
            except Exception:  # must not hide the run's own outcome
                self.log.warning("sparktorch_ops: could not stop Spark", exc_info=True)

    def _prepare_data(self, session: Any) -> PreparedInput | None:
        """Resolve and check the job's DataFrame input (one Spark job), if it has any."""
        if self.job.data is None:
            return None
        prepared = prepare_input(self.job.data, session)
        self.machine.emit(events.INPUT_CHECKED, **prepared.facts.summary())
        self._check_cancelled()
        return prepared

    def _local_gpus(self) -> tuple[str, ...] | None:
        spec = self.spec
        if not spec.use_gpu:
            return None
        # Only the session's driver GPUs matter here; no session is started for them.
        session = self.job.spark.session or spark_support.active_session()
        return tuple(
            select_local_gpus(
                spec.num_processes,
                spark_driver_gpus=spark_support.driver_gpus(session),
                cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                device_count=_machine_gpu_count(),
            )
        )

    def _preflight(self, sc: Any) -> None:
        """Barrier mode: settings, layout, slots and the executors' Python, before launch."""
        spec = self.spec
        spark_support.check_barrier_conf(sc)
        layout = barrier_layout(spec.num_processes, spec.use_gpu, spark_support.task_gpu_amount(sc))
        spark_support.wait_for_slots(
            sc,
            layout.num_tasks,
            spec.start_timeout,
            lambda: self.job.cancel_token.cancelled,
        )
        self._check_cancelled()
        self.machine.emit(events.SLOTS_READY, tasks=layout.num_tasks)
        spark_support.probe_executors(sc, layout.num_tasks)
        self.machine.emit(events.EXECUTORS_CHECKED)

    def _preflight_connect(self, session: Any) -> None:
        """Barrier mode over Spark Connect: settings and layout, and the slots where the
        server's master fixes them (a client cannot count a cluster's free slots; the start
        deadline covers the rest)."""
        spec = self.spec
        spark_support.check_barrier_conf(session)
        layout = barrier_layout(
            spec.num_processes, spec.use_gpu, spark_support.task_gpu_amount(session)
        )
        slots = known_slots(session)
        if slots is not None:
            check_slots(layout.num_tasks, slots, waited=False)
            self.machine.emit(events.SLOTS_READY, tasks=layout.num_tasks)

    def _channel_host(self, sc: Any) -> tuple[str, str | None]:
        """Where the channel listens and, if different, the host tasks are told to reach."""
        if self.spec.channel_host is not None:
            return ("::" if ":" in self.spec.channel_host else "0.0.0.0"), self.spec.channel_host
        if sc is None:
            return "127.0.0.1", None
        if spark_support.is_connect_session(sc):
            return spark_support.client_address_toward_server(sc), None
        return spark_support.driver_host(sc), None

    def _say_unreachable(self, address: str) -> Callable[[dict[int, str]], None]:
        def say(reasons: dict[int, str]) -> None:
            tasks = ", ".join(str(node) for node in sorted(reasons))
            self.log.warning(
                "sparktorch_ops: %s: barrier task(s) %s could not reach this client's channel "
                "at %s (%s), so their ranks' output, metrics and result arrived with the "
                "stage's result, not live. For live logs, pass channel_host= an address of "
                "this machine that the executors can reach",
                self.run_id,
                tasks,
                address,
                next(iter(reasons.values())),
            )

        return say

    def _channel_certificate(self, sc: Any) -> ChannelCertificate | None:
        """A TLS certificate for the channel when Spark encrypts its own traffic (barrier
        mode; the local mode's channel never leaves loopback), unless the user opted out."""
        if sc is None or self.spec.allow_unencrypted_channel:
            return None
        if not spark_support.encryption_enabled(sc):
            return None
        return make_certificate()

    def _launch(
        self,
        started_at: pendulum.DateTime,
        started: float,
        sc: Any,
        local_gpus: tuple[str, ...] | None,
        data: PreparedInput | None = None,
    ) -> RunResult:
        spec, machine = self.spec, self.machine
        payload = self.job.payload
        collector = RunCollector(
            self.log,
            log_ranks=spec.log_ranks,
            on_metrics=self._on_metrics if spec.tracked or spec.on_metrics else None,
            max_restarts=spec.max_restarts,
            keep_rank0_stdout=not isinstance(payload, FunctionCall),
            on_phase=lambda name, **where: self._on_phase(collector, name, **where),
            max_result_bytes=spec.max_result_bytes,
        )
        host, advertise = self._channel_host(sc)
        secret = secrets.token_hex(32)
        certificate = self._channel_certificate(sc)
        server = ChannelServer(
            host,
            collector,
            self.log,
            secret,
            tls=certificate.server_context() if certificate is not None else None,
            advertise=advertise,
        )
        machine.emit(events.CHANNEL_OPEN, address=server.address, tls=certificate is not None)
        launcher: Launcher | None = None
        try:
            conf = (lambda key: spark_support.conf_value(sc, key)) if sc is not None else None
            facts = gather_facts(
                spec,
                self.run_id,
                conf_value=conf,
                channel_address=server.address,
                channel_fingerprint=certificate.fingerprint if certificate is not None else None,
                driver_host=socket.gethostname(),
                local_gpus=local_gpus,
            )
            plan = plan_run(spec, describe(payload), facts)
            machine.emit(events.PLANNED, nodes=plan.layout.num_tasks, plan=plan.to_dict())
            resumed_from = self._announce_checkpoint()
            self._check_cancelled()
            machine.to(RunState.STARTING)
            if sc is None:
                launcher = LocalLauncher(plan, payload, secret, collector, data)
            else:
                if data is not None:
                    collector.expect_shards(plan.layout.num_tasks)
                if spark_support.is_connect_session(sc):
                    launcher = ConnectBarrierLauncher(
                        plan,
                        payload,
                        secret,
                        sc,
                        release=server.close,
                        handler=collector,
                        on_unreachable=self._say_unreachable(server.address),
                        data=data,
                    )
                else:
                    launcher = BarrierLauncher(
                        plan, payload, secret, sc, release=server.close, data=data
                    )
            launcher.start()
            machine.emit(events.LAUNCHER_STARTED)
            self.log.info(
                "sparktorch_ops: %s started %d ranks in %s mode",
                self.run_id,
                spec.num_processes,
                spec.mode,
            )
            code, note = self._supervise(launcher, collector, server, plan, started)
            machine.to(RunState.FINISHING)
            if code == 0 and not collector.failed:
                self._drain(server, collector)
                machine.emit(events.DRAINED)
            if code != 0 or collector.failed:
                raise errors.TrainingFailedError(collector.failures(), note)
            value = self._value(collector)
        except BaseException:
            if launcher is not None:
                machine.emit(events.TEARDOWN)
                collector.begin_teardown()
                launcher.teardown()
                server.drain(collector.all_disconnected, _COLLATERAL_S)
            raise
        finally:
            server.close()
            if launcher is not None:
                launcher.finish()
                machine.emit(events.LAUNCHER_FINISHED)
        return RunResult(
            value=value,
            exit_codes=collector.exit_codes(),
            outputs=collector.outputs(),
            metrics=list(collector.metrics),
            metrics_dropped=collector.metrics_dropped,
            started_at=started_at,
            finished_at=pendulum.now("UTC"),
            mode=spec.mode,
            num_processes=spec.num_processes,
            app_id=spark_support.app_id(sc) if sc is not None else None,
            ui_url=spark_support.ui_url(sc) if sc is not None else None,
            output_truncated=collector.output_truncated,
            run_id=self.run_id,
            input=(
                {**data.facts.summary(), "source": data.description} if data is not None else None
            ),
            checkpoint=self._checkpoint_summary(resumed_from),
        )

    def _announce_checkpoint(self) -> int | None:
        """Say whether the ranks will resume, warm start or start fresh; the step resumed."""
        directory = self.spec.checkpoint_dir
        if directory is None:
            return None
        step = _driver_latest_step(directory, self.log)
        warm = self.spec.warm_start_from
        if step is not None:
            self.log.info(
                "sparktorch_ops: resuming from step %d of checkpoint_dir %s%s",
                step,
                directory,
                f" (warm_start_from {warm} not used: a resume wins)" if warm else "",
            )
        elif warm is not None:
            self.log.info(
                "sparktorch_ops: no checkpoint in %s yet: warm start from %s", directory, warm
            )
        else:
            self.log.info("sparktorch_ops: no checkpoint in %s yet: starting fresh", directory)
        return step

    def _checkpoint_summary(self, resumed_from: int | None) -> dict[str, Any] | None:
        directory = self.spec.checkpoint_dir
        if directory is None:
            return None
        return {
            "dir": directory,
            "resumed_from_step": resumed_from,
            "warm_start_from": self.spec.warm_start_from if resumed_from is None else None,
            "latest_step": _driver_latest_step(directory, self.log),
        }

    def _on_phase(self, collector: RunCollector, name: str, **where: Any) -> None:
        """A phase seen on the channel; the last rank to connect makes the run RUNNING."""
        self.machine.emit(name, **where)
        if (
            name == events.SUPERVISOR_CONNECTED
            and collector.started_ranks() >= self.spec.num_processes
        ):
            self.machine.advance(RunState.STARTING, RunState.RUNNING)

    def _supervise(
        self,
        launcher: Launcher,
        collector: RunCollector,
        server: ChannelServer,
        plan: RunPlan,
        started: float,
    ) -> tuple[int, str]:
        spec = self.spec
        released = False
        start_deadline = spec.start_timeout
        if start_deadline is None:
            start_deadline = launcher.default_start_timeout
        while True:
            self._check_cancelled()
            elapsed = time.monotonic() - started
            if spec.timeout is not None and elapsed > spec.timeout:
                raise errors.TrainingTimeoutError("timeout", spec.timeout)
            connected = collector.started_ranks()
            if (
                connected < spec.num_processes
                and start_deadline is not None
                and elapsed > start_deadline
                and not launcher.stage_started
            ):
                raise errors.StartTimeoutError(
                    "start_timeout",
                    start_deadline,
                    f"only {connected} of {spec.num_processes} ranks started"
                    + launcher.start_timeout_hint,
                )
            if collector.result_refused is not None:
                raise collector.result_refused  # stop rank 0 sending the rest
            if collector.fatal:
                # The failed rank reports its exit a moment after its failure: wait for that
                # (briefly) so the error has the exit code before the others are torn down.
                deadline = time.monotonic() + _EXIT_REPORT_S
                while not collector.failed_ranks_reported() and time.monotonic() < deadline:
                    time.sleep(_POLL_S / 5)
                if launcher.explains_losses and collector.lost_something():
                    return self._spark_cause(launcher, collector)
                return 1, ""
            if (
                launcher.needs_release
                and not released
                and collector.nodes_done(plan.layout.num_tasks)
            ):
                # Every agent is done with the rendezvous store; the supervisors' last frames
                # are read before the release closes the channel.
                self._drain(server, collector)
                launcher.release_rendezvous()
                released = True
            status = launcher.poll()  # raises SparkJobKilledError for a kill from the Spark UI
            if status is not None:
                if launcher.spark_error is not None:
                    return self._spark_cause(launcher, collector)
                return status
            time.sleep(_POLL_S)

    def _drain(self, server: ChannelServer, collector: RunCollector) -> None:
        """Read what the ranks still send until every rank has hung up; when that does not
        happen in time, say so (in the log and in a script's value) instead of losing it."""
        num_processes = self.spec.num_processes
        if server.drain(lambda: collector.supervisors_done(num_processes), _DRAIN_S):
            return
        if collector.incomplete is None:
            self.log.log(
                logging.WARNING,
                "sparktorch_ops: %s: not every rank hung up within %g s of finishing (a process "
                "a rank started may still hold its connection); output, metrics or the result "
                "sent after that are lost",
                self.run_id,
                _DRAIN_S,
            )
        collector.mark_incomplete(
            f"not every rank had hung up {_DRAIN_S:g} s after the run ended; output sent "
            "later was not read"
        )

    def _spark_cause(self, launcher: Launcher, collector: RunCollector) -> tuple[int, str]:
        """A barrier task was lost: Spark's own error for the job says why (a task that raised,
        a full disk), or that the job was killed (raises SparkJobKilledError). Wait briefly for
        it; log it and make it the failure's reason."""
        launcher.look_for_cause()
        deadline = time.monotonic() + _SPARK_CAUSE_S
        while launcher.poll() is None and time.monotonic() < deadline:
            self._check_cancelled()
            time.sleep(_POLL_S)
        status = launcher.poll()
        if launcher.spark_error is None:
            return 1, ""
        self.log.log(
            logging.WARNING,
            "sparktorch_ops: %s: the Spark job failed: %s",
            self.run_id,
            launcher.spark_error_detail,
        )
        if collector.explain_lost_nodes(launcher.spark_error):
            return 1, ""  # the lost task's failure says it: once is enough
        return status if status is not None else (1, "")

    def _value(self, collector: RunCollector) -> Any:
        if collector.result_refused is not None:
            raise collector.result_refused
        if not isinstance(self.job.payload, FunctionCall):
            return collector.rank0_stdout()
        if collector.result is None:
            raise errors.ChannelError(
                "rank 0 finished but its return value never arrived over the channel"
            )
        try:
            return cloudpickle.load(collector.result.reader())
        except Exception as exc:
            raise errors.SparkTorchError(
                f"rank 0's return value cannot be unpickled on the driver: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


_FINAL_STATES = {
    "cancelled": RunState.CANCELLED,
    "timed_out": RunState.TIMED_OUT,
}


def _final_state(error: BaseException) -> RunState:
    """The state a run that raised ``error`` ends in: the outcome mapping's, one place."""
    return _FINAL_STATES.get(outcome_of(error).status, RunState.FAILED)
