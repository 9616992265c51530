"""The driver's side of the channel: :class:`RunCollector` reads every frame of a run and hands
it to the part that keeps it.

Runs on the channel server's thread. The hello protocol (which attempt, which node or rank a
connection is) and the nodes' own frames (rendezvous, shards, arrivals, exits) are kept here;
output goes to :mod:`.output`, rank 0's result to :mod:`.result`, exits and failures to
:mod:`.failures`, ``report()`` records to :mod:`.metrics`, stack answers to :mod:`.stacks`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sparktorch_ops import events
from sparktorch_ops.driver.collector.failures import AGENT, RankBook
from sparktorch_ops.driver.collector.metrics import MAX_METRIC_RECORDS, MetricLog
from sparktorch_ops.driver.collector.output import Forwarder, Rank0Stdout
from sparktorch_ops.driver.collector.result import ResultAssembly
from sparktorch_ops.driver.collector.stacks import StackRequests
from sparktorch_ops.driver.coordinator import Coordinator
from sparktorch_ops.results import MetricRecord, RankFailure
from sparktorch_ops.wire import channel
from sparktorch_ops.wire.messages import (
    ARRIVED,
    EXIT,
    FAILURE,
    METRIC,
    NOTICE,
    RDZV,
    RESULT_CHUNK,
    RESULT_END,
    SHARDS,
    STACKS,
    STDERR,
    STDOUT,
    UNUSABLE,
    Arrived,
    ExitReport,
    FailureReport,
    Hello,
    MetricReport,
    Notice,
    RankStacks,
    RendezvousPort,
    ResultEnd,
    ShardSizes,
    UnusablePython,
)

_PHASE_OF_ROLE = {
    "node": events.NODE_CONNECTED,
    "supervisor": events.SUPERVISOR_CONNECTED,
    "worker": events.WORKER_CONNECTED,
}


class RunCollector(channel.ChannelHandler):
    """Collects one run's output, metrics, result and failures.

    Args:
        logger: receives every forwarded line.
        log_ranks: ranks whose lines are forwarded (None: all); all are kept in tails.
        on_metrics: called with each :class:`MetricRecord`; exceptions are logged, not raised.
        max_restarts: torchrun's restarts: a failure is fatal only in the last attempt.
        keep_rank0_stdout: keep rank 0's stdout (up to 4 MiB, the tail) as a script's value.
        on_phase: called (on the channel thread) with a phase name and the node or rank it
            concerns, for the run's events.
        max_result_bytes: the largest result rank 0 may send (None: no limit).
        max_metric_records: how many metric records ``metrics`` keeps (the latest).

    Attributes:
        output: the forwarding of lines (and the agents' tail).
        stdout: rank 0's stdout as a script's value (kept with ``keep_rank0_stdout``), and
            whether the run's output may be incomplete.
        result: rank 0's result as it arrives.
        ranks: every rank's state and the failures.
        metrics: the ``report()`` records.
        stacks: the open stack requests.
        coordinator: the nodes' rendezvous port, shard sizes and arrivals.
        unusable: the first barrier task whose Python cannot run the ranks, if any.
    """

    def __init__(
        self,
        logger: Any,
        *,
        log_ranks: frozenset[int] | None,
        on_metrics: Callable[[MetricRecord], None] | None,
        max_restarts: int,
        keep_rank0_stdout: bool,
        on_phase: Callable[..., None] | None = None,
        max_result_bytes: int | None = None,
        max_metric_records: int = MAX_METRIC_RECORDS,
    ) -> None:
        self._on_phase = on_phase or (lambda name, **where: None)
        self._lock = threading.Lock()
        self.output = Forwarder(logger, log_ranks)
        self._keep_stdout = keep_rank0_stdout
        self.stdout = Rank0Stdout()
        self.result = ResultAssembly(max_result_bytes)
        self.ranks = RankBook(
            self._lock,
            max_restarts,
            lambda rank: self._on_phase(events.RANK_FAILED, rank=rank),
        )
        self.metrics = MetricLog(logger, on_metrics, max_metric_records)
        self.stacks = StackRequests(self._lock, logger)
        self.coordinator = Coordinator(
            lambda reason: self.ranks.fail(AGENT, reason), self._on_phase
        )
        self.unusable: UnusablePython | None = None
        self.open_peers: dict[int, Hello] = {}
        self.nodes_exited: dict[int, int | None] = {}
        self._nodes_seen: set[int] = set()
        self._retried = False
        self._supervisors: dict[int, int] = {}  # rank -> its supervisor's connection

    # -- channel callbacks -------------------------------------------------------------------
    def on_hello(self, peer: channel.Peer) -> None:
        hello = peer.hello
        with self._lock:
            self.open_peers[peer.conn_id] = hello
            if hello.attempt > self.ranks.attempt:
                self.ranks.new_attempt(hello.attempt)
                self.result.reset()
            if hello.role == "node":
                assert hello.node is not None
                if hello.node in self._nodes_seen:
                    self._retried = True
                self._nodes_seen.add(hello.node)
            if hello.role == "supervisor":
                assert hello.rank is not None
                state = self.ranks.get(hello.rank)
                state.host = hello.host or peer.address.rsplit(":", 1)[0]
                state.attempt = hello.attempt
                state.heard_at = time.monotonic()
                self._supervisors[hello.rank] = peer.conn_id
        if hello.role == "node":
            self.coordinator.node_connected(peer)
        self._on_phase(
            _PHASE_OF_ROLE[hello.role], node=hello.node, rank=hello.rank, attempt=hello.attempt
        )
        if self._retried:
            reason = "Spark retried the barrier stage; sparktorch_ops refuses retries"
            self.ranks.fail(AGENT, reason)

    def on_frame(self, peer: channel.Peer, kind: int, payload: bytes | bytearray) -> None:
        hello = peer.hello
        if kind in (STDOUT, STDERR):
            lines = payload.decode("utf-8", errors="replace").split("\n")
            if hello.role == "node":
                assert hello.node is not None
                self.output.agent(hello.node, hello.host, kind == STDERR, lines)
            else:
                assert hello.rank is not None
                level = logging.INFO if kind == STDOUT else logging.WARNING
                self._rank_lines(hello.rank, level, lines, script_output=kind == STDOUT)
            return
        if hello.role == "node":
            assert hello.node is not None
            self._node_frame(peer, hello.node, kind, payload)
            return
        rank = hello.rank
        assert rank is not None
        if kind == STACKS and hello.role == "supervisor":
            self.stacks.answered(rank, RankStacks.decode(payload))
        elif kind == METRIC:
            state = self.ranks.states.get(rank)
            if state is not None and state.heard_at is not None:
                state.heard_at = time.monotonic()  # a report() is progress, values or not
            self.metrics.add(rank, MetricReport.decode(payload))
        elif kind == NOTICE:
            notice = Notice.decode(payload)
            self._rank_lines(rank, notice.level, notice.text.split("\n"), script_output=False)
        elif kind == RESULT_CHUNK and rank == 0:
            self.result.add(payload)
        elif kind == RESULT_END and rank == 0:
            result = self.result.end(ResultEnd.decode(payload).size)
            if result is not None:
                self._on_phase(events.RESULT_RECEIVED, rank=0, size=result.size)
        elif kind == FAILURE:
            failure = FailureReport.decode(payload)
            self.ranks.fail(rank, f"{failure.type}: {failure.message}".strip())
        elif kind == EXIT:
            report = ExitReport.decode(payload)
            succeeded = self.ranks.exited(rank, report)
            self._on_phase(events.RANK_EXITED, rank=rank, exit_code=report.exit_code)
            if not succeeded:
                self.ranks.fail(rank, "")

    def _node_frame(
        self, peer: channel.Peer, node: int, kind: int, payload: bytes | bytearray
    ) -> None:
        if kind == RDZV:
            self.coordinator.rendezvous_ready(RendezvousPort.decode(payload))
        elif kind == SHARDS:
            self.coordinator.shards_written(node, ShardSizes.decode(payload))
        elif kind == ARRIVED:
            self.coordinator.node_arrived(peer, Arrived.decode(payload).node)
        elif kind == EXIT:
            code = ExitReport.decode(payload).exit_code
            with self._lock:
                self.nodes_exited[node] = code
            self._on_phase(events.NODE_EXITED, node=node, exit_code=code)
        elif kind == UNUSABLE:
            unusable = UnusablePython.decode(payload)
            with self._lock:
                self.unusable = self.unusable or unusable
            self.ranks.fail(AGENT, f"{unusable.executable} on {unusable.host}: {unusable.reason}")

    def on_closed(self, peer: channel.Peer) -> None:
        hello = peer.hello
        with self._lock:
            self.open_peers.pop(peer.conn_id, None)
            if hello.rank is not None and self._supervisors.get(hello.rank) == peer.conn_id:
                del self._supervisors[hello.rank]
        self.coordinator.node_closed(peer)
        if hello.attempt < self.ranks.attempt:
            return
        if hello.role == "supervisor":
            assert hello.rank is not None
            state = self.ranks.states.get(hello.rank)
            if state is not None and not state.exited:
                state.lost = True
                self.ranks.fail(
                    hello.rank, "the rank's process vanished (killed, or its host was lost)"
                )
        elif hello.role == "node" and hello.node not in self.nodes_exited:
            assert hello.node is not None
            self.ranks.node_lost(hello.node, hello.host)

    def _rank_lines(self, rank: int, level: int, lines: list[str], *, script_output: bool) -> None:
        """A rank's lines: progress, kept in its tail, forwarded at ``level``; rank 0's stdout
        (``script_output``) is a script's value."""
        state = self.ranks.get(rank)
        state.heard_at = time.monotonic()
        state.tail.extend(lines)
        if rank == 0 and script_output and self._keep_stdout:
            self.stdout.extend(lines)
        self.output.rank(rank, state.host, level, lines)

    # -- for the launchers -------------------------------------------------------------------
    def data_ready(self, rows: int) -> None:
        """Local mode: the driver wrote every rank's shard."""
        self._on_phase(events.DATA_READY, rows=rows)

    def agent_output(self, node: int, host: str, stderr: bool) -> Callable[[list[str]], None]:
        """An ``emit`` for :func:`~sparktorch_ops.node.process.pump_lines` of a local agent."""

        def emit(lines: list[str]) -> None:
            with self._lock:
                self.output.agent(node, host, stderr, lines)

        return emit

    # -- questions of the run's thread -------------------------------------------------------
    def failures(self) -> list[RankFailure]:
        """Failed ranks of the last attempt, root cause first."""
        return self.ranks.failures(self.output.agent_tail)

    def supervisors(self) -> dict[int, int]:
        """The connected supervisors: rank -> connection id."""
        with self._lock:
            return dict(self._supervisors)

    def supervisors_done(self, num_processes: int) -> bool:
        """Every rank of the current attempt reported its exit and every rank client hung up."""
        exited = self.ranks.exited_count()
        with self._lock:
            ranks_open = any(h.role != "node" for h in self.open_peers.values())
        return exited >= num_processes and not ranks_open

    def all_disconnected(self) -> bool:
        """Every client of the run has hung up."""
        with self._lock:
            return not self.open_peers

    def nodes_done(self, num_tasks: int) -> bool:
        """Every barrier task reported how its agent exited, all with success."""
        with self._lock:
            codes = list(self.nodes_exited.values())
        return len(codes) >= num_tasks and all(code == 0 for code in codes)
