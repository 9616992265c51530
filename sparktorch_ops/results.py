"""What a run hands back: :class:`RunResult`, its metric records and per-rank failures."""

from __future__ import annotations

import dataclasses
import math
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a driver-side type: the ranks import this module without pendulum
    import pendulum

# The start of the line a rank's supervisor sends when it stopped forwarding a stream before
# its end (a process the rank started still held the pipe open); the driver marks the run's
# output as cut when rank 0's stdout carries it.
OUTPUT_CUT_NOTE = "[sparktorch_ops: output cut"


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

    @property
    def who(self) -> str:
        """``"rank 3"``, or ``"the launch"`` for what failed outside any rank (a lost barrier
        task, a refused stage retry)."""
        return f"rank {self.rank}" if self.rank >= 0 else "the launch"

    def describe(self) -> str:
        """A short description: host, exit code or signal, reason."""
        parts = [f"host {self.host}"] if self.host else []
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
        replayed: reported by an earlier try and replayed from the checkpoint this try
            resumed from (MLflow gets it only where the run lacks it).
    """

    rank: int
    step: int
    time: float
    values: dict[str, Any]
    progress: float | None = None
    replayed: bool = False

    def describe(self) -> str:
        """One log line: ``step 2 progress 100% loss=0.333``."""
        values = " ".join(f"{k}={v}" for k, v in self.values.items())
        progress = f" progress {100 * self.progress:.0f}%" if self.progress is not None else ""
        return f"step {self.step}{progress} {values}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of the record."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "replayed"}


@dataclass(frozen=True)
class Attempt:
    """One attempt of a run: one launch of every rank (a barrier stage in barrier mode).

    A run makes a new attempt, within the same call, after one that an infrastructure failure
    ended (``max_failures``); each resumes from the latest checkpoint.

    Attributes:
        number: 1 for the first.
        num_processes: the ranks it ran with (fewer than asked when the cluster had lost
            slots, down to ``min_processes``).
        started_at: when it started (seconds since the epoch).
        seconds: how long it took.
        resumed_from: the checkpoint step its ranks found to resume from (None: none).
        cause: why it ended, when it failed (None: it succeeded).
        host: where that happened, when known.
    """

    number: int
    num_processes: int
    started_at: float
    seconds: float
    resumed_from: int | None = None
    cause: str | None = None
    host: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of the attempt."""
        return {**dataclasses.asdict(self), "seconds": round(self.seconds, 3)}

    def describe(self) -> str:
        """``attempt 1 (2 ranks, 12.3 s): <cause>`` (``succeeded`` when it did)."""
        return (
            f"attempt {self.number} ({self.num_processes} ranks, {self.seconds:.1f} s): "
            f"{self.cause or 'succeeded'}"
        )


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
        output_truncated: whether ``value`` (a script's stdout) is not all of it: cut to its
            tail, or incomplete (then the value says so in a note).
        metrics_dropped: how many of the oldest ``report()`` records were dropped to keep
            ``metrics`` within its bound (``driver/collector/metrics.MAX_METRIC_RECORDS``);
            ``on_metrics`` saw them all.
        input: with DataFrame input: ``rows``, ``columns`` and ``source`` (what was read).
        checkpoint: with ``checkpoint_dir``: ``dir``, ``resumed_from_step`` (the step the run
            resumed from, None when it started fresh), ``warm_start_from`` (when it applied)
            and ``latest_step`` (the latest complete checkpoint when the run ended).
        mlflow_run_id: the MLflow run that tracked it (with ``mlflow_experiment``).
        mlflow_run_url: that run's page in the MLflow UI (an MLflow server's tracking URI).
        training_id: the durable training this run is a try of (an orchestrator's retries of
            one task share it; None outside one).
        attempts: every attempt of the run, the last the one that succeeded (one, unless
            ``max_failures`` let a failed attempt be followed by another).
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
    metrics_dropped: int = 0
    input: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None
    mlflow_run_id: str | None = None
    mlflow_run_url: str | None = None
    training_id: str | None = None
    attempts: tuple[Attempt, ...] = ()

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
        return latest_values(self.metrics, rank)

    def summary(self) -> dict[str, Any]:
        """A JSON-safe summary of the run (no value): what the wrappers publish.

        Keys: ``metrics`` (rank 0's latest values), ``progress``, ``duration_s``,
        ``num_processes``, ``mode``, ``app_id``, ``ui_url``, ``run_id``, ``exit_codes`` (by
        rank, as strings), ``started_at``, ``finished_at`` (ISO 8601), and
        ``output_truncated`` when a script's output was cut, ``metrics_dropped`` when old
        metric records were dropped, ``input`` (rows, columns, source) with DataFrame input,
        ``training_id`` for a try of a durable training, ``attempts`` (each attempt's ranks,
        seconds, resumed-from step and cause) when there was more than one.
        """
        summary: dict[str, Any] = {
            "metrics": {k: json_scalar(v) for k, v in self.final_metrics(0).items()},
            "progress": self.progress,
            "duration_s": round(self.duration.total_seconds(), 3),
            "num_processes": self.num_processes,
            "mode": self.mode,
            "app_id": self.app_id,
            "ui_url": self.ui_url,
            "run_id": self.run_id,
            "exit_codes": {str(rank): code for rank, code in sorted(self.exit_codes.items())},
            "started_at": self.started_at.isoformat(),
            "finished_at": self.finished_at.isoformat(),
        }
        if self.output_truncated:
            summary["output_truncated"] = True
        if self.metrics_dropped:
            summary["metrics_dropped"] = self.metrics_dropped
        if self.input is not None:
            summary["input"] = dict(self.input)
        if self.checkpoint is not None:
            summary["checkpoint"] = dict(self.checkpoint)
        if self.mlflow_run_id is not None:
            summary["mlflow_run_id"] = self.mlflow_run_id
            summary["mlflow_run_url"] = self.mlflow_run_url
        if self.training_id is not None:
            summary["training_id"] = self.training_id
        if len(self.attempts) > 1:
            summary["attempts"] = [attempt.to_dict() for attempt in self.attempts]
        return summary


def latest_values(records: Iterable[MetricRecord], rank: int = 0) -> dict[str, Any]:
    """The latest value of every metric key that ``rank`` reported in ``records``."""
    merged: dict[str, Any] = {}
    for record in records:
        if record.rank == rank:
            merged.update(record.values)
    return merged


def json_scalar(value: Any) -> Any:
    """A metric value as JSON: non-finite floats become strings (``"nan"``), others as they are."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
