"""The driver's side of the channel: what every rank said, and whether the run has failed.

Runs on the channel server's thread. Log lines go to the caller's logger as they arrive
(stdout at INFO, stderr at WARNING, prefixed with rank and host); metrics go to ``on_metrics``;
rank 0's result bytes are kept as they arrived; exits and failures are recorded in arrival
order, which picks the root cause.

What the driver keeps is bounded, so that no rank can exhaust the driver's memory:

- rank 0's result: up to the run's ``max_result_bytes`` (refused beyond it as soon as more has
  arrived, see :class:`~sparktorch_ops.errors.ResultTooLargeError`);
- each rank's output tail: the last ``TAIL_LINES`` lines and ``TAIL_CHARS`` characters, a line
  longer than ``TAIL_LINE_CHARS`` cut to its head with a marker (lines are decoded text:
  characters are bytes for ASCII); every line still reaches the logger whole;
- a script's value (rank 0's stdout): its last ``SCRIPT_OUTPUT_CAP`` characters, with a note;
- metric records: the latest ``MAX_METRIC_RECORDS``; older ones are dropped (counted, with one
  warning), while ``on_metrics`` sees every record.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sparktorch_ops import events
from sparktorch_ops.driver.coordinator import Coordinator
from sparktorch_ops.errors import ResultTooLargeError
from sparktorch_ops.results import OUTPUT_CUT_NOTE, MetricRecord, RankFailure
from sparktorch_ops.wire import channel
from sparktorch_ops.wire.messages import (
    ARRIVED,
    EXIT,
    FAILURE,
    METRIC,
    RDZV,
    RESULT_CHUNK,
    RESULT_END,
    SHARDS,
    STACKS,
    STDERR,
    STDOUT,
    Arrived,
    ExitReport,
    FailureReport,
    Hello,
    MetricReport,
    RankStacks,
    RendezvousPort,
    ResultEnd,
    ShardSizes,
)

TAIL_LINES = 200
TAIL_CHARS = 256 << 10  # per rank (and for the agents' output)
TAIL_LINE_CHARS = 16 << 10
MAX_METRIC_RECORDS = 100_000
FAILURE_TAIL_LINES = 60
SCRIPT_OUTPUT_CAP = 4 << 20
AGENT = -1  # pseudo-rank of a node's torchrun agent output


class ResultBytes(io.RawIOBase):
    """Rank 0's pickled result, held in the chunks it arrived in and read once.

    The unpickler reads large values straight into their final buffer (``readinto``), and
    every chunk is released as soon as it has been read, so the driver never holds the whole
    pickle twice (chunks plus a joined copy).
    """

    def __init__(self, chunks: list[bytes | bytearray]) -> None:
        super().__init__()
        self._chunks = deque(chunks)
        self._offset = 0
        self.size = sum(len(chunk) for chunk in chunks)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(target) and self._chunks:
            chunk = self._chunks[0]
            take = min(len(chunk) - self._offset, len(target) - filled)
            target[filled : filled + take] = memoryview(chunk)[self._offset : self._offset + take]
            filled += take
            self._offset += take
            if self._offset == len(chunk):
                self._chunks.popleft()
                self._offset = 0
        return filled

    def reader(self) -> io.BufferedReader:
        """A buffered file over the bytes, for ``pickle.load``."""
        return io.BufferedReader(self, buffer_size=1 << 16)


def cut_line(line: str, keep: int = TAIL_LINE_CHARS) -> str:
    """``line`` cut to its first ``keep`` characters, marked with how many bytes were cut."""
    if len(line) <= keep:
        return line
    cut = len(line[keep:].encode("utf-8", errors="replace"))
    return f"{line[:keep]} \u2026[cut {cut} bytes]"


class Tail:
    """The last lines of an output, bounded by lines and by size; iterates oldest first.

    Keeps at most ``max_lines`` lines and ``max_chars`` characters (always the newest line); a
    line longer than ``line_chars`` keeps its head, marked by :func:`cut_line`.
    """

    def __init__(
        self,
        max_lines: int = TAIL_LINES,
        max_chars: int = TAIL_CHARS,
        line_chars: int = TAIL_LINE_CHARS,
    ) -> None:
        self._lines: deque[str] = deque()
        self._chars = 0
        self._max_lines = max_lines
        self._max_chars = max_chars
        self._line_chars = line_chars

    def extend(self, lines: list[str]) -> None:
        """Add lines, dropping the oldest beyond the bounds."""
        if lines and max(map(len, lines)) > self._line_chars:
            lines = [cut_line(line, self._line_chars) for line in lines]
        held = self._lines
        held.extend(lines)
        self._chars += sum(map(len, lines))
        while len(held) > self._max_lines or (self._chars > self._max_chars and len(held) > 1):
            self._chars -= len(held.popleft())

    @property
    def chars(self) -> int:
        """Characters held."""
        return self._chars

    def __iter__(self) -> Iterator[str]:
        return iter(self._lines)

    def __len__(self) -> int:
        return len(self._lines)


@dataclass
class _RankState:
    host: str = ""
    attempt: int = 0
    tail: Tail = field(default_factory=Tail)
    exit_code: int | None = None
    signal: str | None = None
    exited: bool = False
    reason: str = ""
    failed_at: float | None = None
    lost: bool = False
    # time.monotonic() of the rank's last sign of progress in this attempt (None: not
    # connected in it yet): its supervisor's hello, an output line, a report().
    heard_at: float | None = None


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
        self._max_result_bytes = max_result_bytes
        self._log = logger
        self._log_ranks = log_ranks
        self._on_metrics = on_metrics
        self._max_restarts = max_restarts
        self._keep_stdout = keep_rank0_stdout
        self._lock = threading.Lock()
        self.ranks: dict[int, _RankState] = {}
        self.agent_tail = Tail()
        self.metrics: deque[MetricRecord] = deque(maxlen=max_metric_records)
        self.metrics_dropped = 0
        self._steps: dict[int, int] = {}
        self._stdout: deque[str] = deque()
        self._stdout_bytes = 0
        self.stdout_truncated = False
        self.incomplete: str | None = None
        self._result: list[bytes | bytearray] = []
        self._result_size = 0
        self.result: ResultBytes | None = None
        self.result_refused: ResultTooLargeError | None = None
        self.attempt = 0
        self.failure_order: list[int] = []
        self.fatal = False
        self.tearing_down = False
        self.open_peers: dict[int, Hello] = {}
        self.nodes_exited: dict[int, int | None] = {}
        self.nodes_seen: set[int] = set()
        self.coordinator = Coordinator(lambda reason: self._fail(AGENT, reason), self._on_phase)
        self._retried = False
        self.lost_nodes: dict[int, str] = {}
        self._supervisors: dict[int, int] = {}  # rank -> its supervisor's connection
        self._stack_requests: dict[int, tuple[bool, dict[int, RankStacks]]] = {}
        self._next_stack_request = 0

    # -- channel callbacks -------------------------------------------------------------------
    def on_hello(self, peer: channel.Peer) -> None:
        hello = peer.hello
        with self._lock:
            self.open_peers[peer.conn_id] = hello
            if hello.attempt > self.attempt:
                self._new_attempt(hello.attempt)
            if hello.role == "node":
                assert hello.node is not None
                if hello.node in self.nodes_seen:
                    self._retried = True
                self.nodes_seen.add(hello.node)
            if hello.role == "supervisor":
                assert hello.rank is not None
                state = self.ranks.setdefault(hello.rank, _RankState())
                state.host = hello.host or peer.address.rsplit(":", 1)[0]
                state.attempt = hello.attempt
                state.heard_at = time.monotonic()
                self._supervisors[hello.rank] = peer.conn_id
        if hello.role == "node":
            self.coordinator.node_connected(peer)
        phase = {
            "node": events.NODE_CONNECTED,
            "supervisor": events.SUPERVISOR_CONNECTED,
            "worker": events.WORKER_CONNECTED,
        }[hello.role]
        self._on_phase(phase, node=hello.node, rank=hello.rank, attempt=hello.attempt)
        if self._retried:
            self._fail(AGENT, "Spark retried the barrier stage; sparktorch_ops refuses retries")

    def on_frame(self, peer: channel.Peer, kind: int, payload: bytes | bytearray) -> None:
        hello = peer.hello
        if kind in (STDOUT, STDERR):
            lines = payload.decode("utf-8", errors="replace").split("\n")
            if hello.role == "node":
                assert hello.node is not None
                self._agent_lines(hello.node, hello.host, kind, lines)
            else:
                assert hello.rank is not None
                self._rank_lines(hello.rank, kind, lines)
            return
        if hello.role == "node":
            assert hello.node is not None
            if kind == RDZV:
                self.coordinator.rendezvous_ready(RendezvousPort.decode(payload))
            elif kind == SHARDS:
                self.coordinator.shards_written(hello.node, ShardSizes.decode(payload))
            elif kind == ARRIVED:
                self.coordinator.node_arrived(peer, Arrived.decode(payload).node)
            elif kind == EXIT:
                code = ExitReport.decode(payload).exit_code
                with self._lock:
                    self.nodes_exited[hello.node] = code
                self._on_phase(events.NODE_EXITED, node=hello.node, exit_code=code)
            return
        rank = hello.rank
        assert rank is not None
        if kind == STACKS and hello.role == "supervisor":
            self._stacks_answered(rank, RankStacks.decode(payload))
        elif kind == METRIC:
            self._metric(rank, MetricReport.decode(payload))
        elif kind == RESULT_CHUNK and rank == 0:
            self._result_chunk(payload)
        elif kind == RESULT_END and rank == 0:
            size = ResultEnd.decode(payload).size
            if self.result_refused is not None:
                limit = self.result_refused.limit
                self.result_refused = ResultTooLargeError(size, limit, exact=True)
                return
            result = ResultBytes(self._result)
            self._result, self._result_size = [], 0
            if size == result.size:
                self.result = result
                self._on_phase(events.RESULT_RECEIVED, rank=0, size=result.size)
        elif kind == FAILURE:
            failure = FailureReport.decode(payload)
            self._fail(rank, f"{failure.type}: {failure.message}".strip())
        elif kind == EXIT:
            self._exit(rank, ExitReport.decode(payload))

    def on_closed(self, peer: channel.Peer) -> None:
        hello = peer.hello
        with self._lock:
            self.open_peers.pop(peer.conn_id, None)
            if hello.rank is not None and self._supervisors.get(hello.rank) == peer.conn_id:
                del self._supervisors[hello.rank]
        self.coordinator.node_closed(peer)
        if hello.attempt < self.attempt:
            return
        if hello.role == "supervisor":
            assert hello.rank is not None
            state = self.ranks.get(hello.rank)
            if state is not None and not state.exited:
                state.lost = True
                self._fail(hello.rank, "the rank's process vanished (killed, or its host was lost)")
        elif hello.role == "node" and hello.node not in self.nodes_exited:
            assert hello.node is not None
            with self._lock:
                self.lost_nodes[hello.node] = hello.host
            self._fail(
                AGENT, f"barrier task {hello.node} on {hello.host} was lost (executor died?)"
            )

    def data_ready(self, rows: int) -> None:
        """Local mode: the driver wrote every rank's shard."""
        self._on_phase(events.DATA_READY, rows=rows)

    # -- state -------------------------------------------------------------------------------
    def _new_attempt(self, attempt: int) -> None:
        self.attempt = attempt
        self.failure_order = []
        for state in self.ranks.values():
            state.exited, state.exit_code, state.signal = False, None, None
            state.reason, state.failed_at, state.heard_at = "", None, None
        self._result, self._result_size = [], 0
        self.result = None
        self.result_refused = None

    def _result_chunk(self, chunk: bytes | bytearray) -> None:
        """Keep a chunk of rank 0's result, unless the result has passed the limit: then
        release what arrived and keep nothing more of it (the run fails with the error)."""
        if self.result_refused is not None:
            return
        self._result_size += len(chunk)
        limit = self._max_result_bytes
        if limit is not None and self._result_size > limit:
            self._result = []
            self.result_refused = ResultTooLargeError(self._result_size, limit)
            return
        self._result.append(chunk)

    def _rank_lines(self, rank: int, kind: int, lines: list[str]) -> None:
        state = self.ranks.setdefault(rank, _RankState())
        state.heard_at = time.monotonic()
        state.tail.extend(lines)
        if rank == 0 and kind == STDOUT and self._keep_stdout:
            self._keep_rank0_stdout(lines)
            if lines and lines[0].startswith(OUTPUT_CUT_NOTE):  # the supervisor's own line
                self.mark_incomplete("rank 0's supervisor stopped reading its output early")
        if self._log_ranks is not None and rank not in self._log_ranks:
            return
        level = logging.INFO if kind == STDOUT else logging.WARNING
        self._emit(level, f"[rank {rank}|{state.host}]", lines)

    def _agent_lines(self, node: int, host: str, kind: int, lines: list[str]) -> None:
        self.agent_tail.extend(lines)
        if self.tearing_down:
            # torchrun's own traceback about the signal we sent it is noise, not news.
            level = logging.DEBUG
        else:
            level = logging.INFO if kind == STDOUT else logging.WARNING
        self._emit(level, f"[torchrun node {node}|{host}]", lines)

    def _emit(self, level: int, prefix: str, lines: list[str]) -> None:
        log = self._log
        if not isinstance(log, logging.Logger):  # adapters, structlog, Airflow's task logger
            for line in lines:
                log.log(level, "%s %s", prefix, line)
            return
        if not log.isEnabledFor(level):
            return
        # Records made directly: Logger.log would walk the stack (findCaller) for every line.
        for line in lines:
            log.handle(log.makeRecord(log.name, level, __file__, 0, "%s %s", (prefix, line), None))

    def agent_output(self, node: int, host: str, stderr: bool) -> Callable[[list[str]], None]:
        """An ``emit`` for :func:`~sparktorch_ops.node.process.pump_lines` of a local agent."""
        kind = STDERR if stderr else STDOUT

        def emit(lines: list[str]) -> None:
            with self._lock:
                self._agent_lines(node, host, kind, lines)

        return emit

    def _keep_rank0_stdout(self, lines: list[str]) -> None:
        for line in lines:
            self._stdout.append(line)
            self._stdout_bytes += len(line) + 1
        while self._stdout_bytes > SCRIPT_OUTPUT_CAP and len(self._stdout) > 1:
            self._stdout_bytes -= len(self._stdout.popleft()) + 1
            self.stdout_truncated = True

    def mark_incomplete(self, reason: str) -> None:
        """Output of the run may be missing at its end (the first reason is kept)."""
        if self.incomplete is None:
            self.incomplete = reason

    @property
    def output_truncated(self) -> bool:
        """Whether a script's value is not all of rank 0's stdout (cut or incomplete)."""
        return self.stdout_truncated or self.incomplete is not None

    def rank0_stdout(self) -> str:
        """Rank 0's stdout (its tail, with a note, when it exceeded the cap; with a note at the
        end when output may be missing)."""
        text = "\n".join(self._stdout) + ("\n" if self._stdout else "")
        # The notes are part of the value on purpose: a caller must not mistake a part for all.
        if self.stdout_truncated:
            note = f"[sparktorch_ops: output cut to its last {SCRIPT_OUTPUT_CAP} bytes]"
            text = f"{note}\n{text}"
        if self.incomplete is not None:
            text += f"[sparktorch_ops: output may be incomplete: {self.incomplete}]\n"
        return text

    def _metric(self, rank: int, report: MetricReport) -> None:
        state = self.ranks.get(rank)
        if state is not None and state.heard_at is not None:
            state.heard_at = time.monotonic()  # a report() is progress, values or not
        metric = MetricRecord(
            rank=rank,
            step=report.step,
            time=report.time,
            values=dict(report.values),
            progress=report.progress,
            replayed=bool(report.replayed),
        )
        if len(self.metrics) == self.metrics.maxlen:
            self.metrics_dropped += 1
            if self.metrics_dropped == 1:
                self._log.log(
                    logging.WARNING,
                    "sparktorch_ops: more than %d metric records; RunResult.metrics keeps the "
                    "latest %d (on_metrics still gets every record)",
                    self.metrics.maxlen,
                    self.metrics.maxlen,
                )
        self.metrics.append(metric)
        if self._on_metrics is not None:
            try:
                self._on_metrics(metric)
            except Exception:
                self._log.exception("sparktorch_ops: the on_metrics callback raised; ignored")

    def _exit(self, rank: int, report: ExitReport) -> None:
        state = self.ranks.setdefault(rank, _RankState())
        state.exited = True
        state.exit_code = report.exit_code
        state.signal = report.signal
        self._on_phase(events.RANK_EXITED, rank=rank, exit_code=report.exit_code)
        if state.exit_code != 0:
            self._fail(rank, "")

    def _fail(self, rank: int, reason: str) -> None:
        with self._lock:
            state = self.ranks.setdefault(rank, _RankState())
            if reason and not state.reason:
                state.reason = reason
            first_time = state.failed_at is None
            if first_time:
                state.failed_at = time.time()
                self.failure_order.append(rank)
                if self.attempt >= self._max_restarts:
                    self.fatal = True
        if first_time:
            self._on_phase(events.RANK_FAILED, rank=None if rank == AGENT else rank)

    # -- progress and stacks -----------------------------------------------------------------
    def silences(self) -> dict[int, float]:
        """Seconds since each rank of the current attempt that is connected and has not exited
        last showed progress (its connection, an output line, a ``report()``)."""
        now = time.monotonic()
        return {
            rank: now - state.heard_at
            for rank, state in list(self.ranks.items())
            if rank >= 0 and state.heard_at is not None and not state.exited
        }

    def open_stack_request(self, log: bool) -> tuple[int, dict[int, int]]:
        """A new stack request: its id and the supervisors to ask (rank -> connection). With
        ``log``, each answer is logged as it arrives."""
        with self._lock:
            self._next_stack_request += 1
            request = self._next_stack_request
            self._stack_requests[request] = (log, {})
            return request, dict(self._supervisors)

    def stack_answers(self, request: int) -> dict[int, RankStacks]:
        """The answers to ``request`` so far, by rank."""
        with self._lock:
            return dict(self._stack_requests[request][1])

    def close_stack_request(self, request: int) -> None:
        """Forget ``request``; a late answer to it is dropped."""
        with self._lock:
            self._stack_requests.pop(request, None)

    def _stacks_answered(self, rank: int, stacks: RankStacks) -> None:
        with self._lock:
            pending = self._stack_requests.get(stacks.request)
            if pending is None:
                return
            log, answers = pending
            answers[rank] = stacks
        if not log:
            return
        if stacks.source == "none":
            self._log.log(logging.WARNING, "sparktorch_ops: rank %d %s", rank, stacks.where)
            return
        self._log.log(
            logging.WARNING,
            "sparktorch_ops: rank %d is %s (stacks taken by %s):\n%s",
            rank,
            stacks.where,
            "its helper thread" if stacks.source == "threads" else stacks.source,
            stacks.text.rstrip("\n"),
        )

    # -- summaries ---------------------------------------------------------------------------
    def exit_codes(self) -> dict[int, int]:
        """Exit code per rank that reported one."""
        return {
            rank: state.exit_code
            for rank, state in sorted(self.ranks.items())
            if rank >= 0 and state.exit_code is not None
        }

    def outputs(self) -> dict[int, str]:
        """The tail of every rank's output."""
        return {rank: "\n".join(s.tail) for rank, s in sorted(self.ranks.items()) if rank >= 0}

    def failures(self) -> list[RankFailure]:
        """Failed ranks of the last attempt, root cause first."""
        failures = []
        for rank in self.failure_order:
            state = self.ranks[rank]
            tail = self.agent_tail if rank == AGENT else state.tail
            failures.append(
                RankFailure(
                    rank=rank,
                    host=state.host,
                    exit_code=state.exit_code,
                    signal=state.signal,
                    reason=state.reason,
                    output_tail="\n".join(list(tail)[-FAILURE_TAIL_LINES:]),
                    timestamp=state.failed_at or 0.0,
                )
            )
        return failures

    def lost_something(self) -> bool:
        """Whether a barrier task or a rank of the run vanished without saying how it ended."""
        with self._lock:
            return any(rank == AGENT or self.ranks[rank].lost for rank in self.failure_order)

    def explain_lost_nodes(self, cause: str) -> bool:
        """Spark said why barrier tasks were lost: that, not "executor died?", is the reason.
        Returns whether a lost task's failure now says so."""
        with self._lock:
            state = self.ranks.get(AGENT)
            if state is None or not self.lost_nodes:
                return False
            tasks = ", ".join(f"{node} on {host}" for node, host in sorted(self.lost_nodes.items()))
            noun = "task" if len(self.lost_nodes) == 1 else "tasks"
            state.reason = f"barrier {noun} {tasks} failed in Spark: {cause}"
            return True

    def failed_ranks_reported(self) -> bool:
        """Every failed rank has reported how it exited (or is known to be lost)."""
        with self._lock:
            return all(
                self.ranks[rank].exited or self.ranks[rank].lost
                for rank in self.failure_order
                if rank >= 0
            )

    def started_ranks(self) -> int:
        """How many ranks have connected so far."""
        # A copy: the channel thread adds ranks while the run's thread polls (list() of a
        # dict's items is taken whole under the GIL).
        return sum(1 for rank, _ in list(self.ranks.items()) if rank >= 0)

    def supervisors_done(self, num_processes: int) -> bool:
        """Every rank of the current attempt reported its exit and every rank client hung up."""
        exited = sum(1 for r, s in list(self.ranks.items()) if r >= 0 and s.exited)
        with self._lock:
            ranks_open = any(h.role != "node" for h in self.open_peers.values())
        return exited >= num_processes and not ranks_open

    @property
    def failed(self) -> bool:
        """Whether any rank of the current attempt has failed (fatal or not)."""
        return bool(self.failure_order)

    def begin_teardown(self) -> None:
        """The driver is stopping the run: torchrun's complaints about it are not news."""
        self.tearing_down = True

    def all_disconnected(self) -> bool:
        """Every client of the run has hung up."""
        with self._lock:
            return not self.open_peers

    def nodes_done(self, num_tasks: int) -> bool:
        """Every barrier task reported how its agent exited, all with success."""
        with self._lock:
            codes = list(self.nodes_exited.values())
        return len(codes) >= num_tasks and all(code == 0 for code in codes)
