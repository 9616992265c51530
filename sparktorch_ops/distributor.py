"""TorchDistributor: validate -> plan -> launch (local or barrier) -> collect a RunResult."""

from __future__ import annotations

import contextvars
import datetime
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import cloudpickle
import pendulum

from sparktorch_ops import spark as spark_support
from sparktorch_ops.channel import ChannelServer
from sparktorch_ops.collector import RunCollector
from sparktorch_ops.errors import (
    ChannelError,
    SparkTorchError,
    StartTimeoutError,
    TrainingCancelledError,
    TrainingFailedError,
    TrainingTimeoutError,
)
from sparktorch_ops.launchers import BarrierLauncher, LocalLauncher
from sparktorch_ops.payload import FunctionCall, Payload, prepare
from sparktorch_ops.planning import BarrierLayout, barrier_layout, select_local_gpus
from sparktorch_ops.results import MetricRecord, RunResult
from sparktorch_ops.spec import LaunchSpec

_POLL_S = 0.05
_DRAIN_S = 10.0
_COLLATERAL_S = 3.0
_EXIT_REPORT_S = 2.0
_default_logger = logging.getLogger("sparktorch_ops")


def _machine_gpu_count() -> int:
    """GPUs this machine has; torch is imported only when a GPU driver is present."""
    if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")):
        return 0
    import torch

    return int(torch.cuda.device_count())


class TorchDistributor:
    """Run a PyTorch training function or script with torchrun, locally or on Spark.

    A drop-in for ``pyspark.ml.torch.distributor.TorchDistributor`` (same defaults, same
    ``run``), plus ``launch`` (a :class:`RunResult`), ``cancel`` and the options below.

    Args:
        num_processes: total number of ranks.
        local_mode: True runs the ranks on the driver; False runs one rank per Spark barrier
            task (k per task with ``spark.task.resource.gpu.amount=k``).
        use_gpu: give each rank its own GPU.
        spark: the SparkSession (default: the active one; barrier mode creates one if none).
        env: extra environment variables for every rank.
        max_restarts: torchrun's worker-group restarts within one run.
        torchrun_args: further torchrun options (not those the distributor sets itself).
        logger: receives every rank's output (stdout at INFO, stderr at WARNING): a
            ``logging.Logger``, an adapter, or anything with ``log(level, msg, *args)``.
        on_metrics: called with every ``sparktorch_ops.report()`` record as it arrives.
        start_timeout: seconds to wait for task slots, executors and the rendezvous.
        timeout: seconds (or a timedelta) the whole run may take.
        log_ranks: ranks whose output is forwarded to ``logger`` (default: all).
        allow_unencrypted_channel: run even though Spark encryption is on.
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
        start_timeout: float | datetime.timedelta | None = None,
        timeout: float | datetime.timedelta | None = None,
        log_ranks: Iterable[int] | None = None,
        allow_unencrypted_channel: bool = False,
    ) -> None:
        self.spec = LaunchSpec(
            num_processes=num_processes,
            local_mode=local_mode,
            use_gpu=use_gpu,
            env=env,  # type: ignore[arg-type]
            max_restarts=max_restarts,
            torchrun_args=torchrun_args,  # type: ignore[arg-type]
            start_timeout=start_timeout,  # type: ignore[arg-type]
            timeout=timeout,  # type: ignore[arg-type]
            log_ranks=log_ranks,  # type: ignore[arg-type]
            logger=logger,
            on_metrics=on_metrics,
            allow_unencrypted_channel=allow_unencrypted_channel,
        )
        if spark is not None:
            spark_support.refuse_connect(spark)
        self.spark = spark
        self._runs: list[_Run] = []

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
        run = _Run(self.spec)
        self._runs.append(run)  # from here on, cancel() reaches this run
        try:
            run.payload = prepare(train_object, args, kwargs)
            run.session, run.gpus = self._resolve_resources()
            return run.execute()
        finally:
            self._runs.remove(run)

    def cancel(self) -> None:
        """Cancel every run of this distributor in progress; do nothing when none is.

        Safe from any thread and from a signal handler on the main thread: it only sets a flag
        that the run's own thread acts on, and the caller of ``run`` then raises
        :class:`TrainingCancelledError` once everything of the run is gone.
        """
        for run in list(self._runs):
            run.request_cancel("cancel() was called")

    def _resolve_resources(self) -> tuple[Any, list[str] | None]:
        spec = self.spec
        if spec.local_mode:
            if not spec.use_gpu:
                return None, None
            # Only the session's driver GPUs matter here; no session is started for them.
            session = self.spark if self.spark is not None else spark_support.active_session()
            gpus = select_local_gpus(
                spec.num_processes,
                spark_driver_gpus=spark_support.driver_gpus(session),
                cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                device_count=_machine_gpu_count(),
            )
            return None, gpus
        return spark_support.session_for_barrier(self.spark), None


class _Run:
    """One launch: a helper thread drives it while the caller's thread waits in plain Python."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.payload: Payload = FunctionCall(b"")
        self.session: Any = None
        self.gpus: list[str] | None = None
        self.run_id = f"sparktorch-{uuid.uuid4().hex[:16]}"
        self.log = spec.logger or _default_logger
        self.cancel_reason: str | None = None
        self.done = False
        self.outcome: RunResult | BaseException | None = None

    def request_cancel(self, reason: str) -> None:
        """Ask the run to stop (only sets a flag: safe in a signal handler)."""
        if self.cancel_reason is None:
            self.cancel_reason = reason

    def execute(self) -> RunResult:
        self._check_cancelled()  # cancelled while the call was being packed
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
            self.request_cancel(f"the waiting thread was interrupted by {type(exc).__name__}")
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
        try:
            self.outcome = self._launch_and_wait()
        except BaseException as exc:
            self.outcome = exc
        finally:
            self.done = True

    def _launch_and_wait(self) -> RunResult:
        spec = self.spec
        started_at = pendulum.now("UTC")
        started = time.monotonic()
        sc = None
        layout = None
        if not spec.local_mode:
            sc = self.session.sparkContext
            spark_support.check_barrier_conf(
                sc, allow_unencrypted_channel=spec.allow_unencrypted_channel
            )
            layout = barrier_layout(
                spec.num_processes, spec.use_gpu, spark_support.task_gpu_amount(sc)
            )
            spark_support.wait_for_slots(
                sc, layout.num_tasks, spec.start_timeout, lambda: self.cancel_reason is not None
            )
            self._check_cancelled()
            spark_support.probe_executors(sc, layout.num_tasks)
        collector = RunCollector(
            self.log,
            log_ranks=spec.log_ranks,
            on_metrics=spec.on_metrics,
            max_restarts=spec.max_restarts,
            keep_rank0_stdout=not isinstance(self.payload, FunctionCall),
        )
        host = "127.0.0.1" if sc is None else spark_support.driver_host(sc)
        token = secrets.token_hex(32)
        server = ChannelServer(host, collector, self.log, token)
        launcher: LocalLauncher | BarrierLauncher | None = None
        try:
            self._check_cancelled()
            if sc is None:
                launcher = LocalLauncher(
                    spec, self.run_id, self.payload, server.address, token, collector, self.gpus
                )
            else:
                assert layout is not None
                launcher = BarrierLauncher(
                    spec, self.run_id, self.payload, server.address, token, sc, layout
                )
            self.log.info(
                "sparktorch_ops: %s started %d ranks in %s mode",
                self.run_id,
                spec.num_processes,
                spec.mode,
            )
            code, note = self._supervise(launcher, collector, started, server, layout)
            if code == 0 and not collector.failure_order:
                server.drain(lambda: collector.supervisors_done(spec.num_processes), _DRAIN_S)
            if code != 0 or collector.failure_order:
                raise TrainingFailedError(collector.failures(), note)
            value = self._value(collector)
        except BaseException:
            if launcher is not None:
                collector.tearing_down = True
                launcher.teardown()
                server.drain(lambda: not collector.open_peers, _COLLATERAL_S)
            raise
        finally:
            server.close()
            if launcher is not None:
                launcher.finish()
        return RunResult(
            value=value,
            exit_codes=collector.exit_codes(),
            outputs=collector.outputs(),
            metrics=list(collector.metrics),
            started_at=started_at,
            finished_at=pendulum.now("UTC"),
            mode=spec.mode,
            num_processes=spec.num_processes,
            app_id=sc.applicationId if sc is not None else None,
            ui_url=spark_support.ui_url(sc) if sc is not None else None,
            output_truncated=collector.stdout_truncated,
            run_id=self.run_id,
        )

    def _check_cancelled(self) -> None:
        if self.cancel_reason is not None:
            raise TrainingCancelledError(self.cancel_reason)

    def _supervise(
        self,
        launcher: LocalLauncher | BarrierLauncher,
        collector: RunCollector,
        started: float,
        server: ChannelServer,
        layout: BarrierLayout | None,
    ) -> tuple[int, str]:
        spec = self.spec
        released = False
        while True:
            self._check_cancelled()
            elapsed = time.monotonic() - started
            if spec.timeout is not None and elapsed > spec.timeout:
                raise TrainingTimeoutError("timeout", spec.timeout)
            if (
                spec.start_timeout is not None
                and elapsed > spec.start_timeout
                and collector.started_ranks() < spec.num_processes
            ):
                raise StartTimeoutError(
                    "start_timeout",
                    spec.start_timeout,
                    f"only {collector.started_ranks()} of {spec.num_processes} ranks started",
                )
            if collector.fatal:
                # The failed rank reports its exit a moment after its failure: wait for that
                # (briefly) so the error has the exit code before the others are torn down.
                deadline = time.monotonic() + _EXIT_REPORT_S
                while not collector.failed_ranks_reported() and time.monotonic() < deadline:
                    time.sleep(_POLL_S / 5)
                return 1, ""
            if layout is not None and not released and collector.nodes_done(layout.num_tasks):
                # Every agent is done with the rendezvous store: closing the channel tells task
                # 0 it may drop the store and lets the barrier job finish (a Spark barrier()
                # call would cost about a second).
                server.drain(lambda: collector.supervisors_done(spec.num_processes), _DRAIN_S)
                server.close()
                released = True
            status = launcher.poll()
            if status is not None:
                return status
            time.sleep(_POLL_S)

    def _value(self, collector: RunCollector) -> Any:
        if not isinstance(self.payload, FunctionCall):
            return collector.rank0_stdout()
        if collector.result is None:
            raise ChannelError(
                "rank 0 finished but its return value never arrived over the channel"
            )
        try:
            return cloudpickle.load(collector.result.reader())
        except Exception as exc:
            raise SparkTorchError(
                f"rank 0's return value cannot be unpickled on the driver: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
