"""Barrier mode over Spark Connect: the stage through the DataFrame API, from a client with no JVM.

A Connect client has no SparkContext: the stage is ``spark.range(n, numPartitions=n)`` (or the
laid-out DataFrame input) ``.mapInArrow(task, ..., barrier=True)``, its rows are the tasks'
reports plus any frames they relayed, and the job is stopped by ``interruptTag`` with the run's
id. The client may be out of the executors' reach (``BarrierTask.coordinate_in_stage``): a
task that cannot reach it relays its ranks' output, metrics and result with its report
(:mod:`sparktorch_ops.node.relay`), replayed here into the run's collector before the stage
counts as ended. When every task reached the client, the client tells them the rendezvous port
and data layout as on a classic session; else the tasks agree on both among themselves (see
:mod:`sparktorch_ops.driver.coordinator`).

A client cannot count the cluster's free slots: the master's own size is used where it fixes
one (``local[N]``, ``local-cluster[N,C,M]``), and otherwise a start deadline (the run's
``start_timeout``, else :data:`START_DEADLINE_S`) fails a stage whose tasks have not started,
seen through the live channel or Spark Connect's progress reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from sparktorch_ops.launchers.barrier import BarrierLauncher
from sparktorch_ops.launchers.base import LauncherStatus
from sparktorch_ops.node.relay import RelayedFrame, Replayer
from sparktorch_ops.node.task import (
    REACH_TIMEOUT_S,
    STAGE_DDL,
    BarrierTask,
    TaskReport,
    stage_row_item,
    stage_rows,
)
from sparktorch_ops.spark.dataframe import PreparedInput
from sparktorch_ops.spark.session import (
    connect_endpoint,
    connect_server_reachable,
)
from sparktorch_ops.spark.shipping import ship_package
from sparktorch_ops.wire import channel
from sparktorch_ops.wire.payload import Payload
from sparktorch_ops.wire.plan import RunPlan

#: How long a Connect run waits for its barrier tasks to start when ``start_timeout`` is unset
#: (Spark itself would retry a stage that lacks slots for about 10 minutes).
START_DEADLINE_S = 120.0
#: How long after the first barrier task reached the client the others may take before the
#: tasks agree among themselves: a task gives up reaching it after ``REACH_TIMEOUT_S``, and
#: the tasks of a stage start within moments of each other.
ARRIVAL_WAIT_S = REACH_TIMEOUT_S + 3.0
_INTERRUPT_WAIT_S = 5.0
_SERVER_CHECK_S = 5.0


class ConnectBarrierLauncher(BarrierLauncher):
    """One barrier stage over a Spark Connect session (see the module).

    Args:
        plan: the run plan (barrier mode).
        payload: what the ranks run.
        secret: the run's secret (inside the Spark task, never in an environment).
        session: the Spark Connect session.
        handler: the run's collector, fed the frames that tasks relayed.
        on_unreachable: called once, with the reasons by task, when some task could not reach
            the driver's channel and relayed instead.
        data: DataFrame input, laid out over the tasks (None: none).
    """

    _start_timeout: float | None = START_DEADLINE_S
    _start_timeout_hint = (
        " (over Spark Connect the free task slots cannot be counted beforehand: the cluster "
        "may lack them)"
    )

    def __init__(
        self,
        plan: RunPlan,
        payload: Payload,
        secret: str,
        session: Any,
        handler: channel.ChannelHandler,
        on_unreachable: Callable[[dict[int, str]], None],
        data: PreparedInput | None = None,
    ) -> None:
        super().__init__(plan, payload, secret, session, data)
        self._task = BarrierTask(
            plan=plan,
            secret=secret,
            payload=payload,
            data_schema=data.facts.schema_json if data is not None else None,
            coordinate_in_stage=True,
        )
        self._session = session
        self._handler = handler
        self._on_unreachable = on_unreachable
        self._job_thread: int | None = None
        self._next_server_check = time.monotonic() + _SERVER_CHECK_S
        self._server_misses = 0
        self._server_lost = False

    def _progress(
        self, stages: Iterable[Any] | None, inflight_tasks: int, *_: Any, **__: Any
    ) -> None:
        """A progress report of the session's operation: the stage has started once a stage
        of as many tasks as the run's is unfinished with that many tasks running."""
        if threading.get_ident() != self._job_thread or stages is None:
            return
        num_tasks = self._plan.layout.num_tasks
        running = [s for s in stages if not s.done and s.num_tasks == num_tasks]
        if running and inflight_tasks >= num_tasks:
            self._tasks_started = True  # sticky

    def _submit(self) -> list[TaskReport]:
        spark, plan = self._session, self._plan
        num_tasks = plan.layout.num_tasks
        ship_package(spark)
        self._job_thread = threading.get_ident()
        spark.addTag(plan.run_id)  # tags of a Connect session are per thread
        spark.registerProgressHandler(self._progress)
        try:
            if self._data is not None:
                frame = self._data.laid_out(num_tasks)
            else:
                frame = spark.range(num_tasks, numPartitions=num_tasks)
            table = frame.mapInArrow(stage_rows(self._task), STAGE_DDL, barrier=True).toArrow()
        finally:
            spark.removeProgressHandler(self._progress)
            spark.removeTag(plan.run_id)
        return self._read(table)

    def _read(self, table: Any) -> list[TaskReport]:
        """The tasks' reports; relayed frames go to the collector, every task's merged in the
        order the relays received them."""
        reports: list[TaskReport] = []
        relayed: list[tuple[int, RelayedFrame]] = []
        for batch in table.to_batches():
            for row in batch.to_pylist():
                node, item = stage_row_item(row)
                if isinstance(item, TaskReport):
                    reports.append(item)
                else:
                    relayed.append((node, item))
        del table
        hosts = {report.node: report.host for report in reports}
        replayer = Replayer(self._handler)
        relayed.sort(key=lambda entry: entry[1].time)  # stable: a task's own order holds
        for node, frame in relayed:
            replayer.feed(node, frame, hosts.get(node, ""))
        replayer.finish()
        unreachable = {r.node: r.unreachable for r in reports if r.unreachable}
        if unreachable:
            self._on_unreachable(unreachable)
        return reports

    def status(self, *, lost: bool = False) -> LauncherStatus:
        """As a classic stage's; besides, a Connect server that stops answering ends the run
        (its client would retry for many minutes before the stage's call fails). ``lost``:
        is the server still there? (asked at once)"""
        if lost:
            self._next_server_check = 0.0
        if (
            not self._done.is_set()
            and not self._server_lost
            and time.monotonic() >= self._next_server_check
        ):
            self._check_server()
        status = super().status()
        if self._server_lost and status.exit is None:
            assert self._cause is not None
            return dataclasses.replace(status, exit=(1, self._cause), cause_pending=False)
        return status

    def _check_server(self) -> None:
        self._next_server_check = time.monotonic() + _SERVER_CHECK_S
        if connect_server_reachable(self._session):
            self._server_misses = 0
            return
        self._server_misses += 1
        if self._server_misses < 2:
            self._next_server_check = time.monotonic() + 1.0  # look again soon
            return
        host, port = connect_endpoint(self._session)
        self._server_lost = True
        self._cause = f"lost the Spark Connect server at {host}:{port} (it stopped answering)"
        self._cause_detail = self._cause

    def _wait_stopped(self, timeout: float) -> None:
        # With the server gone, the stage's call only ends when the client's retries give up
        # (many minutes): nothing is left to wait for, the tasks died with the server.
        if not self._server_lost:
            super()._wait_stopped(timeout)

    def _cancel(self) -> None:
        """Interrupt the stage by the run's tag, waiting at most a few seconds (the client
        retries for minutes when the server is gone; the tasks then stop with the channel)."""

        def interrupt() -> None:
            with contextlib.suppress(Exception):  # a server gone: nothing left to interrupt
                self._session.interruptTag(self._plan.run_id)

        if self._server_lost:
            return
        interrupt_thread = threading.Thread(target=interrupt, daemon=True)
        interrupt_thread.start()
        interrupt_thread.join(_INTERRUPT_WAIT_S)


__all__ = ["START_DEADLINE_S", "ConnectBarrierLauncher"]
