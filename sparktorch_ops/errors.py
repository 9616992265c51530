"""The error hierarchy, and what an error means for whoever called the run.

Every error raised by sparktorch_ops derives from :class:`SparkTorchError`. All of them survive
pickling (they cross Spark task and process boundaries), which is why each class with its own
``__init__`` also defines ``__reduce__``. Each class says how a run that raised it ended for an
orchestrator (its ``status``, ``retryable``, ``exit_status``); :func:`outcome_of` reads that
for any exception, one mapping shared by the Airflow operator (fail vs retryable failure), the
Prefect task (summary status, retry condition), the CLI (exit status) and the run's final
state, so they never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from sparktorch_ops.events import RunState

if TYPE_CHECKING:
    from sparktorch_ops.results import RankFailure

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
_TAIL_LINES = 40


class SparkTorchError(Exception):
    """Base class of every error sparktorch_ops raises.

    Attributes:
        status: how a run that raised it ended (:attr:`Outcome.status`).
        retryable: whether running the job again may succeed.
        exit_status: the CLI's exit status.
        said_as: what an orchestrator's message starts with (None: the class's name).
    """

    status: ClassVar[str] = "failed"
    retryable: ClassVar[bool] = True
    exit_status: ClassVar[int] = EXIT_FAILED
    said_as: ClassVar[str | None] = None


def split_stacks(text: str) -> tuple[str, str]:
    """A rank's stacks text as (where its training thread was: the first line, the threads)."""
    where, _, threads = text.partition("\n")
    return where, threads


def where_ranks_were(stacks: Mapping[int, str]) -> str:
    """One line per rank: where its training thread was (the first line of its stacks)."""
    return "\n".join(
        f"  rank {rank} {split_stacks(text)[0]}" for rank, text in sorted(stacks.items())
    )


def _with_where(text: str, stacks: Mapping[int, str]) -> str:
    if not stacks:
        return text
    return f"{text}\nwhere the ranks were when it was stopped:\n{where_ranks_were(stacks)}"


class ConfigError(SparkTorchError, ValueError):
    """A bad argument or setting, found before anything was launched (never retryable).

    Attributes:
        argument: the name of the offending argument or setting.
    """

    status = "bad_input"
    retryable = False
    exit_status = EXIT_CONFIG
    said_as = "bad input"

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.argument, self.message))


class ResourceError(ConfigError):
    """Not enough task slots or GPUs for the requested launch."""


class ChannelError(SparkTorchError):
    """The rank -> driver channel lost something the run needs (for example rank 0's result)."""


class ResultTooLargeError(ChannelError):
    """Rank 0's pickled return value passed ``max_result_bytes``; the driver stopped reading it.

    Not retryable: the same run returns the same value. Return less (save large objects to
    storage and return their path) or raise the limit.

    Attributes:
        size: the value's size in bytes, or the bytes that had arrived when the driver refused
            it (then ``exact`` is False and the value is larger still).
        limit: the limit in force.
        setting: the option that sets it (``max_result_bytes``).
        exact: whether ``size`` is the value's whole size.
    """

    retryable = False
    said_as = ""

    def __init__(
        self, size: int, limit: int, setting: str = "max_result_bytes", exact: bool = False
    ) -> None:
        self.size = size
        self.limit = limit
        self.setting = setting
        self.exact = exact
        amount = f"{size:,} bytes" if exact else f"more than {size:,} bytes"
        super().__init__(
            f"rank 0's return value is {amount} pickled, over the limit {setting}={limit:,}; "
            f"the driver stopped reading it. Return less (save large objects to storage and "
            f"return their path) or raise {setting}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.size, self.limit, self.setting, self.exact))


class CheckpointError(SparkTorchError):
    """A checkpoint written in the background (``save(..., blocking=False)``) failed.

    Raised on the rank by the next ``save``, ``checkpoint.wait()``, ``load_latest`` or the end
    of the training function, so the run fails with it.

    Attributes:
        rank: the rank whose save failed.
        step: the step being saved.
        directory: the step directory (path or URL) being written.
        cause: the original error, as text.
    """

    def __init__(self, rank: int, step: int, directory: str, cause: str) -> None:
        self.rank = rank
        self.step = step
        self.directory = directory
        self.cause = cause
        super().__init__(
            f"rank {rank}: the background save of step {step} to {directory} failed: {cause}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.step, self.directory, self.cause))


class TrainingFailedError(SparkTorchError):
    """One or more ranks failed (the CLI exits with the first one's exit code).

    Attributes:
        failures: every failed rank of the last attempt, the root cause first.
        attempts: every attempt of the run (``max_failures``), the failed last one included;
            empty when the run failed before its first attempt started.
    """

    said_as = "training failed"

    def __init__(
        self, failures: Sequence[RankFailure], note: str = "", attempts: Sequence[Any] = ()
    ) -> None:
        self.failures = list(failures)
        self.note = note
        self.attempts = list(attempts)
        super().__init__(self._describe())

    def with_attempts(self, attempts: Sequence[Any]) -> TrainingFailedError:
        """This error, now saying every attempt of the run (its message lists their causes)."""
        self.attempts = list(attempts)
        self.args = (self._describe(),)
        return self

    @property
    def first_failure(self) -> RankFailure | None:
        """The rank that failed first: the root cause."""
        return self.failures[0] if self.failures else None

    @property
    def collateral(self) -> list[RankFailure]:
        """Ranks that failed after the first one (usually torn down because of it)."""
        return self.failures[1:]

    def _describe(self) -> str:
        first = self.first_failure
        if first is None:
            return self.note or "training failed"
        lines = [f"{first.who} failed first ({first.describe()})"]
        if self.note:
            lines.append(self.note)
        if first.output_tail:
            lines.append(f"--- last output of {first.who} ---")
            lines.append(first.output_tail.rstrip("\n"))
            lines.append("---")
        if self.collateral:
            others = ", ".join(f"{f.who} ({f.describe()})" for f in self.collateral)
            lines.append(f"collateral: {others}")
        lines.extend(self._attempt_lines())
        return "\n".join(lines)

    def _attempt_lines(self) -> list[str]:
        if len(self.attempts) < 2:
            return []
        return [
            f"the run made {len(self.attempts)} attempts:",
            *(f"  {attempt.describe()}" for attempt in self.attempts),
        ]

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.failures, self.note, self.attempts))


class TrainingStalledError(TrainingFailedError):
    """No rank showed progress (a ``report()`` or a line of output) for ``stall_timeout``
    seconds: the run was torn down after every rank's Python stacks were taken.

    Attributes:
        stall_timeout: the limit in force.
        silent_for: how long each connected rank had been silent, by rank.
        stacks: every rank's stacks, by rank: where its training thread was on the first line,
            then every thread's stack (or one line: why the rank gave none).
        failures: the silent ranks, the one silent longest first.
    """

    def __init__(
        self,
        failures: Sequence[RankFailure],
        stall_timeout: float,
        silent_for: Mapping[int, float],
        stacks: Mapping[int, str],
        attempts: Sequence[Any] = (),
    ) -> None:
        self.stall_timeout = stall_timeout
        self.silent_for = dict(silent_for)
        self.stacks = dict(stacks)
        super().__init__(failures, attempts=attempts)

    _STACK_LINES = 40  # per rank in the message; ``stacks`` has them all

    def _describe(self) -> str:
        quiet = min(self.silent_for.values(), default=self.stall_timeout)
        lines = [
            f"training stalled: no rank showed progress (a report() or a line of output) for "
            f"{quiet:.1f} s (stall_timeout={self.stall_timeout:g}); where each rank was:"
        ]
        lines.extend(f"  {failure.who} {failure.reason}" for failure in self.failures)
        for rank, text in sorted(self.stacks.items()):
            stack = split_stacks(text)[1]
            if stack.strip():
                lines.append(f"--- stacks of rank {rank} ---")
                lines.extend(stack.rstrip("\n").splitlines()[-self._STACK_LINES :])
        lines.append(
            "Raise stall_timeout if a step may legitimately run that long without a report()."
        )
        lines.extend(self._attempt_lines())
        return "\n".join(lines)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.failures, self.stall_timeout, self.silent_for, self.stacks, self.attempts),
        )


class _TimeoutBase(SparkTorchError, TimeoutError):
    status = "timed_out"
    exit_status = EXIT_TIMEOUT
    said_as = ""

    def __init__(
        self,
        setting: str,
        seconds: float,
        detail: str = "",
        stacks: Mapping[int, str] | None = None,
    ) -> None:
        self.setting = setting
        self.seconds = seconds
        self.detail = detail
        self.stacks = dict(stacks or {})
        text = f"{self._what} after {seconds:g} s ({setting}={seconds:g})"
        if detail:
            text += f": {detail}"
        text += f"; raise {setting} if the run needs longer"
        super().__init__(_with_where(text, self.stacks))

    _what = "timed out"

    def with_stacks(self, stacks: Mapping[int, str]) -> _TimeoutBase:
        """The same error, saying where each rank was (``stacks`` by rank)."""
        return type(self)(self.setting, self.seconds, self.detail, stacks)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.setting, self.seconds, self.detail, self.stacks))


class StartTimeoutError(_TimeoutBase):
    """Slots, executors or the rendezvous were not ready within ``start_timeout``."""

    _what = "the run did not start"


class TrainingTimeoutError(_TimeoutBase):
    """The run exceeded ``timeout`` and was torn down."""

    _what = "the run was stopped"


class TrainingCancelledError(SparkTorchError):
    """The run was cancelled (``cancel()``, a signal, or the orchestrator) and torn down.

    Retryable: the orchestrator stopped the task (on_kill, a worker shutting down), its call.

    Attributes:
        reason: who or what cancelled it.
        stacks: where each rank was when it was stopped, by rank (see
            :class:`TrainingStalledError`); empty when no rank was running.
    """

    status = "cancelled"
    exit_status = EXIT_INTERRUPTED
    said_as = ""

    def __init__(self, reason: str = "cancelled", stacks: Mapping[int, str] | None = None) -> None:
        self.reason = reason
        self.stacks = dict(stacks or {})
        super().__init__(_with_where(f"training cancelled: {reason}", self.stacks))

    def with_stacks(self, stacks: Mapping[int, str]) -> TrainingCancelledError:
        """The same error, saying where each rank was (``stacks`` by rank)."""
        return type(self)(self.reason, stacks)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.reason, self.stacks))


class SparkJobKilledError(TrainingCancelledError):
    """The run's Spark job was cancelled from outside the run: the kill link of the Spark UI,
    ``SparkContext.cancelJobGroup`` / ``cancelAllJobs`` / ``cancelJob``. Not retryable: someone
    stopped it on purpose.
    """

    retryable = False  # a retry would undo what its killer did


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

    @property
    def state(self) -> RunState:
        """The final state of the run (bad input and unexpected errors are failures)."""
        final = {state.value: state for state in RunState if state.final}
        return final.get(self.status, RunState.FAILED)


def outcome_of(error: BaseException | None) -> Outcome:
    """Map what a run raised (None: it succeeded) to an :class:`Outcome`."""
    if error is None:
        return Outcome("succeeded", False, "training succeeded")
    message = str(error) or type(error).__name__
    if isinstance(error, SparkTorchError):
        said_as = type(error).__name__ if error.said_as is None else error.said_as
        if said_as:
            message = f"{said_as}: {message}"
        first = error.first_failure if isinstance(error, TrainingFailedError) else None
        if first is None:
            return Outcome(error.status, error.retryable, message, exit_status=error.exit_status)
        return Outcome(
            error.status,
            error.retryable,
            message,
            rank=first.rank,
            host=first.host,
            tail="\n".join(first.output_tail.splitlines()[-_TAIL_LINES:]),
            exit_status=first.exit_code or error.exit_status,
        )
    message = f"{type(error).__name__}: {message}"
    if isinstance(error, TimeoutError):
        return Outcome("timed_out", True, message, exit_status=EXIT_TIMEOUT)
    if isinstance(error, (KeyboardInterrupt, SystemExit)) or not isinstance(error, Exception):
        return Outcome("cancelled", True, message, exit_status=EXIT_INTERRUPTED)
    return Outcome("error", True, message, exit_status=EXIT_FAILED)
