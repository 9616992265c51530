"""The Prefect artifacts of a training run: live progress, a metrics table, a summary, a link.

Keys are derived from the task's name (``train-digits-progress``, ``...-metrics``,
``...-summary``, ``...-spark-ui``) or from ``artifact_key``; Prefect accepts lowercase letters,
numbers and dashes only, so a bad key fails before anything starts.

Progress comes from rank 0's ``report(progress=...)``. The core calls ``on_metrics`` on its
channel thread; that thread only records the value, and a publisher thread (with a copy of the
task's context, which Prefect's artifact functions need) sends it at most once per interval, so
a slow API never holds up the ranks' log lines.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from sparktorch_ops.errors import ConfigError, outcome_of
from sparktorch_ops.events import SESSION_READY
from sparktorch_ops.results import MetricRecord, RunResult, latest_values

Logger = logging.Logger | logging.LoggerAdapter[Any]

KEY_PATTERN = re.compile(r"^[a-z0-9-]+$")
SUFFIXES = ("progress", "metrics", "summary", "spark-ui", "mlflow")
MAX_TABLE_ROWS = 1000
_ERROR_LINES = 40
_FIXED = ("step", "rank", "progress")


def check_artifact_key(artifact_key: object) -> str:
    """Validate a user-given key prefix.

    Raises:
        ConfigError: naming ``artifact_key``, unless it is lowercase letters, digits, dashes.
    """
    if not isinstance(artifact_key, str) or not KEY_PATTERN.match(artifact_key):
        raise ConfigError(
            "artifact_key",
            f"{artifact_key!r} is not a valid Prefect artifact key: use lowercase letters, "
            "numbers and dashes only (e.g. 'train-digits')",
        )
    return artifact_key


def key_from_name(name: str) -> str:
    """A valid key prefix from a task name: ``"Train Digits_v2"`` -> ``"train-digits-v2"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "torch-distributor"


def artifact_keys(prefix: str) -> dict[str, str]:
    """The key of each artifact: ``{"progress": "<prefix>-progress", ...}``."""
    return {suffix: f"{prefix}-{suffix}" for suffix in SUFFIXES}


def metrics_table(
    records: Sequence[MetricRecord], max_rows: int = MAX_TABLE_ROWS
) -> list[dict[str, Any]]:
    """One row per reported step and rank: step, rank, progress and every reported value.

    Every row has the same columns (missing values are None) so the table renders evenly; only
    the last ``max_rows`` records are kept.
    """
    kept = list(records)[-max_rows:]
    names = [n for n in dict.fromkeys(n for r in kept for n in r.values) if n not in _FIXED]
    return [
        {"step": r.step, "rank": r.rank, "progress": r.progress}
        | {name: r.values.get(name) for name in names}
        for r in sorted(kept, key=lambda r: (r.step, r.rank))
    ]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.6g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _duration(seconds: float) -> str:
    minutes, rest = divmod(seconds, 60)
    if minutes >= 60:
        return f"{int(minutes // 60)} h {int(minutes % 60)} min {rest:.0f} s"
    return f"{int(minutes)} min {rest:.1f} s" if minutes else f"{rest:.1f} s"


@dataclass
class RunSummary:
    """What the summary artifact says about one run.

    Attributes:
        title: heading (the task run's name).
        status: ``completed``, ``failed``, ``timed out`` or ``cancelled``.
        num_processes: ranks.
        mode: ``local`` or ``barrier``.
        use_gpu: whether ranks had GPUs.
        duration_s: wall time of the launch.
        final_metrics: rank 0's latest value of each metric.
        result: where rank 0's value went (one line).
        run_id: the core's run id (the marker of every process of the run).
        app_id: the Spark application, in barrier mode.
        ui_url: the Spark UI link, if any.
        error: the error's message, for a run that did not complete.
        input: the DataFrame input's ``rows``, ``columns`` and ``source``, if any.
        checkpoint: ``RunResult.checkpoint``: the directory, the step resumed from, if any.
        mlflow_run_id, mlflow_run_url: the MLflow run that tracked it, and its page.
        attempts: each attempt in a line, when there was more than one (``max_failures``).
    """

    title: str
    status: str
    num_processes: int
    mode: str
    use_gpu: bool
    duration_s: float
    final_metrics: Mapping[str, Any] = field(default_factory=dict)
    result: str = ""
    run_id: str = ""
    app_id: str | None = None
    ui_url: str | None = None
    error: str | None = None
    input: Mapping[str, Any] | None = None
    checkpoint: Mapping[str, Any] | None = None
    mlflow_run_id: str | None = None
    mlflow_run_url: str | None = None
    attempts: list[str] = field(default_factory=list)

    def complete(self, result: RunResult, where: str) -> None:
        """Fill in a completed run: its duration, metrics, result line, ids and link."""
        self.status = "completed"
        self.duration_s = result.duration.total_seconds()
        self.final_metrics = result.final_metrics(0)
        self.result = where
        self.run_id, self.app_id, self.ui_url = result.run_id, result.app_id, result.ui_url
        self.input = result.input
        self.checkpoint = result.checkpoint
        self.mlflow_run_id, self.mlflow_run_url = result.mlflow_run_id, result.mlflow_run_url
        self.note_attempts(result.attempts)

    def note_attempts(self, attempts: Any) -> None:
        """Keep each attempt's line, when there was more than one."""
        self.attempts = [a.describe() for a in attempts] if len(attempts) > 1 else []

    def markdown(self) -> str:
        """The summary as markdown."""
        where = "ranks on the driver" if self.mode == "local" else "one rank per Spark barrier task"
        rows = [
            ("Status", self.status),
            ("Processes", str(self.num_processes)),
            ("Mode", f"{self.mode} ({where})"),
            ("GPUs", "one per rank" if self.use_gpu else "none (CPU)"),
            ("Duration", _duration(self.duration_s)),
        ]
        if self.input:
            columns = ", ".join(f"`{name}`" for name in self.input.get("columns", ()))
            source = f" from {self.input['source']}" if self.input.get("source") else ""
            rows.append(("Input", f"{self.input.get('rows')} rows{source}; columns {columns}"))
        if self.checkpoint:
            resumed, latest = (self.checkpoint.get(k) for k in ("resumed_from_step", "latest_step"))
            warm = self.checkpoint.get("warm_start_from")
            start = f"warm start from `{warm}`" if warm else "started fresh"
            start = f"resumed from step {resumed}" if resumed is not None else start
            latest = "none" if latest is None else latest
            where = f"`{self.checkpoint.get('dir')}`"
            rows.append(("Checkpoints", f"{start}; latest step {latest} in {where}"))
        mlflow = f"`{self.mlflow_run_id}`"
        mlflow = f"[{mlflow}]({self.mlflow_run_url})" if self.mlflow_run_url else mlflow
        later = [
            ("MLflow run", self.mlflow_run_id and mlflow),
            ("Attempts", "; ".join(self.attempts)),
            ("Result", self.result),
            ("Spark application", self.app_id and f"`{self.app_id}`"),
            ("Spark UI", self.ui_url and f"[{self.ui_url}]({self.ui_url})"),
            ("Run id", self.run_id and f"`{self.run_id}`"),
        ]
        rows += [(name, value) for name, value in later if value]
        lines = [f"### {self.title}: {self.status}", "", "| | |", "|---|---|"]
        lines += [f"| {name} | {_cell(value)} |" for name, value in rows]
        if self.final_metrics:
            lines += ["", "**Final metrics (rank 0)**", "", "| metric | value |", "|---|---|"]
            lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in self.final_metrics.items()]
        if self.error:
            tail = self.error.rstrip().splitlines()[-_ERROR_LINES:]
            lines += ["", "**Error**", "", "```text", *tail, "```"]
        return "\n".join(lines) + "\n"


class RunArtifacts:
    """Creates and updates one run's artifacts; never fails the run because of an artifact.

    Args:
        prefix: the key prefix (already validated).
        logger: where artifact problems are reported (as warnings).
        description: the progress artifact's description.
        interval: least seconds between two progress updates.
    """

    def __init__(
        self, prefix: str, logger: Logger, description: str, interval: float = 1.0
    ) -> None:
        self.prefix = prefix
        self.keys = artifact_keys(prefix)
        self._log = logger
        self._description = description
        self._interval = interval
        self._lock = threading.Lock()
        self.records: list[MetricRecord] = []
        self._latest: float | None = None
        self._sent: float | None = None
        self._progress_id: UUID | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def start(self) -> None:
        """Create the progress artifact at 0 and start the publisher thread."""
        self._progress_id = self._safely(
            "progress",
            create_progress_artifact,
            progress=0.0,
            key=self.keys["progress"],
            description=self._description,
        )
        self._sent = 0.0
        if self._progress_id is not None:
            context = contextvars.copy_context()
            self._thread = threading.Thread(
                target=context.run, args=(self._publish_loop,), name="prefect-progress", daemon=True
            )
            self._thread.start()

    def on_metrics(self, record: MetricRecord) -> None:
        """The core's ``on_metrics`` callback: keep the record, note rank 0's progress."""
        with self._lock:
            self.records.append(record)
            if len(self.records) > 2 * MAX_TABLE_ROWS:
                del self.records[: len(self.records) - MAX_TABLE_ROWS]
            if record.rank == 0 and record.progress is not None:
                self._latest = record.progress

    def _publish_loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._push()

    def _push(self, value: float | None = None) -> None:
        with self._lock:
            target = self._latest if value is None else value
        if target is None or self._progress_id is None:
            return
        percent = round(max(0.0, min(1.0, target)) * 100.0, 2)
        if percent != self._sent:
            self._safely(
                "progress",
                update_progress_artifact,
                artifact_id=self._progress_id,
                progress=percent,
            )
            self._sent = percent

    def close(self) -> None:
        """Stop the publisher thread without writing anything more."""
        self._stop.set()

    def finish(
        self,
        summary: RunSummary,
        *,
        completed: bool,
        session_created: bool | None = None,
    ) -> None:
        """Final progress (100 when completed), the metrics table, the summary and the links.

        Args:
            summary: the run's summary (its ``ui_url`` is the Spark UI link's target).
            completed: whether the training completed.
            session_created: whether the run started its own Spark session (its live UI is
                gone once the task ends).
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._push(1.0 if completed else None)
        rows = metrics_table(self.records)
        if rows:
            description = f"Metrics reported by the ranks of {summary.title}, per step"
            self._safely(
                "metrics",
                create_table_artifact,
                table=rows,
                key=self.keys["metrics"],
                description=f"{description} (last {MAX_TABLE_ROWS} records)",
            )
        self._safely(
            "summary",
            create_markdown_artifact,
            markdown=summary.markdown(),
            key=self.keys["summary"],
            description=f"Summary of {summary.title}",
        )
        links = [
            ("spark-ui", summary.ui_url, f"Spark UI of {summary.app_id or 'the run'}"),
            ("mlflow", summary.mlflow_run_url, f"MLflow run {summary.mlflow_run_id}"),
        ]
        for name, url, text in links:
            if url:
                description = (
                    _ui_description(url, session_created)
                    if name == "spark-ui"
                    else f"The MLflow run that tracked {summary.title}"
                )
                self._safely(
                    name,
                    create_link_artifact,
                    link=url,
                    link_text=text,
                    key=self.keys[name],
                    description=description,
                )

    def _safely(self, what: str, create: Callable[..., Any], **arguments: Any) -> Any:
        try:
            return create(**arguments)
        except Exception as exc:
            if not self._warned:
                self._log.warning(
                    "could not write the %s artifact (%s: %s); training is not affected",
                    what,
                    type(exc).__name__,
                    exc,
                )
                self._warned = True
            return None


def _ui_description(url: str, created: bool | None) -> str:
    """The Spark UI link artifact's description: how long the link will work."""
    if "/history/" in url:
        return "The Spark History Server page of the training's application."
    if created:
        return (
            "The driver's live Spark UI: it went away when the task stopped the session; "
            "configure a History Server (SparkCluster.history_server_url) for a lasting link."
        )
    return "The driver's live Spark UI: reachable while the flow run's Spark session lives."


class TrainingReport:
    """What one task run says about its training, from launch to end: the summary, and the
    artifacts (keyed by ``artifact_key`` or the task's name; none with ``artifacts=False``).

    Args:
        ctx: the task run's TaskRunContext, or None.
        logger: the task run's logger.
        artifact_key: the artifacts' key prefix, or None.
        artifacts: whether to write artifacts.

    Raises:
        ConfigError: ``artifact_key`` is not a valid Prefect artifact key.
    """

    def __init__(self, ctx: Any, logger: Logger, artifact_key: str | None, artifacts: bool) -> None:
        task_name = ctx.task.name if ctx is not None else "run_torch_distributor"
        self._title = ctx.task_run.name if ctx is not None else task_name
        prefix = (
            key_from_name(task_name) if artifact_key is None else check_artifact_key(artifact_key)
        )
        description = f"Training progress of {self._title} (rank 0's report(progress=...))"
        self.recorder = RunArtifacts(prefix, logger, description) if artifacts else None
        # The task's Prefect timeout: its expiry arrives as a cancellation.
        self._timeout_seconds = ctx.task.timeout_seconds if ctx is not None else None
        self._log = logger
        self._session: dict[str, Any] = {}
        self._started = time.monotonic()
        self.summary: RunSummary  # made by start()

    def on_event(self, event: Any) -> None:
        """The run's phase events: the session's ids, once ready."""
        if event.name == SESSION_READY:
            self._session.update(event.detail)

    def start(self, payload: str, num_processes: int, mode: str, use_gpu: bool) -> None:
        """The launch of ``payload`` (in words) begins: a log line, a running summary, live
        progress."""
        self._log.info(
            "launching %s on %d processes in %s mode%s",
            payload,
            num_processes,
            mode,
            f"; artifacts {self.recorder.prefix}-*" if self.recorder is not None else "",
        )
        self.summary = RunSummary(self._title, "running", num_processes, mode, use_gpu, 0.0)
        self._started = time.monotonic()
        if self.recorder is not None:
            self.recorder.start()

    def failed(self, exc: BaseException) -> None:
        """The launch raised ``exc``: say how it ended."""
        summary = self.summary
        outcome = outcome_of(exc)
        summary.status, summary.error = outcome.state.value.replace("_", " "), outcome.message
        if isinstance(exc, asyncio.CancelledError) and self._timeout_seconds is not None:
            summary.status = "timed out"
            summary.error = (
                f"the task ran past its timeout_seconds={self._timeout_seconds:g}; the "
                "training was stopped and every process of the run ended"
            )
        summary.note_attempts(getattr(exc, "attempts", ()))
        summary.duration_s = time.monotonic() - self._started
        summary.app_id, summary.ui_url = self._session.get("app_id"), self._session.get("ui_url")
        if self.recorder is None:
            return
        summary.final_metrics = latest_values(list(self.recorder.records), 0)
        if isinstance(exc, (Exception, asyncio.CancelledError)):
            # Prefect's own timeout arrives as a CancelledError before it becomes
            # TaskRunTimeoutError; other BaseExceptions (the SIGTERM of a cancelled flow
            # run, Ctrl-C) mean the process is going away: no time for artifacts then.
            created = self._session.get("created")
            self.recorder.finish(summary, completed=False, session_created=created)
        else:
            self.recorder.close()

    def completed(self, result: RunResult, where: str) -> RunSummary:
        """The training completed; ``where``: where rank 0's value went. Artifacts that
        cannot be written are a warning: a retry would train the finished training again."""
        summary = self.summary
        summary.complete(result, where)
        if self.recorder is not None:
            created = self._session.get("created")
            try:
                self.recorder.finish(summary, completed=True, session_created=created)
            except Exception as exc:
                self._log.warning(
                    "sparktorch_ops: the training succeeded but its artifacts could not be "
                    "written (%s: %s); returning its result",
                    type(exc).__name__,
                    exc,
                )
        self._log.info(
            "%d processes finished in %.1f s; final metrics of rank 0: %s",
            result.num_processes,
            summary.duration_s,
            summary.final_metrics or "none reported",
        )
        return summary
