"""The life of a run as explicit states, and the phase events it emits on the way.

A run moves ``PENDING -> PREPARING -> STARTING -> RUNNING -> FINISHING`` and ends in one of
``SUCCEEDED``, ``FAILED``, ``TIMED_OUT`` or ``CANCELLED``. Every transition and every phase on
the way (the session is ready, the channel is open, a rank connected, rank 0's result arrived,
...) is a :class:`PhaseEvent` handed to the ``on_event`` hook, so that wrappers, benchmarks and
tests observe a run through one public surface instead of patching private methods.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class RunState(enum.Enum):
    """Where a run is in its life."""

    PENDING = "pending"
    PREPARING = "preparing"  # Spark session, preflight checks, slots
    STARTING = "starting"  # channel open, agents starting, ranks connecting
    RUNNING = "running"  # every rank connected
    FINISHING = "finishing"  # ranks done (or failed): draining, tearing down
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        """Whether the run is over."""
        return self in _FINAL


_FINAL = frozenset({RunState.SUCCEEDED, RunState.FAILED, RunState.TIMED_OUT, RunState.CANCELLED})
_NEXT: dict[RunState, frozenset[RunState]] = {
    RunState.PENDING: frozenset({RunState.PREPARING}),
    RunState.PREPARING: frozenset({RunState.STARTING}),
    RunState.STARTING: frozenset({RunState.RUNNING, RunState.FINISHING}),
    RunState.RUNNING: frozenset({RunState.FINISHING, RunState.STARTING}),  # STARTING: an attempt
    RunState.FINISHING: _FINAL,
}

# Phase names (besides the state names themselves, emitted on each transition).
PAYLOAD_PACKED = "payload_packed"
SESSION_READY = "session_ready"
SLOTS_READY = "slots_ready"
CHANNEL_OPEN = "channel_open"
INPUT_CHECKED = "input_checked"  # the DataFrame input was checked: rows, columns
DATA_READY = "data_ready"  # every rank has its DataFrame shard (DataFrame input)
ATTEMPT_STARTED = "attempt_started"  # attempt, ranks (max_failures: each attempt's launch)
ATTEMPT_FAILED = "attempt_failed"  # attempt, cause, host, retried
PLANNED = "planned"
LAUNCHER_STARTED = "launcher_started"
NODE_CONNECTED = "node_connected"
RENDEZVOUS_READY = "rendezvous_ready"
SUPERVISOR_CONNECTED = "supervisor_connected"
WORKER_CONNECTED = "worker_connected"
RANK_FAILED = "rank_failed"
RANK_EXITED = "rank_exited"
NODE_EXITED = "node_exited"
RESULT_RECEIVED = "result_received"
DRAINED = "drained"
TEARDOWN = "teardown"
LAUNCHER_FINISHED = "launcher_finished"


@dataclass(frozen=True)
class PhaseEvent:
    """One step of a run.

    Attributes:
        run_id: the run.
        name: a state's value (``"running"``) on a transition, else a phase name above.
        time: when it happened (``time.time()``).
        state: the run's state when it happened.
        node: the barrier task (node) it concerns, if any.
        rank: the rank it concerns, if any.
        detail: more about it (for ``session_ready``: ``app_id``, ``ui_url``, ``master``).
    """

    run_id: str
    name: str
    time: float
    state: RunState
    node: int | None = None
    rank: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)


class InvalidTransition(RuntimeError):
    """A bug: the run tried a transition its state machine does not have."""


class RunStateMachine:
    """A run's state, its transitions, and the hook its events go to.

    Args:
        run_id: the run.
        hook: ``on_event``; an exception it raises is logged and otherwise ignored.
        log: where a failing hook is reported.
    """

    def __init__(self, run_id: str, hook: Callable[[PhaseEvent], None] | None, log: Any) -> None:
        self.run_id = run_id
        self.state = RunState.PENDING
        self._hook = hook
        self._log = log
        # The run's thread and the channel's thread both move the state.
        self._lock = threading.RLock()

    def to(self, state: RunState, **detail: Any) -> None:
        """Move to ``state`` and emit its event; a final state is never left.

        Raises:
            InvalidTransition: the move is not in the state machine.
        """
        with self._lock:
            if state is self.state or self.state.final:
                return
            if state not in _NEXT.get(self.state, frozenset()):
                raise InvalidTransition(f"{self.state.value} -> {state.value}")
            self.state = state
            self.emit(state.value, **detail)

    def advance(self, expected: RunState, state: RunState, **detail: Any) -> bool:
        """Move to ``state`` only if the run is still in ``expected`` (checked atomically).

        For moves made from another thread than the run's own (a rank connecting), which must
        not fight a transition the run's thread made in between. Returns whether it moved.
        """
        with self._lock:
            if self.state is not expected:
                return False
            self.to(state, **detail)
            return True

    def finish(self, state: RunState, **detail: Any) -> None:
        """End the run in a final state, passing through FINISHING from wherever it is."""
        with self._lock:
            if self.state.final:
                return
            if self.state is not RunState.FINISHING:
                self.state = RunState.FINISHING
                self.emit(RunState.FINISHING.value)
            self.to(state, **detail)

    def emit(
        self, name: str, *, node: int | None = None, rank: int | None = None, **detail: Any
    ) -> None:
        """Hand one event to the hook (no-op without one)."""
        if self._hook is None:
            return
        event = PhaseEvent(self.run_id, name, time.time(), self.state, node, rank, detail)
        try:
            self._hook(event)
        except Exception:
            self._log.exception("sparktorch_ops: the on_event hook raised; ignored")
