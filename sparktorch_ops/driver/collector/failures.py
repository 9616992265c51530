"""Each rank's state on the driver (host, exit, failure, last sign of progress) and the run's
failures: recorded in arrival order, which picks the root cause; fatal in torchrun's last
attempt (``max_restarts``)."""

from __future__ import annotations

import time
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

    Holds no lock: the collector calls it holding its own.

    Args:
        max_restarts: torchrun's restarts: a failure is fatal only in the last attempt.
    """

    def __init__(self, max_restarts: int) -> None:
        self._max_restarts = max_restarts
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

    def fail(self, rank: int, reason: str) -> bool:
        """Record that ``rank`` (or :data:`AGENT`) failed; the first reason given is kept.
        Returns whether this is its first failure."""
        state = self.get(rank)
        if reason and not state.reason:
            state.reason = reason
        if state.failed_at is not None:
            return False
        state.failed_at = time.time()
        self.failure_order.append(rank)
        if self.attempt >= self._max_restarts:
            self.fatal = True
        return True

    def explain_lost_nodes(self, cause: str) -> bool:
        """Spark said why barrier tasks were lost: that, not "executor died?", is the reason.
        Returns whether a lost task's failure now says so."""
        state = self.states.get(AGENT)
        if state is None or not self.lost_nodes:
            return False
        tasks = ", ".join(f"{node} on {host}" for node, host in sorted(self.lost_nodes.items()))
        noun = "task" if len(self.lost_nodes) == 1 else "tasks"
        state.reason = f"barrier {noun} {tasks} failed in Spark: {cause}"
        return True

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

    def ranks(self) -> dict[int, RankState]:
        """The ranks' states (the agents' left out), by rank."""
        return {rank: state for rank, state in sorted(self.states.items()) if rank >= 0}
