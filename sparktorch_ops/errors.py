"""The error hierarchy.

Every error raised by sparktorch_ops derives from :class:`SparkTorchError`. All of them survive
pickling (they cross Spark task and process boundaries), which is why each class with its own
``__init__`` also defines ``__reduce__``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparktorch_ops.results import RankFailure


class SparkTorchError(Exception):
    """Base class of every error sparktorch_ops raises."""


class ConfigError(SparkTorchError, ValueError):
    """A bad argument or setting, found before anything was launched.

    Attributes:
        argument: the name of the offending argument or setting.
    """

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


class TrainingFailedError(SparkTorchError):
    """One or more ranks failed.

    Attributes:
        failures: every failed rank, the root cause first.
    """

    def __init__(self, failures: Sequence[RankFailure], note: str = "") -> None:
        self.failures = list(failures)
        self.note = note
        super().__init__(self._describe())

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
        return "\n".join(lines)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.failures, self.note))


class _TimeoutBase(SparkTorchError, TimeoutError):
    def __init__(self, setting: str, seconds: float, detail: str = "") -> None:
        self.setting = setting
        self.seconds = seconds
        self.detail = detail
        text = f"{self._what} after {seconds:g} s ({setting}={seconds:g})"
        if detail:
            text += f": {detail}"
        text += f"; raise {setting} if the run needs longer"
        super().__init__(text)

    _what = "timed out"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.setting, self.seconds, self.detail))


class StartTimeoutError(_TimeoutBase):
    """Slots, executors or the rendezvous were not ready within ``start_timeout``."""

    _what = "the run did not start"


class TrainingTimeoutError(_TimeoutBase):
    """The run exceeded ``timeout`` and was torn down."""

    _what = "the run was stopped"


class TrainingCancelledError(SparkTorchError):
    """The run was cancelled (``cancel()``, a signal, or the orchestrator) and torn down."""

    def __init__(self, reason: str = "cancelled") -> None:
        super().__init__(f"training cancelled: {reason}")
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.reason,))


class SparkJobKilledError(TrainingCancelledError):
    """The run's Spark job was cancelled from outside the run: the kill link of the Spark UI,
    ``SparkContext.cancelJobGroup`` / ``cancelAllJobs`` / ``cancelJob``. Not retryable: someone
    stopped it on purpose.
    """
