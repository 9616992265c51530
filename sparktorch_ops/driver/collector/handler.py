"""The driver's side of the channel: :class:`RunCollector` reads every frame of a run, hands
it to the part that keeps it, and answers the run's thread with one frozen
:class:`CollectorStatus`.

The hello protocol (which attempt, which node or rank a connection is) and the nodes' own
frames (exits, an unusable Python) are kept here; output goes to :mod:`.output`, rank 0's
result to :mod:`.result`, exits and failures to :mod:`.failures`, ``report()`` records to
:mod:`.metrics`, stack answers to :mod:`.stacks`, the nodes' rendezvous port, shard sizes and
arrivals to :mod:`~sparktorch_ops.driver.coordinator`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from sparktorch_ops import errors, events
from sparktorch_ops.driver.collector.failures import AGENT, RankBook
from sparktorch_ops.driver.collector.metrics import MAX_METRIC_RECORDS, MetricLog
from sparktorch_ops.driver.collector.output import Forwarder, Rank0Stdout, Tail
from sparktorch_ops.driver.collector.result import ResultAssembly
from sparktorch_ops.driver.collector.stacks import CAPTURE_S, StackRequests
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
    StackRequest,
    UnusablePython,
)

_PHASE_OF_ROLE = {
    "node": events.NODE_CONNECTED,
    "supervisor": events.SUPERVISOR_CONNECTED,
    "worker": events.WORKER_CONNECTED,
}


@dataclass(frozen=True)
class CollectorStatus:
    """What the run's ranks and barrier tasks have said, at one moment (the current attempt of
    torchrun's restarts where it says so).

    Attributes:
        connected: how many ranks have connected so far.
        exited: how many ranks of the current attempt reported their exit.
        silent: seconds since each rank of the current attempt that is connected and has not
            exited last showed progress (its connection, an output line, a ``report()``).
        failed: a rank (or a barrier task's agent) of the current attempt failed.
        fatal: a failure in torchrun's last attempt (``max_restarts``): the run is over.
        failures_reported: every failed rank reported how it exited, or is known to be lost.
        lost: a barrier task or a rank of the current attempt vanished without saying how it
            ended.
        lost_nodes: barrier tasks that hung up without their agent's exit: their hosts.
        lost_ranks: ranks whose process vanished without an exit report: their hosts.
        node_exits: how each barrier task's agent exited, by node.
        open_ranks: connections of ranks (supervisors, workers) still open.
        open_clients: connections still open, of any kind.
        refused: rank 0's result, refused for passing ``max_result_bytes``.
        unusable: the first barrier task whose Python cannot run the ranks.
    """

    connected: int
    exited: int
    silent: Mapping[int, float]
    failed: bool
    fatal: bool
    failures_reported: bool
    lost: bool
    lost_nodes: Mapping[int, str]
    lost_ranks: Mapping[int, str]
    node_exits: Mapping[int, int | None]
    open_ranks: int
    open_clients: int
    refused: errors.ResultTooLargeError | None
    unusable: UnusablePython | None

    def nodes_succeeded(self, num_tasks: int) -> bool:
        """Every one of ``num_tasks`` barrier tasks reported its agent's exit, all with
        success."""
        codes = self.node_exits.values()
        return len(codes) >= num_tasks and all(code == 0 for code in codes)

    def ranks_done(self, num_processes: int) -> bool:
        """Every rank of the current attempt reported its exit and hung up."""
        return self.exited >= num_processes and not self.open_ranks


class RunCollector(channel.ChannelHandler):
    """Collects one run's output, metrics, result and failures.

    Threads and the lock: the channel server's thread calls the channel callbacks (so does
    the thread of a Spark Connect stage that replays relayed frames, and a local agent's
    output pumps call :meth:`agent_output`); the run's thread asks. One lock guards the whole
    state, its parts' included (:class:`RankBook`, :class:`ResultAssembly`,
    :class:`Rank0Stdout`, :class:`MetricLog`, :class:`StackRequests`, the agents' tail): every
    change is made holding it, and the run's thread reads through :meth:`status` (a frozen
    snapshot) and the other questions, each taken under it. What leaves the collector (phase
    events, ``on_metrics``, log lines) goes out after it is released, so that a hook may ask
    anything. Once the channel is closed nothing changes, and the parts are read as they are
    for the run's result. The coordinator keeps its own lock: it talks to the nodes and is not
    read by the run's thread.

    Args:
        logger: receives every forwarded line.
        log_ranks: ranks whose lines are forwarded (None: all); all are kept in tails.
        on_metrics: called with each :class:`MetricRecord`; exceptions are logged, not raised.
        max_restarts: torchrun's restarts: a failure is fatal only in the last attempt.
        keep_rank0_stdout: keep rank 0's stdout (up to 4 MiB, the tail) as a script's value.
        on_phase: called with a phase name and the node or rank it concerns, for the run's
            events.
        max_result_bytes: the largest result rank 0 may send (None: no limit).
        max_metric_records: how many metric records ``metrics`` keeps (the latest).

    Attributes:
        output: the forwarding of lines.
        stdout: rank 0's stdout as a script's value (kept with ``keep_rank0_stdout``), and
            whether the run's output may be incomplete.
        result: rank 0's result as it arrives.
        ranks: every rank's state and the failures.
        metrics: the ``report()`` records.
        coordinator: the nodes' rendezvous port, shard sizes and arrivals.
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
        self.ranks = RankBook(max_restarts)
        self.metrics = MetricLog(logger, on_metrics, max_metric_records)
        self._stacks = StackRequests(self._lock, logger)
        self.coordinator = Coordinator(lambda reason: self._fail(AGENT, reason), self._on_phase)
        self._agent_tail = Tail()
        self._unusable: UnusablePython | None = None
        self._open_peers: dict[int, Hello] = {}
        self._nodes_exited: dict[int, int | None] = {}
        self._nodes_seen: set[int] = set()
        self._supervisors: dict[int, int] = {}  # rank -> its supervisor's connection

    # -- channel callbacks -------------------------------------------------------------------
    def on_hello(self, peer: channel.Peer) -> None:
        hello = peer.hello
        retried = False
        with self._lock:
            self._open_peers[peer.conn_id] = hello
            if hello.attempt > self.ranks.attempt:
                self.ranks.new_attempt(hello.attempt)
                self.result.reset()
            if hello.role == "node":
                assert hello.node is not None
                retried = hello.node in self._nodes_seen
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
        if retried:
            self._fail(AGENT, "Spark retried the barrier stage; sparktorch_ops refuses retries")

    def on_frame(self, peer: channel.Peer, kind: int, payload: bytes | bytearray) -> None:
        hello = peer.hello
        if kind in (STDOUT, STDERR):
            lines = payload.decode("utf-8", errors="replace").split("\n")
            if hello.role == "node":
                assert hello.node is not None
                self._agent_lines(hello.node, hello.host, kind == STDERR, lines)
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
            self._stacks.answered(rank, RankStacks.decode(payload))
        elif kind == METRIC:
            metric = MetricReport.decode(payload)
            with self._lock:
                state = self.ranks.states.get(rank)
                if state is not None and state.heard_at is not None:
                    state.heard_at = time.monotonic()  # a report() is progress, values or not
                record = self.metrics.add(rank, metric)
            self.metrics.tell(record)
        elif kind == NOTICE:
            notice = Notice.decode(payload)
            self._rank_lines(rank, notice.level, notice.text.split("\n"), script_output=False)
        elif kind == RESULT_CHUNK and rank == 0:
            with self._lock:
                self.result.add(payload)
        elif kind == RESULT_END and rank == 0:
            size = ResultEnd.decode(payload).size
            with self._lock:
                result = self.result.end(size)
            if result is not None:
                self._on_phase(events.RESULT_RECEIVED, rank=0, size=result.size)
        elif kind == FAILURE:
            failure = FailureReport.decode(payload)
            self._fail(rank, f"{failure.type}: {failure.message}".strip())
        elif kind == EXIT:
            report = ExitReport.decode(payload)
            with self._lock:
                succeeded = self.ranks.exited(rank, report)
            self._on_phase(events.RANK_EXITED, rank=rank, exit_code=report.exit_code)
            if not succeeded:
                self._fail(rank, "")

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
                self._nodes_exited[node] = code
            self._on_phase(events.NODE_EXITED, node=node, exit_code=code)
        elif kind == UNUSABLE:
            unusable = UnusablePython.decode(payload)
            with self._lock:
                self._unusable = self._unusable or unusable
            self._fail(AGENT, f"{unusable.executable} on {unusable.host}: {unusable.reason}")

    def on_closed(self, peer: channel.Peer) -> None:
        hello = peer.hello
        failed, lost = AGENT, None
        with self._lock:
            self._open_peers.pop(peer.conn_id, None)
            if hello.rank is not None and self._supervisors.get(hello.rank) == peer.conn_id:
                del self._supervisors[hello.rank]
            current = hello.attempt >= self.ranks.attempt
            if current and hello.role == "supervisor":
                assert hello.rank is not None
                state = self.ranks.states.get(hello.rank)
                if state is not None and not state.exited:
                    state.lost = True
                    failed = hello.rank
                    lost = "the rank's process vanished (killed, or its host was lost)"
            elif current and hello.role == "node" and hello.node not in self._nodes_exited:
                assert hello.node is not None
                self.ranks.lost_nodes[hello.node] = hello.host
                failed = AGENT
                lost = f"barrier task {hello.node} on {hello.host} was lost (executor died?)"
        self.coordinator.node_closed(peer)
        if lost is not None:
            self._fail(failed, lost)

    def _fail(self, rank: int, reason: str) -> None:
        """``rank`` (or :data:`AGENT`) failed; the first time, that is a phase of the run."""
        with self._lock:
            first_time = self.ranks.fail(rank, reason)
        if first_time:
            self._on_phase(events.RANK_FAILED, rank=None if rank == AGENT else rank)

    def _rank_lines(self, rank: int, level: int, lines: list[str], *, script_output: bool) -> None:
        """A rank's lines: progress, kept in its tail, forwarded at ``level``; rank 0's stdout
        (``script_output``) is a script's value."""
        with self._lock:
            state = self.ranks.get(rank)
            state.heard_at = time.monotonic()
            state.tail.extend(lines)
            if rank == 0 and script_output and self._keep_stdout:
                self.stdout.extend(lines)
            host = state.host
        self.output.rank(rank, host, level, lines)

    def _agent_lines(self, node: int, host: str, stderr: bool, lines: list[str]) -> None:
        """A node's torchrun agent's lines: kept in the agents' tail, forwarded."""
        with self._lock:
            self._agent_tail.extend(lines)
        self.output.agent(node, host, stderr, lines)

    # -- for the launchers -------------------------------------------------------------------
    def data_ready(self, rows: int) -> None:
        """Local mode: the driver wrote every rank's shard."""
        self._on_phase(events.DATA_READY, rows=rows)

    def agent_output(self, node: int, host: str, stderr: bool) -> Callable[[list[str]], None]:
        """An ``emit`` for :func:`~sparktorch_ops.node.process.pump_lines` of a local agent."""

        def emit(lines: list[str]) -> None:
            self._agent_lines(node, host, stderr, lines)

        return emit

    # -- questions of the run's thread -------------------------------------------------------
    def status(self) -> CollectorStatus:
        """What the ranks and tasks have said so far, as one consistent snapshot."""
        now = time.monotonic()
        with self._lock:
            book = self.ranks
            ranks = book.ranks()
            failed = [(rank, book.states[rank]) for rank in book.failure_order]
            return CollectorStatus(
                connected=len(ranks),
                exited=sum(1 for state in ranks.values() if state.exited),
                silent=MappingProxyType(
                    {
                        rank: now - state.heard_at
                        for rank, state in ranks.items()
                        if state.heard_at is not None and not state.exited
                    }
                ),
                failed=bool(failed),
                fatal=book.fatal,
                failures_reported=all(
                    state.exited or state.lost for rank, state in failed if rank >= 0
                ),
                lost=any(rank == AGENT or state.lost for rank, state in failed),
                lost_nodes=MappingProxyType(dict(book.lost_nodes)),
                lost_ranks=MappingProxyType(
                    {rank: state.host for rank, state in ranks.items() if state.lost}
                ),
                node_exits=MappingProxyType(dict(self._nodes_exited)),
                open_ranks=sum(1 for h in self._open_peers.values() if h.role != "node"),
                open_clients=len(self._open_peers),
                refused=self.result.refused,
                unusable=self._unusable,
            )

    def failures(self) -> list[RankFailure]:
        """Failed ranks of the last attempt, root cause first."""
        with self._lock:
            return self.ranks.failures(self._agent_tail)

    def silent_failures(
        self, silent: Mapping[int, float], wheres: Mapping[int, str], num_processes: int
    ) -> list[RankFailure]:
        """A stall as failures: the ``silent`` ranks (seconds, by rank), the one silent longest
        first, each with where it was (``wheres``, by rank), then the ranks that never
        connected."""
        now = time.time()
        with self._lock:
            states = self.ranks.ranks()
            failures = [
                RankFailure(
                    rank=rank,
                    host=states[rank].host,
                    exit_code=None,
                    signal=None,
                    reason=f"silent for {silent[rank]:.1f} s, {wheres.get(rank, '')}",
                    output_tail="\n".join(list(states[rank].tail)[-20:]),
                    timestamp=now - silent[rank],
                )
                for rank in sorted(silent, key=lambda rank: -silent[rank])
            ]
            failures.extend(
                RankFailure(rank, "", None, None, "never connected", "", now)
                for rank in range(num_processes)
                if rank not in silent and (rank not in states or not states[rank].exited)
            )
        return failures

    def capture_stacks(
        self,
        send: Callable[[int, StackRequest], None],
        num_processes: int,
        *,
        log: bool,
        timeout: float = CAPTURE_S,
    ) -> dict[int, str]:
        """Every rank's stacks now, by rank (see :meth:`StackRequests.capture`); ``send``
        sends on the channel."""
        with self._lock:
            supervisors = dict(self._supervisors)
            exits = {
                rank: state.signal or f"code {state.exit_code}"
                for rank, state in self.ranks.ranks().items()
                if state.exited
            }
        return self._stacks.capture(
            send, supervisors, exits, num_processes, log=log, timeout=timeout
        )

    def explain_lost_nodes(self, cause: str) -> bool:
        """Spark said why barrier tasks were lost (see :meth:`RankBook.explain_lost_nodes`)."""
        with self._lock:
            return self.ranks.explain_lost_nodes(cause)

    def mark_incomplete(self, reason: str) -> bool:
        """Output of the run may be missing at its end; returns whether nothing said so
        before."""
        with self._lock:
            first = self.stdout.incomplete is None
            self.stdout.mark_incomplete(reason)
            return first

    def tearing_down(self) -> None:
        """The run tears its ranks down: torchrun's traceback about the signal it was sent is
        no news (logged at DEBUG from now on)."""
        with self._lock:
            self.output.tearing_down = True

    def exit_codes(self) -> dict[int, int]:
        """Exit code per rank that reported one."""
        with self._lock:
            ranks = self.ranks.ranks()
            return {r: s.exit_code for r, s in ranks.items() if s.exit_code is not None}

    def outputs(self) -> dict[int, str]:
        """The tail of every rank's output."""
        with self._lock:
            return {rank: "\n".join(state.tail) for rank, state in self.ranks.ranks().items()}
