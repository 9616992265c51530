"""What a run hands back: :class:`RunResult`, its metric records and per-rank failures."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

import pendulum


@dataclass(frozen=True)
class RankFailure:
    """How one rank failed.

    Attributes:
        rank: global rank (``RANK``).
        host: host the rank ran on.
        exit_code: the process's exit code, or ``None`` when it died by a signal or was lost.
        signal: the signal that ended it (``"SIGKILL"``), if any.
        reason: one line: what happened (exception type and message, exit, lost connection).
        output_tail: the last lines of the rank's output (stdout and stderr), traceback included.
        timestamp: when the failure was seen (seconds since the epoch); orders root cause first.
    """

    rank: int
    host: str
    exit_code: int | None
    signal: str | None
    reason: str
    output_tail: str
    timestamp: float

    def describe(self) -> str:
        """A short description: host, exit code or signal, reason."""
        parts = [f"host {self.host}"]
        if self.signal:
            parts.append(f"signal {self.signal}")
        elif self.exit_code is not None:
            parts.append(f"exit code {self.exit_code}")
        if self.reason:
            parts.append(self.reason)
        return ", ".join(parts)


def signal_name(signum: int) -> str:
    """``9`` -> ``"SIGKILL"``; unknown numbers become ``"signal 99"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass(frozen=True)
class MetricRecord:
    """One ``sparktorch_ops.report(...)`` call.

    Attributes:
        rank: the reporting rank.
        step: the explicit step, or the per-rank count of reports (from 0).
        time: when the rank reported it (seconds since the epoch).
        values: the reported values (JSON-safe scalars).
        progress: the reported progress in [0, 1], if given.
    """

    rank: int
    step: int
    time: float
    values: dict[str, Any]
    progress: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of the record."""
        return {
            "rank": self.rank,
            "step": self.step,
            "time": self.time,
            "values": dict(self.values),
            "progress": self.progress,
        }


@dataclass(frozen=True)
class RunResult:
    """The outcome of a successful :meth:`TorchDistributor.launch`.

    Attributes:
        value: rank 0's return value (functions) or rank 0's stdout (scripts).
        exit_codes: exit code per rank.
        outputs: the tail of each rank's output (stdout and stderr interleaved).
        metrics: every ``report()`` record of every rank, in arrival order.
        started_at: when the launch started.
        finished_at: when the run finished.
        mode: ``"local"`` or ``"barrier"``.
        num_processes: the number of ranks.
        app_id: the Spark application id, when Spark was used.
        ui_url: the Spark UI (History Server when configured, else the live UI).
        output_truncated: whether ``value`` (a script's stdout) was cut to its tail.
    """

    value: Any
    exit_codes: dict[int, int]
    outputs: dict[int, str]
    metrics: list[MetricRecord]
    started_at: pendulum.DateTime
    finished_at: pendulum.DateTime
    mode: str
    num_processes: int
    app_id: str | None = None
    ui_url: str | None = None
    output_truncated: bool = False
    run_id: str = field(default="")

    @property
    def duration(self) -> pendulum.Duration:
        """Wall time from launch to finish."""
        return self.finished_at - self.started_at

    @property
    def progress(self) -> float | None:
        """Rank 0's latest reported progress, if it reported any."""
        for record in reversed(self.metrics):
            if record.rank == 0 and record.progress is not None:
                return record.progress
        return None

    def final_metrics(self, rank: int = 0) -> dict[str, Any]:
        """The latest value of every metric key reported by ``rank``."""
        merged: dict[str, Any] = {}
        for record in self.metrics:
            if record.rank == rank:
                merged.update(record.values)
        return merged
