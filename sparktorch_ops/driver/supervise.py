"""The third part of a run: watch the launched ranks until the run ends one way or another.

:class:`Supervisor` polls the launcher (behind its protocol: it never asks which kind it holds)
and the collector for the run's limits (``timeout``, ``start_timeout``, ``stall_timeout``), a
refused result, a fatal rank failure (with Spark's own error for a lost barrier task) and the
ranks' exit. A stop that is not the ranks' own end (a stall, a limit, a cancel) takes every
rank's stacks first, so the error says where training was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sparktorch_ops import errors
from sparktorch_ops.driver.launch import Launched
from sparktorch_ops.driver.stacks import capture_stacks
from sparktorch_ops.results import RankFailure
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
        """Every rank's stacks now, by rank (see :func:`capture_stacks`); safe from any thread."""
        launched = self.launched
        return capture_stacks(launched.server, launched.collector, self.spec.num_processes, log=log)

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
        spec = self.spec
        launcher, collector = self.launched.launcher, self.launched.collector
        released = False
        start_deadline = spec.start_timeout
        if start_deadline is None:
            start_deadline = launcher.default_start_timeout
        while True:
            self.check_cancelled()
            now = time.monotonic()
            elapsed = now - self.started
            if spec.timeout is not None and elapsed > spec.timeout:
                raise errors.TrainingTimeoutError("timeout", spec.timeout)
            connected = collector.ranks.started()
            if (
                connected < spec.num_processes
                and start_deadline is not None
                and now - (self.attempt_started or self.started) > start_deadline
                and not launcher.stage_started
            ):
                raise errors.StartTimeoutError(
                    "start_timeout",
                    start_deadline,
                    f"only {connected} of {spec.num_processes} ranks started"
                    + launcher.start_timeout_hint,
                )
            if spec.stall_timeout is not None:
                self._check_stall(spec.stall_timeout)
            if collector.result.refused is not None:
                raise collector.result.refused  # stop rank 0 sending the rest
            if collector.unusable is not None:
                raise unusable_python(collector.unusable)
            if collector.ranks.fatal:
                # The failed rank reports its exit a moment after its failure: wait for that
                # (briefly) so the error has the exit code before the others are torn down.
                deadline = time.monotonic() + EXIT_REPORT_S
                while not collector.ranks.failed_ranks_reported() and time.monotonic() < deadline:
                    time.sleep(POLL_S / 5)
                if launcher.explains_losses and collector.ranks.lost_something():
                    return self._spark_cause()
                return 1, ""
            if (
                launcher.needs_release
                and not released
                and collector.nodes_done(self.launched.plan.layout.num_tasks)
            ):
                # Every agent is done with the rendezvous store; the supervisors' last frames
                # are read before the release closes the channel.
                self.drain()
                launcher.release_rendezvous()
                released = True
            status = launcher.poll()  # raises SparkJobKilledError for a kill from the Spark UI
            if status is not None:
                if launcher.spark_error is not None:
                    return self._spark_cause()
                return status
            time.sleep(POLL_S)

    def _check_stall(self, limit: float) -> None:
        """Raise TrainingStalledError once every running rank has been silent for ``limit``."""
        silent = self.launched.collector.ranks.silences()
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
        collector = self.launched.collector
        failures = []
        for rank in sorted(silent, key=lambda rank: -silent[rank]):
            where = errors.split_stacks(stacks.get(rank, ""))[0]
            state = collector.ranks.states[rank]
            failures.append(
                RankFailure(
                    rank=rank,
                    host=state.host,
                    exit_code=None,
                    signal=None,
                    reason=f"silent for {silent[rank]:.1f} s, {where}",
                    output_tail="\n".join(list(state.tail)[-20:]),
                    timestamp=time.time() - silent[rank],
                )
            )
        for rank in range(self.spec.num_processes):
            known = collector.ranks.states.get(rank)
            if rank not in silent and (known is None or not known.exited):
                failures.append(
                    RankFailure(rank, "", None, None, "never connected", "", time.time())
                )
        raise errors.TrainingStalledError(failures, limit, silent, stacks)

    def drain(self) -> None:
        """Read what the ranks still send until every rank has hung up; when that does not
        happen in time, say so (in the log and in a script's value) instead of losing it."""
        collector = self.launched.collector
        num_processes = self.spec.num_processes
        if self.launched.server.drain(lambda: collector.supervisors_done(num_processes), DRAIN_S):
            return
        if collector.stdout.incomplete is None:
            self.log.warning(
                "sparktorch_ops: %s: not every rank hung up within %g s of finishing (a process "
                "a rank started may still hold its connection); output, metrics or the result "
                "sent after that are lost",
                self.run_id,
                DRAIN_S,
            )
        collector.stdout.mark_incomplete(
            f"not every rank had hung up {DRAIN_S:g} s after the run ended; output sent "
            "later was not read"
        )

    def _spark_cause(self) -> tuple[int, str]:
        """A barrier task was lost: Spark's own error for the job says why (a task that raised,
        a full disk), or that the job was killed (raises SparkJobKilledError). Wait briefly for
        it; log it and make it the failure's reason."""
        launcher, collector = self.launched.launcher, self.launched.collector
        launcher.look_for_cause()
        deadline = time.monotonic() + SPARK_CAUSE_S
        while launcher.poll() is None and time.monotonic() < deadline:
            self.check_cancelled()
            time.sleep(POLL_S)
        status = launcher.poll()
        if launcher.spark_error is None:
            return 1, ""
        self.log.warning(
            "sparktorch_ops: %s: the Spark job failed: %s",
            self.run_id,
            launcher.spark_error_detail,
        )
        if collector.ranks.explain_lost_nodes(launcher.spark_error):
            return 1, ""  # the lost task's failure says it: once is enough
        return status if status is not None else (1, "")
