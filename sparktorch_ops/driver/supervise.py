"""The third part of a run: watch the launched ranks until the run ends one way or another.

:class:`Supervisor` polls two snapshots, the collector's status (what the ranks and tasks
said) and the launcher's (behind its protocol: it never asks which kind it holds), and
branches on them for the run's limits (``timeout``, ``start_timeout``, ``stall_timeout``), a
refused result, a fatal rank failure (with the cluster's own error for a lost barrier task)
and the ranks' exit. A stop that is not the ranks' own end (a stall, a limit, a cancel) takes every
rank's stacks first, so the error says where training was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sparktorch_ops import errors
from sparktorch_ops.driver.launch import Launched
from sparktorch_ops.spark.preflight import unusable_python
from sparktorch_ops.spec import LaunchSpec

POLL_S = 0.05
DRAIN_S = 10.0  # how long a finished run waits for the ranks' last frames
EXIT_REPORT_S = 2.0  # how long a failed rank's exit report may follow its failure
SPARK_CAUSE_S = 3.0  # how long a lost barrier task's Spark error may take to arrive


@dataclass
class Supervisor:
    """Watches one launched run.

    Attributes:
        spec: the run's options (its limits).
        run_id: for log lines.
        launched: the started run.
        started: ``time.monotonic()`` when the run began (``timeout`` counts from there).
        check_cancelled: raises TrainingCancelledError once the run is cancelled.
        log: the run's logger.
        attempt_started: when this attempt began (``start_timeout`` counts from there; by
            default the run's start).
    """

    spec: LaunchSpec
    run_id: str
    launched: Launched
    started: float
    check_cancelled: Callable[[], None]
    log: logging.Logger
    attempt_started: float | None = None

    def stacks(self, log: bool = False) -> dict[int, str]:
        """Every rank's stacks now, by rank (see :meth:`RunCollector.capture_stacks`); safe
        from any thread."""
        launched = self.launched
        return launched.collector.capture_stacks(
            launched.server.send, self.spec.num_processes, log=log
        )

    def watch(self) -> tuple[int, str]:
        """Wait for the run's end: the exit code (0: every rank succeeded) and a note.

        Raises:
            TrainingStalledError: no rank showed progress for ``stall_timeout``.
            TrainingTimeoutError, StartTimeoutError: a limit ran out.
            TrainingCancelledError: the run was cancelled.
            ResultTooLargeError: rank 0's result is over ``max_result_bytes``.
            ConfigError: an executor's Python cannot run the ranks (no torch, a broken one).
            SparkJobKilledError: the job was killed from Spark's UI.

        Each but the last three says where the ranks were (``stacks``), also logged.
        """
        try:
            return self._watch()
        except errors.SparkJobKilledError:
            raise  # the ranks are gone with the job: nobody left to ask
        except (
            errors.TrainingCancelledError,
            errors.TrainingTimeoutError,
            errors.StartTimeoutError,
        ) as stop:
            stacks = self.stacks(log=True)
            if not stacks:
                self.log.info(
                    "sparktorch_ops: %s: no rank is connected to this driver's channel (none "
                    "started yet, or the tasks relay their frames): where they were is unknown",
                    self.run_id,
                )
            raise stop.with_stacks(stacks) if stacks else stop from None

    def _watch(self) -> tuple[int, str]:
        spec, launched = self.spec, self.launched
        launcher, collector = launched.launcher, launched.collector
        released = False
        while True:
            self.check_cancelled()
            now = time.monotonic()
            if spec.timeout is not None and now - self.started > spec.timeout:
                raise errors.TrainingTimeoutError("timeout", spec.timeout)
            heard, status = collector.status(), launcher.status()
            start_deadline = spec.start_timeout
            if start_deadline is None:
                start_deadline = status.start_timeout
            if (
                heard.connected < spec.num_processes
                and start_deadline is not None
                and now - (self.attempt_started or self.started) > start_deadline
                and not status.tasks_started
            ):
                raise errors.StartTimeoutError(
                    "start_timeout",
                    start_deadline,
                    f"only {heard.connected} of {spec.num_processes} ranks started"
                    + status.start_timeout_hint,
                )
            if spec.stall_timeout is not None:
                self._check_stall(spec.stall_timeout, heard.silent)
            if heard.refused is not None:
                raise heard.refused  # stop rank 0 sending the rest
            if heard.unusable is not None:
                raise unusable_python(heard.unusable)
            if heard.fatal:
                # The failed rank reports its exit a moment after its failure: wait for that
                # (briefly) so the error has the exit code before the others are torn down.
                deadline = time.monotonic() + EXIT_REPORT_S
                while not heard.failures_reported and time.monotonic() < deadline:
                    time.sleep(POLL_S / 5)
                    heard = collector.status()
                return self._cluster_cause() if heard.lost else (1, "")
            if not released and heard.nodes_succeeded(launched.plan.layout.num_tasks):
                # Every agent is done with the rendezvous store: the supervisors' last frames
                # are read, then closing the channel tells the tasks to let it go.
                self.drain()
                launched.server.close()
                released = True
            if status.error is not None:
                raise status.error  # a kill from the Spark UI, the executors' wrong Python
            if status.exit is not None:
                return self._cluster_cause() if status.cause is not None else status.exit
            time.sleep(POLL_S)

    def _check_stall(self, limit: float, silent: Mapping[int, float]) -> None:
        """Raise TrainingStalledError once every running rank has been silent for ``limit``."""
        if not silent or min(silent.values()) < limit:
            return
        self.log.warning(
            "sparktorch_ops: %s: no rank showed progress for %.1f s (stall_timeout=%g): "
            "taking every rank's stacks, then stopping the run",
            self.run_id,
            min(silent.values()),
            limit,
        )
        stacks = self.stacks(log=True)
        wheres = {rank: errors.split_stacks(stacks.get(rank, ""))[0] for rank in silent}
        failures = self.launched.collector.silent_failures(silent, wheres, self.spec.num_processes)
        raise errors.TrainingStalledError(failures, limit, silent, stacks)

    def drain(self) -> None:
        """Read what the ranks still send until every rank has hung up; when that does not
        happen in time, say so (in the log and in a script's value) instead of losing it."""
        collector = self.launched.collector
        num_processes = self.spec.num_processes
        if self.launched.server.drain(
            lambda: collector.status().ranks_done(num_processes), DRAIN_S
        ):
            return
        if collector.mark_incomplete(
            f"not every rank had hung up {DRAIN_S:g} s after the run ended; output sent "
            "later was not read"
        ):
            self.log.warning(
                "sparktorch_ops: %s: not every rank hung up within %g s of finishing (a "
                "process a rank started may still hold its connection); output, metrics or "
                "the result sent after that are lost",
                self.run_id,
                DRAIN_S,
            )

    def _cluster_cause(self) -> tuple[int, str]:
        """Something of the run was lost, or its job failed: the cluster's own error for the
        job may say why (a task that raised, a full disk, a lost executor), or that the job
        was killed (raised). Wait briefly for it; log it and make it the failure's reason."""
        launcher = self.launched.launcher
        status = launcher.status(lost=True)
        deadline = time.monotonic() + SPARK_CAUSE_S
        while status.cause_pending and time.monotonic() < deadline:
            self.check_cancelled()
            time.sleep(POLL_S)
            status = launcher.status()
        if status.error is not None:
            raise status.error
        if status.cause is None:
            return 1, ""
        self.log.warning(
            "sparktorch_ops: %s: the Spark job failed: %s", self.run_id, status.cause_detail
        )
        if self.launched.collector.explain_lost_nodes(status.cause):
            return 1, ""  # the lost task's failure says it: once is enough
        return status.exit if status.exit is not None else (1, "")
