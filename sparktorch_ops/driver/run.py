"""One run on the driver: prepare -> (launch -> supervise -> finish) per attempt.

:class:`Run` holds the run's identity, its state machine (:mod:`sparktorch_ops.events`) and
its observers (MLflow when tracked, then the caller's ``on_event`` / ``on_metrics``); the
parts live in :mod:`~sparktorch_ops.driver.prepare` (session, checks, input),
:mod:`~sparktorch_ops.driver.launch` (channel, plan, launcher) and
:mod:`~sparktorch_ops.driver.supervise`; the finish (rank 0's value, the result) is here.
A helper thread drives the run while the caller's thread waits in plain Python, so that
Ctrl-C or an orchestrator's timeout reaches the caller and becomes a cancel. An attempt that an
infrastructure failure ended is followed by another, up to ``max_failures``
(:mod:`~sparktorch_ops.driver.attempts`), each with a fresh channel, secret and rendezvous,
resuming from the latest checkpoint.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import sys
import threading
import time
import uuid
from typing import Any

import cloudpickle
import pendulum

from sparktorch_ops import errors, events
from sparktorch_ops.driver.attempts import Cause, infrastructure_cause, retry_line
from sparktorch_ops.driver.collector import RunCollector
from sparktorch_ops.driver.launch import Launched, latest_checkpoint, launch
from sparktorch_ops.driver.packing import describe
from sparktorch_ops.driver.prepare import Prepared, next_attempt_processes, prepare
from sparktorch_ops.driver.supervise import POLL_S, Supervisor
from sparktorch_ops.driver.tracking import MlflowTracker, start_tracking
from sparktorch_ops.events import RunState, RunStateMachine
from sparktorch_ops.job import TrainingJob
from sparktorch_ops.results import Attempt, MetricRecord, RunResult
from sparktorch_ops.spark import session as spark_support
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire.payload import FunctionCall, Payload

_CANCEL_WAIT_S = 60.0  # how long an interrupted caller waits for the run to be torn down
PACKAGE_LOGGER = logging.getLogger("sparktorch_ops")


class ConsoleOutput:
    """Rank lines on the driver's stdout/stderr while runs without a logger are in progress.

    With no ``logger=`` and no handler configured for :data:`PACKAGE_LOGGER` (a plain script,
    a notebook), INFO records would be dropped; torchrun prints its ranks' output, so a run
    does too: stdout lines to stdout, stderr lines (WARNING) to stderr. A configured handler
    (or one anywhere up the logger tree) takes over. The handlers are reference-counted: runs
    in several threads share them, and the last one to end removes them.
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
                if PACKAGE_LOGGER.hasHandlers():
                    return False
                out = logging.StreamHandler(sys.stdout)
                out.addFilter(lambda record: record.levelno < logging.WARNING)
                err = logging.StreamHandler(sys.stderr)
                err.setLevel(logging.WARNING)
                self._handlers = [out, err]
                for handler in self._handlers:
                    handler.setFormatter(logging.Formatter("%(message)s"))
                    PACKAGE_LOGGER.addHandler(handler)
                self._saved_level = PACKAGE_LOGGER.level
                PACKAGE_LOGGER.setLevel(logging.INFO)
            self._users += 1
            return True

    def release(self) -> None:
        """Detach the handlers once the last run that uses them is over."""
        with self._lock:
            self._users -= 1
            if self._users == 0:
                for handler in self._handlers:
                    PACKAGE_LOGGER.removeHandler(handler)
                self._handlers = []
                PACKAGE_LOGGER.setLevel(self._saved_level)


console = ConsoleOutput()


def new_run_id() -> str:
    """A fresh run id (also the thread's name and the prefix of the run's log lines)."""
    return f"sparktorch-{uuid.uuid4().hex[:16]}"


class Run:
    """One launch of a job."""

    def __init__(self, job: TrainingJob) -> None:
        self.job = job
        self.spec = job.options
        self.run_id = new_run_id()
        self.log = self.spec.logger or PACKAGE_LOGGER
        self.machine = RunStateMachine(self.run_id, self._on_event, self.log)
        self._done = False
        self._outcome: RunResult | BaseException | None = None
        self._tracker: MlflowTracker | None = None

    def execute(self) -> RunResult:
        """Run the job to its end (see :meth:`TorchDistributor.run` for what it raises)."""
        self.check_cancelled()  # cancelled while the job was being built
        training = self.spec.training
        if self.spec.tracked:  # here: MLflow's active run is the caller thread's
            job = self.job
            self._tracker = start_tracking(
                self.spec, self.run_id, describe(job.payload), job.args, job.kwargs, self.log
            )
        last_try = training is None or training.last_try
        try:
            outcome = self._wait()
        except BaseException as exc:
            if self._tracker is not None:
                self._tracker.finish(exc, last_try=last_try)
            raise
        if training is not None:
            outcome = dataclasses.replace(outcome, training_id=training.training_id)
        if self._tracker is not None:
            self._tracker.finish(outcome)
            outcome = dataclasses.replace(
                outcome, mlflow_run_id=self._tracker.run_id, mlflow_run_url=self._tracker.url
            )
        return outcome

    def check_cancelled(self) -> None:
        """Raise TrainingCancelledError once the job's cancel token is set."""
        reason = self.job.cancel_token.reason
        if reason is not None:
            raise errors.TrainingCancelledError(reason)

    # The run's observers: MLflow (when tracked), then the caller's hooks.
    def _on_metrics(self, record: MetricRecord) -> None:
        if self._tracker is not None:
            self._tracker.on_metrics(record)
        if self.spec.on_metrics is not None:
            self.spec.on_metrics(record)

    def _on_event(self, event: events.PhaseEvent) -> None:
        if self._tracker is not None:
            self._tracker.on_event(event)
        if self.spec.on_event is not None:
            self.spec.on_event(event)

    def _wait(self) -> RunResult:
        context = contextvars.copy_context()
        thread = threading.Thread(
            target=context.run, args=(self._drive,), name=self.run_id, daemon=True
        )
        thread.start()
        try:
            while not self._done:
                time.sleep(POLL_S)
        except BaseException as exc:
            # Interrupted (Ctrl-C, an orchestrator's timeout or kill): stop the run, then let
            # the interruption propagate.
            self.job.cancel_token.cancel(
                f"the waiting thread was interrupted by {type(exc).__name__}"
            )
            deadline = time.monotonic() + _CANCEL_WAIT_S
            while not self._done and time.monotonic() < deadline:
                try:
                    time.sleep(POLL_S)
                except BaseException:
                    continue
            raise
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        assert self._outcome is not None
        return self._outcome

    def _drive(self) -> None:
        uses_console = self.spec.logger is None and console.acquire()
        try:
            self._outcome = self._run()
            final = RunState.SUCCEEDED
        except BaseException as exc:
            self._outcome = exc
            final = errors.outcome_of(exc).state
        finally:
            if uses_console:
                console.release()
        try:
            self.machine.finish(final)  # the final event reaches on_event before run() returns
        finally:
            self._done = True

    def _run(self) -> RunResult:
        spec, machine, log, payload = self.spec, self.machine, self.log, self.job.payload
        started_at = pendulum.now("UTC")
        started = time.monotonic()
        machine.to(RunState.PREPARING)
        machine.emit(events.PAYLOAD_PACKED, payload=describe(payload))
        with prepare(self.job, self.run_id, machine, log, self.check_cancelled) as prepared:
            attempts: list[Attempt] = []
            processes = prepared.num_processes
            while True:
                number = len(attempts) + 1
                began, began_at = time.monotonic(), time.time()
                machine.emit(events.ATTEMPT_STARTED, attempt=number, ranks=processes)
                try:
                    result, resumed_from = self._attempt(
                        dataclasses.replace(spec, num_processes=processes),
                        prepared,
                        started,
                        began,
                    )
                except _AttemptFailed as failed:
                    ended = failed.described()
                    seconds = time.monotonic() - began
                    attempts.append(
                        Attempt(
                            number,
                            processes,
                            began_at,
                            seconds,
                            failed.resumed_from,
                            ended.text,
                            ended.host,
                        )
                    )
                    retried = failed.cause is not None and number <= spec.max_failures
                    machine.emit(
                        events.ATTEMPT_FAILED,
                        attempt=number,
                        cause=ended.text,
                        host=ended.host,
                        retried=retried,
                    )
                    if not retried:
                        raise failed.error.with_attempts(attempts) from None
                    processes = self._next_attempt(prepared, failed, number)
                    continue
                seconds = time.monotonic() - began
                attempts.append(Attempt(number, processes, began_at, seconds, resumed_from))
                return dataclasses.replace(result, attempts=tuple(attempts), started_at=started_at)

    def _next_attempt(self, prepared: Prepared, failed: _AttemptFailed, number: int) -> int:
        """Before attempt ``number + 1``: its ranks, once the slots are there (a cancel
        meanwhile ends the run at once), and the line that says why it starts."""
        spec, log = self.spec, self.log
        self.check_cancelled()
        processes = next_attempt_processes(self.job, prepared, self.machine, log)
        assert failed.cause is not None
        resume_step = latest_checkpoint(spec, log)
        attempts = spec.max_failures + 1
        log.warning(
            retry_line(number, attempts, failed.cause, failed.last_step, resume_step, processes)
        )
        return processes

    def _attempt(
        self, spec: LaunchSpec, prepared: Prepared, started: float, began: float
    ) -> tuple[RunResult, int | None]:
        """One attempt: every rank launched, watched to its end; the run's result and the
        checkpoint step the ranks resumed from.

        Raises:
            _AttemptFailed: a rank (or a barrier task) failed: the error, and whether a new
                attempt could cure it.
        """
        machine, log, payload = self.machine, self.log, self.job.payload
        started_at = pendulum.now("UTC")
        with launch(
            spec,
            payload,
            self.run_id,
            prepared,
            machine,
            log,
            on_metrics=self._on_metrics if spec.tracked or spec.on_metrics else None,
            check_cancelled=self.check_cancelled,
            mlflow_run_id=self._tracker.run_id if self._tracker is not None else None,
        ) as launched:
            supervisor = Supervisor(
                spec, self.run_id, launched, started, self.check_cancelled, log, began
            )
            self.job.cancel_token.attach(self.run_id, supervisor.stacks)
            try:
                code, note = supervisor.watch()
            finally:
                self.job.cancel_token.detach()
            collector = launched.collector
            heard = collector.status()
            if code != 0 or heard.failed:
                failures = collector.failures()
                cause = infrastructure_cause(
                    failures, heard.lost_nodes, heard.lost_ranks, launched.launcher.status().cause
                )
                raise _AttemptFailed(
                    errors.TrainingFailedError(failures, note),
                    cause,
                    launched.resumed_from,
                    collector.metrics.last_step(),
                )
            machine.to(RunState.FINISHING)
            supervisor.drain()
            machine.emit(events.DRAINED)
            value = _rank0_value(collector, payload)
        result = _run_result(spec, launched, prepared, value, started_at, log)
        return result, launched.resumed_from


def _rank0_value(collector: RunCollector, payload: Payload) -> Any:
    """A function's return value (unpickled) or a script's stdout, from rank 0.

    Raises:
        ResultTooLargeError: over ``max_result_bytes``.
        ChannelError: rank 0 finished but its value never arrived.
        SparkTorchError: the value does not unpickle on the driver.
    """
    if collector.result.refused is not None:
        raise collector.result.refused
    if not isinstance(payload, FunctionCall):
        return collector.stdout.text()
    if collector.result.value is None:
        raise errors.ChannelError(
            "rank 0 finished but its return value never arrived over the channel"
        )
    try:
        return cloudpickle.load(collector.result.value.reader())
    except Exception as exc:
        raise errors.SparkTorchError(
            f"rank 0's return value cannot be unpickled on the driver: {type(exc).__name__}: {exc}"
        ) from exc


def _run_result(
    spec: LaunchSpec,
    launched: Launched,
    prepared: Prepared,
    value: Any,
    started_at: pendulum.DateTime,
    log: logging.Logger,
) -> RunResult:
    """Everything a finished run produced, for the caller."""
    collector, sc, data = launched.collector, prepared.sc, prepared.data
    directory = spec.checkpoint_dir
    return RunResult(
        value=value,
        exit_codes=collector.exit_codes(),
        outputs=collector.outputs(),
        metrics=list(collector.metrics.records),
        metrics_dropped=collector.metrics.dropped,
        started_at=started_at,
        finished_at=pendulum.now("UTC"),
        mode=spec.mode,
        num_processes=spec.num_processes,
        app_id=spark_support.app_id(sc) if sc is not None else None,
        ui_url=spark_support.ui_url(sc) if sc is not None else None,
        output_truncated=collector.stdout.cut,
        run_id=launched.plan.run_id,
        input=({**data.facts.summary(), "source": data.description} if data is not None else None),
        checkpoint=None
        if directory is None
        else {
            "dir": directory,
            "resumed_from_step": launched.resumed_from,
            "warm_start_from": spec.warm_start_from if launched.resumed_from is None else None,
            "latest_step": latest_checkpoint(spec, log),
        },
    )


@dataclasses.dataclass
class _AttemptFailed(Exception):
    """An attempt ended with failed ranks: the error, the infrastructure cause a new attempt
    could cure (None: the training's own failure), the checkpoint step it had resumed from,
    and rank 0's last reported step."""

    error: errors.TrainingFailedError
    cause: Cause | None
    resumed_from: int | None
    last_step: int | None

    def described(self) -> Cause:
        """What ended the attempt: the infrastructure cause, else its first failure."""
        if self.cause is not None:
            return self.cause
        first = self.error.first_failure
        if first is None:
            return Cause(self.error.note or "the training failed")
        return Cause(first.describe(), first.host or None)
