"""A detached run, seen from any process: :class:`RunHandle` reads its run directory.

``TorchDistributor(..., detached=True).submit(...)`` returns one; ``RunHandle(run_dir)``
reattaches to the same run from another process (the CLI, an Airflow trigger, a rerun of the
flow). Nothing here talks to the run's driver: it reads what the driver wrote
(:mod:`~sparktorch_ops.detached.rundir`) and asks for a cancel by writing into the directory.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pendulum

from sparktorch_ops.detached.rundir import (
    FINAL_STATES,
    LOST,
    RunDirectory,
    RunDirectoryError,
    state_of,
)
from sparktorch_ops.errors import SparkTorchError
from sparktorch_ops.results import Attempt, MetricRecord, RunResult
from sparktorch_ops.wire.channel import backoff

#: How often :meth:`RunHandle.wait` and ``logs(follow=True)`` look, at most (they start
#: faster and back off to this).
MAX_POLL_S = 2.0


@dataclass(frozen=True)
class RunStatus:
    """Where a detached run is.

    Attributes:
        state: ``submitted``, ``preparing``, ``starting``, ``running``, ``finishing``, then
            ``succeeded``, ``failed``, ``cancelled``, ``timed_out``; ``lost`` when its driver
            stopped without saying how the run ended (killed, or its machine gone).
        training_id: the training the run is of.
        run_dir: its directory.
        progress: rank 0's latest reported progress, if any.
        pid: its driver's process, and ``host`` that process's machine.
        error: how it failed, for a run that did.
        updated: when the driver last wrote (seconds since the epoch).
    """

    state: str
    training_id: str
    run_dir: str
    progress: float | None = None
    pid: int | None = None
    host: str | None = None
    error: str | None = None
    updated: float | None = None

    @property
    def done(self) -> bool:
        """Whether the run is over (however it ended)."""
        return self.state in FINAL_STATES


class RunLostError(SparkTorchError):
    """A detached run's driver stopped without saying how the run ended.

    Attributes:
        run_dir: the run's directory.
    """

    def __init__(self, run_dir: str, detail: str = "") -> None:
        super().__init__(
            f"the detached run in {run_dir} was lost: its driver stopped without ending it"
            f"{f' ({detail})' if detail else ''}; submit it again (it resumes from its "
            "checkpoints)"
        )
        self.run_dir = run_dir
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_dir, self.detail))


class RunHandle:
    """A detached run: its status, its logs, its result; a cancel.

    Args:
        run_dir: the run's directory (a path or an fsspec URL), as ``submit`` printed it.

    Raises:
        RunDirectoryError: the directory is missing, not a run's, corrupt or unreadable.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.directory = RunDirectory(run_dir)
        self.identity = self.directory.identity()

    @property
    def run_dir(self) -> str:
        """The run's directory."""
        return self.directory.location

    @property
    def training_id(self) -> str:
        """The training this run is of."""
        return str(self.identity["training_id"])

    def __repr__(self) -> str:
        return f"RunHandle({self.run_dir!r})"

    def status(self) -> RunStatus:
        """Where the run is now."""
        status = self.directory.status()
        state = state_of(status)
        if state == "submitted" and time.time() - float(self.identity["created"]) > 120:
            state = LOST  # a driver writes its status within seconds of its start
        end = self.directory.end()
        if end is not None:
            state = str(end.get("state", state))
        elif state in ("succeeded", "failed", "cancelled", "timed_out"):
            state = "finishing"  # its end is being written
        return RunStatus(
            state=state,
            training_id=self.training_id,
            run_dir=self.run_dir,
            progress=status.get("progress"),
            pid=status.get("pid"),
            host=status.get("host"),
            error=end.get("error") if end else None,
            updated=status.get("heartbeat"),
        )

    def wait(self, timeout: float | None = None) -> RunResult:
        """Wait for the run to end; its :class:`~sparktorch_ops.RunResult`.

        Raises:
            TimeoutError: still running after ``timeout`` seconds (it goes on).
            RunLostError: its driver stopped without ending it.
            SparkTorchError: how the run failed (the error the driver raised), as ``run``
                would have raised it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pauses = backoff(0.1, MAX_POLL_S)
        while True:
            status = self.status()
            if status.done:
                return self.result()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"the run in {self.run_dir} is still {status.state}")
            time.sleep(next(pauses))

    def result(self) -> RunResult:
        """The ended run's result (or its error, raised).

        Raises:
            RunLostError, SparkTorchError: as :meth:`wait`; RunDirectoryError: not ended.
        """
        end = self.directory.end()
        if end is None:
            if self.status().state == LOST:
                raise RunLostError(self.run_dir)
            raise RunDirectoryError(
                self.run_dir, "holds a run that has not ended yet: wait() for it"
            )
        if end.get("state") != "succeeded":
            error = self.directory.error()
            if error is not None:
                raise pickle.loads(error)
            raise SparkTorchError(
                f"the run in {self.run_dir} {end.get('state')}: {end.get('error')}"
            )
        return result_from(end, pickle.loads(self.directory.value()), self.metrics())

    def metrics(self) -> list[MetricRecord]:
        """Every ``report()`` record so far."""
        return [
            MetricRecord(
                rank=r["rank"],
                step=r["step"],
                time=r["time"],
                values=dict(r["values"]),
                progress=r.get("progress"),
                replayed=bool(r.get("replayed")),
            )
            for _, r in self.directory.read("metrics")
        ]

    def events(self) -> list[dict[str, Any]]:
        """Every phase event so far (``name``, ``time``, ``state``, ``detail``...)."""
        return [record for _, record in self.directory.read("events")]

    def logs(self, follow: bool = False, poll: float = MAX_POLL_S) -> Iterator[str]:
        """The run's log lines (the ranks' output and the driver's own lines), from the start;
        with ``follow``, new ones as they come, until the run ends."""
        after = 0
        while True:
            done = follow and self.status().done  # read before the chunks: none is missed
            for chunk, record in self.directory.read("logs", after):
                after = max(after, chunk)
                yield str(record["line"])
            if not follow or done:
                return
            time.sleep(poll)

    def forward_logs(self, log: logging.Logger | Any, after: int = 0) -> int:
        """Log the run's lines from chunk ``after`` on to ``log``, each at its own level; the
        last chunk read (the next call's ``after``)."""
        for chunk, record in self.directory.read("logs", after):
            after = max(after, chunk)
            level = logging.getLevelName(str(record.get("level", "INFO")))
            log.log(level if isinstance(level, int) else logging.INFO, "%s", record["line"])
        return after

    def cancel(self, reason: str = "cancelled through its run directory") -> None:
        """Ask the run to stop; it ends as a cancelled run (nothing of it left running).

        Raises:
            RunDirectoryError: this user cannot write the run's directory.
        """
        if not self.status().done:
            self.directory.request_cancel(reason)


def result_from(end: dict[str, Any], value: Any, metrics: list[MetricRecord]) -> RunResult:
    """A RunResult from a run directory's ``result.json``, value and metrics."""
    fields = dict(end["result"])
    return RunResult(
        value=value,
        exit_codes={int(k): v for k, v in fields["exit_codes"].items()},
        outputs={int(k): v for k, v in fields["outputs"].items()},
        metrics=metrics,
        started_at=pendulum.parse(fields["started_at"]),  # type: ignore[arg-type]
        finished_at=pendulum.parse(fields["finished_at"]),  # type: ignore[arg-type]
        mode=fields["mode"],
        num_processes=fields["num_processes"],
        app_id=fields.get("app_id"),
        ui_url=fields.get("ui_url"),
        output_truncated=bool(fields.get("output_truncated")),
        run_id=fields.get("run_id", ""),
        metrics_dropped=int(fields.get("metrics_dropped", 0)),
        input=fields.get("input"),
        checkpoint=fields.get("checkpoint"),
        mlflow_run_id=fields.get("mlflow_run_id"),
        mlflow_run_url=fields.get("mlflow_run_url"),
        training_id=fields.get("training_id"),
        attempts=tuple(Attempt(**a) for a in fields.get("attempts", ())),
    )
