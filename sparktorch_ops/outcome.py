"""What an error means for whoever called the run: retry or not, what to say, which rank.

One mapping, shared by the Airflow operator (fail vs retryable failure), the Prefect task
(summary status, retry condition) and the CLI (exit status), so the three never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparktorch_ops import errors

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
_TAIL_LINES = 40


@dataclass(frozen=True)
class Outcome:
    """How a run ended, as an orchestrator needs to know it.

    Attributes:
        status: ``succeeded``, ``bad_input``, ``failed``, ``timed_out``, ``cancelled`` or
            ``error`` (an unexpected exception, not one of ours).
        retryable: whether running the job again may succeed (bad input never does; nor is
            a Spark job killed from the Spark UI rerun behind its killer's back).
        message: one paragraph for a task log or a UI (the error's own text).
        rank: the rank that failed first, for a training failure.
        host: that rank's host.
        tail: the last lines of that rank's output, traceback included.
        exit_status: the CLI's exit status (0, 2, the rank's exit code or 1, 124, 130).
    """

    status: str
    retryable: bool
    message: str
    rank: int | None = None
    host: str | None = None
    tail: str = ""
    exit_status: int = EXIT_OK

    @property
    def headline(self) -> str:
        """The message's first line."""
        lines = self.message.strip().splitlines()
        return lines[0] if lines else self.status


def outcome_of(error: BaseException | None) -> Outcome:
    """Map what a run raised (None: it succeeded) to an :class:`Outcome`."""
    if error is None:
        return Outcome("succeeded", False, "training succeeded")
    message = str(error) or type(error).__name__
    if isinstance(error, errors.ConfigError):
        return Outcome("bad_input", False, f"bad input: {message}", exit_status=EXIT_CONFIG)
    if isinstance(error, errors.TrainingFailedError):
        first = error.first_failure
        code = first.exit_code if first is not None and first.exit_code else EXIT_FAILED
        tail = "\n".join((first.output_tail if first else "").splitlines()[-_TAIL_LINES:])
        return Outcome(
            "failed",
            True,
            f"training failed: {message}",
            rank=first.rank if first is not None else None,
            host=first.host if first is not None else None,
            tail=tail,
            exit_status=code,
        )
    if isinstance(error, (errors.StartTimeoutError, errors.TrainingTimeoutError)):
        return Outcome("timed_out", True, message, exit_status=EXIT_TIMEOUT)
    if isinstance(error, errors.SparkJobKilledError):
        # Someone killed the Spark job on purpose (the Spark UI): a retry would undo that.
        return Outcome("cancelled", False, message, exit_status=EXIT_INTERRUPTED)
    if isinstance(error, errors.TrainingCancelledError):
        # The orchestrator stopped the task (on_kill, a worker shutting down): its call.
        return Outcome("cancelled", True, message, exit_status=EXIT_INTERRUPTED)
    if isinstance(error, errors.ResultTooLargeError):  # the same run returns the same value
        return Outcome("failed", False, message, exit_status=EXIT_FAILED)
    if isinstance(error, errors.SparkTorchError):
        return Outcome(
            "failed", True, f"{type(error).__name__}: {message}", exit_status=EXIT_FAILED
        )
    if isinstance(error, TimeoutError):
        return Outcome(
            "timed_out", True, f"{type(error).__name__}: {message}", exit_status=EXIT_TIMEOUT
        )
    if isinstance(error, (KeyboardInterrupt, SystemExit)) or not isinstance(error, Exception):
        return Outcome(
            "cancelled", True, f"{type(error).__name__}: {message}", exit_status=EXIT_INTERRUPTED
        )
    return Outcome("error", True, f"{type(error).__name__}: {message}", exit_status=EXIT_FAILED)
