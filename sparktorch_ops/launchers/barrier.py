"""Barrier mode: one Spark barrier stage whose tasks each run one node's torchrun agent."""

from __future__ import annotations

import contextvars
import logging
import re
import threading
import time
from typing import TYPE_CHECKING

from sparktorch_ops.errors import ConfigError, SparkJobKilledError
from sparktorch_ops.launchers.base import LauncherStatus
from sparktorch_ops.node.task import STAGE_DDL, BarrierTask, TaskReport, stage_row_item, stage_rows
from sparktorch_ops.spark.dataframe import PreparedInput, barrier_refused
from sparktorch_ops.spark.preflight import other_python_version
from sparktorch_ops.spark.shipping import ship_package
from sparktorch_ops.wire.payload import Payload
from sparktorch_ops.wire.plan import RunPlan

if TYPE_CHECKING:
    from pyspark import SparkContext


_log = logging.getLogger(__name__)


class BarrierLauncher:
    """One Spark barrier stage; each task runs one agent (see :mod:`sparktorch_ops.node.task`).

    Args:
        plan: the run plan (barrier mode).
        payload: what the ranks run.
        secret: the run's secret (inside the Spark task, never in an environment).
        sc: the SparkContext.
        data: DataFrame input, laid out over the tasks (None: none).

    Task 0 hosts the rendezvous store and keeps it until the driver says the run is over:
    closing the driver's channel is how it says it.
    """

    _start_timeout: float | None = None  # the start deadline when the run sets none
    _start_timeout_hint = ""

    def __init__(
        self,
        plan: RunPlan,
        payload: Payload,
        secret: str,
        sc: SparkContext,
        data: PreparedInput | None = None,
    ) -> None:
        self._plan = plan
        self._data = data
        self._task = BarrierTask(
            plan=plan,
            secret=secret,
            payload=payload,
            data_schema=data.facts.schema_json if data is not None else None,
        )
        self._sc = sc
        self._reports: list[TaskReport] | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._cause: str | None = None  # Spark's reason for the failed job
        self._cause_detail = ""
        self._tasks_started = False  # a classic run learns it from its ranks
        self._killed = False
        self._wrong_python: ConfigError | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Submit the barrier job from a helper thread (``collect`` blocks until it ends)."""
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._run_job,), name=f"{self._plan.run_id}-job", daemon=True
        )
        self._thread.start()

    def _run_job(self) -> None:
        try:
            self._reports = self._submit()
        except BaseException as exc:  # reported by poll()
            try:
                message = _java_message(exc)
                self._killed = not self._stopping and _cancelled_by_spark(message)
                self._wrong_python = other_python_version(message)
                self._cause, self._cause_detail = _summarize(exc, message)
            finally:
                self._error = exc
        finally:
            self._done.set()

    def _submit(self) -> list[TaskReport]:
        """Run the barrier stage to its end (tagged with the run id); the tasks' reports."""
        sc, plan = self._sc, self._plan
        ship_package(sc)
        sc.addJobTag(plan.run_id)
        try:
            # The run's job group (its Spark lines go to its logger, see spark/jvm_log.py).
            sc.setJobGroup(
                plan.run_id,
                f"sparktorch_ops {plan.run_id}: {plan.num_processes} ranks",
                interruptOnCancel=True,
            )
            num_tasks = plan.layout.num_tasks
            if self._data is not None:
                frame = self._data.laid_out(num_tasks)
                try:
                    rows = frame.mapInArrow(
                        stage_rows(self._task), STAGE_DDL, barrier=True
                    ).collect()
                except Exception as exc:
                    # Read as it is, the input's lineage may be one a barrier stage cannot
                    # hold: Spark refuses it before any task runs; lay it out by a shuffle.
                    if frame is not self._data.dataframe or not barrier_refused(exc):
                        raise
                    _log.debug("the barrier stage cannot read the input as it is: %s", exc)
                    frame = self._data.laid_out(num_tasks, shuffle=True)
                    rows = frame.mapInArrow(
                        stage_rows(self._task), STAGE_DDL, barrier=True
                    ).collect()
                items = [stage_row_item(row.asDict())[1] for row in rows]
                return [item for item in items if isinstance(item, TaskReport)]
            rdd = sc.parallelize(range(num_tasks), num_tasks).barrier()
            reported = rdd.mapPartitions(self._task).collect()
            return [item for item in reported if isinstance(item, TaskReport)]
        finally:
            try:
                sc.removeJobTag(plan.run_id)
            except Exception:
                pass

    def _cancel(self) -> None:
        """Cancel the stage's job by the run's tag."""
        self._sc.cancelJobsWithTag(self._plan.run_id)

    def status(self, *, lost: bool = False) -> LauncherStatus:
        """The job's overall status once it has ended, with each failed task's story; Spark's
        own error says why tasks were lost.

        Its ``error``: the job was cancelled from outside the run (``SparkJobKilledError``:
        the Spark UI's kill link, ``cancelJobGroup``, ``cancelAllJobs``), or the executors'
        Python is not the driver's version (``ConfigError``).
        """
        done = self._done.is_set()
        return LauncherStatus(
            exit=self._exit() if done else None,
            error=self._raised() if done else None,
            tasks_started=self._tasks_started,
            cause=self._cause,
            cause_detail=self._cause_detail,
            cause_pending=not done,
            start_timeout=self._start_timeout,
            start_timeout_hint=self._start_timeout_hint,
        )

    def _raised(self) -> BaseException | None:
        if self._wrong_python is not None:
            return self._wrong_python
        if self._killed:
            return SparkJobKilledError(
                f"the Spark job was killed outside sparktorch_ops (the Spark UI's kill link, "
                f"cancelJob, cancelJobGroup or cancelAllJobs): {self._cause}"
            )
        return None

    def _exit(self) -> tuple[int, str]:
        if self._error is not None:
            return 1, f"the Spark job failed: {self._cause or _first_line(self._error)}"
        reports = self._reports or []
        notes = [f"task {r.node}: {r.error}" for r in reports if r.error]
        failed = [r for r in reports if r.exit_code != 0]
        if not failed:
            return 0, ""
        notes += [
            f"torchrun on task {r.node} ({r.host}) exited with code {r.exit_code}"
            for r in failed
            if not r.error
        ]
        return 1, "; ".join(notes)

    def stop(self) -> None:
        """Cancel the job by its tag; the tasks stop their agents when the channel closes."""
        if self._done.is_set() or self._thread is None:
            return
        self._stopping = True  # the cancellation that follows is ours, not a kill
        try:
            self._cancel()
        except Exception:  # the channel closing stops the tasks' agents all the same
            pass
        self._wait_stopped(5.0)

    def release(self) -> None:
        """After the run, however it ended: wait (bounded) for the Spark job to be over."""
        if self._thread is not None:
            self._wait_stopped(30.0)

    def _wait_stopped(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._done.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


_JOB_CANCELLED = re.compile(r"\[SPARK_JOB_CANCELLED\]|\bJob \d+ cancelled\b|\[OPERATION_CANCELED\]")
_PYTHON_TRACEBACK = "Traceback (most recent call last):"


def _java_message(exc: BaseException) -> str:
    """The Spark side's own message of a failed job (a Py4JJavaError's Java exception), else
    the exception's text."""
    java = getattr(exc, "java_exception", None)
    if java is not None:
        try:
            return str(java.getMessage() or "")
        except Exception:  # the JVM may be gone: fall back to the Python side's text
            pass
    return str(exc)


def _cancelled_by_spark(message: str) -> bool:
    """Whether Spark cancelled the job (its UI's kill link, cancelJob/JobGroup/AllJobs)."""
    return bool(_JOB_CANCELLED.search(message))


def _summarize(exc: BaseException, message: str) -> tuple[str, str]:
    """(one line, detail) of a failed Spark job: Spark's reason and, when a task raised in
    Python, that exception's last line, else why the task ended (an executor lost, ...) when
    Spark says it on the next line; the detail adds the task's Python traceback."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return _first_line(exc), ""
    first = 0
    if lines[0].startswith("An error occurred while calling") and len(lines) > 1:
        first = 1
    head = lines[first].lstrip(": ")
    following = lines[first + 1].strip() if first + 1 < len(lines) else ""
    if head.endswith("finished unsuccessfully.") and following and _PYTHON_TRACEBACK not in message:
        head = f"{head} {following}"  # a barrier task's end reason: ExecutorLostFailure (...)
    detail = head
    start = message.rfind(_PYTHON_TRACEBACK)
    if start >= 0:
        block = []
        for line in message[start:].splitlines():
            if line.startswith(("\tat ", "at ")):
                break
            block.append(line)
        raised = [line for line in block[1:] if line and not line[0].isspace()]
        if raised:
            head = f"{head} ... {raised[-1]}"
        detail = "\n".join([lines[0], *block])
    return head, detail


__all__ = ["BarrierLauncher"]
