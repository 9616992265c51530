"""The driver of a detached run: ``python -m sparktorch_ops.detached.main RUN_DIR``.

An ordinary run (:mod:`sparktorch_ops.driver`) in a process of its own, started in its own
session by :func:`~sparktorch_ops.detached.submit.submit_job`, so that it does not depend on
the process that submitted it. Everything it does goes to the run directory
(:class:`RunWriter`): its status with a heartbeat, its phase events, ``report()`` records and
log lines in chunks, and at the end rank 0's value or the error. It looks for a cancel request
in the directory every second. It reads its job back (:func:`job_of`) and runs it as an
attached run (:class:`~sparktorch_ops.driver.run.Run`); the submitting side writes it
(:mod:`sparktorch_ops.detached.submit`).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from sparktorch_ops.detached.rundir import STREAMS, RunDirectory
from sparktorch_ops.errors import SparkTorchError, outcome_of
from sparktorch_ops.events import PhaseEvent, RunState
from sparktorch_ops.job import CancelToken, TrainingJob
from sparktorch_ops.results import MetricRecord, RunResult
from sparktorch_ops.spark.session import SparkSettings
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire.payload import FunctionCall

_FLUSH_S = 0.5
_HEARTBEAT_S = 2.0
_CANCEL_POLL_S = 1.0


@dataclass(frozen=True)
class DetachedJob:
    """What a detached run runs, as ``job.pkl`` holds it.

    Attributes:
        payload: the packed function call or script (:mod:`sparktorch_ops.wire.payload`).
        options: the launch options (callbacks left out: they stay with the submitter).
        spark: the session's settings (``master``, ``conf``, ``app_name``), None in local mode.
        data: the DataFrame input (SQL, a table or a path), if any.
    """

    payload: Any
    options: dict[str, Any]
    spark: dict[str, Any] | None = None
    data: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


class RunWriter:
    """Writes a run's status, events, metrics and log lines into its directory, in chunks
    (every half second) and with a heartbeat (every two)."""

    def __init__(self, directory: RunDirectory) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._pending: dict[str, list[dict[str, Any]]] = {name: [] for name in STREAMS}
        self._sequence = {name: max(directory.chunks(name), default=0) for name in STREAMS}
        self._status: dict[str, Any] = {
            "state": "preparing",
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "progress": None,
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sparktorch-run-dir", daemon=True)
        self._thread.start()

    def event(self, event: PhaseEvent) -> None:
        """A phase event: kept, and the run's state when it is one."""
        record = {
            "run_id": event.run_id,
            "name": event.name,
            "time": event.time,
            "state": event.state.value,
            "node": event.node,
            "rank": event.rank,
            "detail": {k: _json(v) for k, v in event.detail.items()},
        }
        with self._lock:
            self._pending["events"].append(record)
            if event.name in {state.value for state in RunState}:
                self._status["state"] = event.name

    def metric(self, record: MetricRecord) -> None:
        """A ``report()`` record: kept; rank 0's progress is the run's."""
        with self._lock:
            self._pending["metrics"].append({**record.to_dict(), "replayed": record.replayed})
            if record.rank == 0 and record.progress is not None:
                self._status["progress"] = record.progress

    def line(self, level: str, text: str) -> None:
        """A log line of the run (a rank's output, the driver's own)."""
        with self._lock:
            self._pending["logs"].append({"time": time.time(), "level": level, "line": text})

    def flush(self) -> None:
        """Write what is pending as new chunks, and the status with a fresh heartbeat."""
        with self._lock:
            pending = {name: records for name, records in self._pending.items() if records}
            for name in pending:
                self._pending[name] = []
            status = {**self._status, "heartbeat": time.time()}
        for name, records in pending.items():
            self._sequence[name] += 1
            self.directory.append(name, records, self._sequence[name])
        self.directory.write_status(status)

    def _loop(self) -> None:
        last_beat = 0.0
        while not self._stop.wait(_FLUSH_S):
            busy = any(self._pending.values())
            if busy or time.monotonic() - last_beat >= _HEARTBEAT_S:
                try:
                    self.flush()
                    last_beat = time.monotonic()
                except Exception:  # a store's hiccup: the next round writes it all
                    continue

    def end(self, result: RunResult | None, error: BaseException | None) -> None:
        """Write how the run ended, after everything pending."""
        self._stop.set()
        self._thread.join()
        self.flush()  # every line and record first: a reader that sees the end has them all
        if result is not None:
            state = "succeeded"
            summary = {"state": state, "error": None, "result": result_fields(result)}
            self.directory.write_end(summary, value=pickle.dumps(result.value))
        else:
            assert error is not None
            state = outcome_of(error).state.value
            try:
                raised = pickle.dumps(error)
            except Exception:
                raised = pickle.dumps(SparkTorchError(f"{type(error).__name__}: {error}"))
            self.directory.write_end({"state": state, "error": str(error)}, error=raised)
        self._status["state"] = state
        self.flush()


def result_fields(result: RunResult) -> dict[str, Any]:
    """A RunResult's fields but its value and metrics, as JSON (the handle's ``result_from``
    reads them back)."""
    fields = {
        k: v
        for k, v in asdict(result).items()
        if k not in ("value", "metrics", "started_at", "finished_at", "attempts")
    }
    fields["exit_codes"] = {str(k): v for k, v in result.exit_codes.items()}
    fields["outputs"] = {str(k): v for k, v in result.outputs.items()}
    fields["started_at"] = result.started_at.isoformat()
    fields["finished_at"] = result.finished_at.isoformat()
    fields["attempts"] = [attempt.to_dict() for attempt in result.attempts]
    return fields


def _json(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json(v) for v in value]
    return str(value)


class _ToRunDirectory(logging.Handler):
    def __init__(self, writer: RunWriter) -> None:
        super().__init__()
        self.writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.writer.line(record.levelname, record.getMessage())
        except Exception:
            self.handleError(record)


def _watch_cancel(directory: RunDirectory, token: Any, done: threading.Event) -> None:
    while not done.wait(_CANCEL_POLL_S):
        try:
            reason = directory.cancel_requested()
        except Exception:
            continue
        if reason is not None:
            token.cancel(f"cancel requested through the run directory: {reason}")
            return


def job_of(
    directory: RunDirectory,
    logger: logging.Logger,
    on_metrics: Callable[[MetricRecord], None],
    on_event: Callable[[PhaseEvent], None],
) -> TrainingJob:
    """The job of a run directory, for its detached driver: its callbacks write into it."""
    from sparktorch_ops.rank.pickling import cloudpickle_module

    stored: DetachedJob = pickle.loads(directory.job())
    payload = stored.payload
    if isinstance(payload, FunctionCall):
        train, args, kwargs = cloudpickle_module().loads(payload.data)
    else:
        train, args, kwargs = payload.driver_path, payload.argv, {}
    spark = SparkSettings(**stored.spark) if stored.spark else SparkSettings()
    options = {**stored.options, "logger": logger, "on_metrics": on_metrics, "on_event": on_event}
    return TrainingJob(
        train,
        tuple(args),
        dict(kwargs),
        LaunchSpec(**options),
        spark,
        CancelToken(),
        data=stored.data,
    )


def run(run_dir: str) -> int:
    """Run the detached job of ``run_dir`` to its end; 0 when it succeeded."""
    from sparktorch_ops.driver.run import Run

    directory = RunDirectory(run_dir)
    directory.identity()
    writer = RunWriter(directory)
    # The package's logger, so that what the library logs outside the run's own logger (the
    # JVM's lines before the run is attached to them) reaches the run's log too.
    package_logger = logging.getLogger("sparktorch_ops")
    package_logger.setLevel(logging.INFO)
    package_logger.propagate = False
    package_logger.addHandler(_ToRunDirectory(writer))
    logger = logging.getLogger("sparktorch_ops.detached.run")
    done = threading.Event()
    try:
        job = job_of(directory, logger, writer.metric, writer.event)
        threading.Thread(
            target=_watch_cancel, args=(directory, job.cancel_token, done), daemon=True
        ).start()
        result = Run(job).execute()  # stored with detached=False: it runs here
    except BaseException as exc:
        done.set()
        traceback.print_exc()  # into driver.out, for whoever looks into the run directory
        writer.end(None, exc)
        return 1
    done.set()
    writer.end(result, None)
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
