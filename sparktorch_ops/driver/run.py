"""One run on the driver: prepare -> (launch -> supervise -> finish) per attempt.

:class:`Run` holds the run's identity, its state machine (:mod:`sparktorch_ops.events`) and
its observers (MLflow when tracked, then the caller's ``on_event`` / ``on_metrics``); each part
lives in its own module: :mod:`~sparktorch_ops.driver.prepare` (session, checks, input),
:mod:`~sparktorch_ops.driver.launch` (channel, plan, launcher),
:mod:`~sparktorch_ops.driver.supervise` and :mod:`~sparktorch_ops.driver.finish`.
A helper thread drives the run while the caller's thread waits in plain Python, so that
Ctrl-C or an orchestrator's timeout reaches the caller and becomes a cancel. An attempt that an
infrastructure failure ended is followed by another, up to ``max_failures``
(:mod:`~sparktorch_ops.driver.attempts`), each with a fresh channel, secret and rendezvous,
resuming from the latest checkpoint.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
import time
import uuid

import pendulum

from sparktorch_ops import errors, events
from sparktorch_ops.driver import resume
from sparktorch_ops.driver.attempts import Cause, infrastructure_cause, retry_line
from sparktorch_ops.driver.console import PACKAGE_LOGGER, console
from sparktorch_ops.driver.finish import rank0_value, run_result
from sparktorch_ops.driver.launch import launch
from sparktorch_ops.driver.packing import describe
from sparktorch_ops.driver.prepare import Prepared, next_attempt_processes, prepare
from sparktorch_ops.driver.supervise import POLL_S, Supervisor
from sparktorch_ops.driver.tracking import MlflowTracker, start_tracking
from sparktorch_ops.events import RunState, RunStateMachine
from sparktorch_ops.job import TrainingJob
from sparktorch_ops.results import Attempt, MetricRecord, RunResult
from sparktorch_ops.spec import LaunchSpec

_CANCEL_WAIT_S = 60.0  # how long an interrupted caller waits for the run to be torn down


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
        resume_step = resume.latest(spec, log)
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
            value = rank0_value(collector, payload)
        result = run_result(spec, launched, prepared, value, started_at, log)
        return result, launched.resumed_from


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
