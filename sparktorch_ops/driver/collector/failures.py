"""Each rank's state on the driver (host, exit, failure, last sign of progress) and the run's
failures: recorded in arrival order, which picks the root cause; fatal in torchrun's last
attempt (``max_restarts``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sparktorch_ops.driver.collector.output import Tail
from sparktorch_ops.results import RankFailure
from sparktorch_ops.wire.messages import ExitReport

AGENT = -1  # pseudo-rank of a node's torchrun agent (and of its barrier task)
FAILURE_TAIL_LINES = 60


@dataclass
class RankState:
    """What the driver knows of one rank (or of the agents, as :data:`AGENT`)."""

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


class RankBook:
    """Every rank's :class:`RankState` and the order in which ranks failed.

    Args:
        lock: the collector's lock (the channel thread writes, the run's thread reads).
        max_restarts: torchrun's restarts: a failure is fatal only in the last attempt.
        on_failed: called (outside the lock) with the rank, None for an agent, the first time
            a rank fails.
    """

    def __init__(
        self,
        lock: threading.Lock,
        max_restarts: int,
        on_failed: Callable[[int | None], None],
    ) -> None:
        self._lock = lock
        self._max_restarts = max_restarts
        self._on_failed = on_failed
        self.states: dict[int, RankState] = {}
        self.attempt = 0
        self.failure_order: list[int] = []
        self.fatal = False
        self.lost_nodes: dict[int, str] = {}

    def get(self, rank: int) -> RankState:
        """The state of ``rank``, created when first seen."""
        return self.states.setdefault(rank, RankState())

    def new_attempt(self, attempt: int) -> None:
        """torchrun restarted its workers: what they did in the last attempt is past."""
        self.attempt = attempt
        self.failure_order = []
        for state in self.states.values():
            state.exited, state.exit_code, state.signal = False, None, None
            state.reason, state.failed_at, state.heard_at = "", None, None

    def exited(self, rank: int, report: ExitReport) -> bool:
        """``rank`` reported how it exited; returns whether it exited with success."""
        state = self.get(rank)
        state.exited = True
        state.exit_code = report.exit_code
        state.signal = report.signal
        return state.exit_code == 0

    def fail(self, rank: int, reason: str) -> None:
        """Record that ``rank`` (or :data:`AGENT`) failed; the first reason given is kept."""
        with self._lock:
            state = self.get(rank)
            if reason and not state.reason:
                state.reason = reason
            first_time = state.failed_at is None
            if first_time:
                state.failed_at = time.time()
                self.failure_order.append(rank)
                if self.attempt >= self._max_restarts:
                    self.fatal = True
        if first_time:
            self._on_failed(None if rank == AGENT else rank)

    def node_lost(self, node: int, host: str) -> None:
        """Barrier task ``node`` hung up without reporting its agent's exit."""
        with self._lock:
            self.lost_nodes[node] = host
        self.fail(AGENT, f"barrier task {node} on {host} was lost (executor died?)")

    def explain_lost_nodes(self, cause: str) -> bool:
        """Spark said why barrier tasks were lost: that, not "executor died?", is the reason.
        Returns whether a lost task's failure now says so."""
        with self._lock:
            state = self.states.get(AGENT)
            if state is None or not self.lost_nodes:
                return False
            tasks = ", ".join(f"{node} on {host}" for node, host in sorted(self.lost_nodes.items()))
            noun = "task" if len(self.lost_nodes) == 1 else "tasks"
            state.reason = f"barrier {noun} {tasks} failed in Spark: {cause}"
            return True

    # -- questions of the run's thread -------------------------------------------------------
    @property
    def failed(self) -> bool:
        """Whether any rank of the current attempt has failed (fatal or not)."""
        return bool(self.failure_order)

    def failures(self, agent_tail: Tail) -> list[RankFailure]:
        """Failed ranks of the last attempt, root cause first (an agent's with the agents'
        output)."""
        failures = []
        for rank in self.failure_order:
            state = self.states[rank]
            tail = agent_tail if rank == AGENT else state.tail
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

    def lost_ranks(self) -> dict[int, str]:
        """Ranks whose process vanished without an exit report: their hosts."""
        with self._lock:
            return {rank: s.host for rank, s in self.states.items() if rank >= 0 and s.lost}

    def lost_something(self) -> bool:
        """Whether a barrier task or a rank of the run vanished without saying how it ended."""
        with self._lock:
            return any(rank == AGENT or self.states[rank].lost for rank in self.failure_order)

    def failed_ranks_reported(self) -> bool:
        """Every failed rank has reported how it exited (or is known to be lost)."""
        with self._lock:
            return all(
                self.states[rank].exited or self.states[rank].lost
                for rank in self.failure_order
                if rank >= 0
            )

    def started(self) -> int:
        """How many ranks have connected so far."""
        # A copy: the channel thread adds ranks while the run's thread polls (list() of a
        # dict's items is taken whole under the GIL).
        return sum(1 for rank, _ in list(self.states.items()) if rank >= 0)

    def exited_count(self) -> int:
        """How many ranks of the current attempt reported their exit."""
        return sum(1 for rank, state in list(self.states.items()) if rank >= 0 and state.exited)

    def silences(self) -> dict[int, float]:
        """Seconds since each rank of the current attempt that is connected and has not exited
        last showed progress (its connection, an output line, a ``report()``)."""
        now = time.monotonic()
        return {
            rank: now - state.heard_at
            for rank, state in list(self.states.items())
            if rank >= 0 and state.heard_at is not None and not state.exited
        }

    def exit_codes(self) -> dict[int, int]:
        """Exit code per rank that reported one."""
        return {
            rank: state.exit_code
            for rank, state in sorted(self.states.items())
            if rank >= 0 and state.exit_code is not None
        }

    def outputs(self) -> dict[int, str]:
        """The tail of every rank's output."""
        return {rank: "\n".join(s.tail) for rank, s in sorted(self.states.items()) if rank >= 0}
