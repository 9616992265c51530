"""Where every rank is: its Python stacks, asked of each rank's supervisor over the channel
(the rank's side is :mod:`sparktorch_ops.rank.stacks`).

:class:`StackRequests` sends a request to every connected supervisor and waits at most
:data:`CAPTURE_S` for the answers, which the channel's thread hands in as they arrive: a stalled
run reports them in its error, any other stop (timeout, cancel, an orchestrator's kill, Ctrl-C)
logs them before the teardown, and ``TorchDistributor.stacks()`` returns them for a run in
progress. Each rank's text starts with one line saying where its training thread is
(``in fn (train.py:40) <- time.sleep(60)``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from sparktorch_ops.wire.messages import RankStacks, StackRequest

#: How long a capture waits for the ranks: Airflow gives a killed task 5 s before SIGKILL,
#: and the teardown needs the rest.
CAPTURE_S = 2.0
_POLL_S = 0.02


class StackRequests:
    """Open stack requests (id -> log each answer?, answers by rank) and their capture.

    Args:
        lock: the collector's lock, held for every change and read of the requests.
        log: where answers are logged when a capture asks for it.
    """

    def __init__(self, lock: threading.Lock, log: Any) -> None:
        self._lock = lock
        self._log = log
        self._requests: dict[int, tuple[bool, dict[int, RankStacks]]] = {}
        self._next = 0

    def capture(
        self,
        send: Callable[[int, StackRequest], None],
        supervisors: Mapping[int, int],
        exits: Mapping[int, str],
        num_processes: int,
        *,
        log: bool,
        timeout: float = CAPTURE_S,
    ) -> dict[int, str]:
        """Every rank's stacks, by rank: ``where`` on the first line, then every thread's stack.

        Args:
            send: sends a message on a connection (by its id).
            supervisors: the connected supervisors: rank -> connection id.
            exits: how each rank that exited ended (``SIGTERM``, ``code 1``), by rank.
            num_processes: the run's ranks.
            log: log each answer as it arrives.
            timeout: how long to wait for the answers.

        A rank that does not answer within ``timeout``, or has no supervisor connected, gets
        one line saying so. Empty when no supervisor is connected at all (none started yet, or
        the tasks relay their ranks' frames with their result, over Spark Connect).
        """
        if not supervisors:
            return {}
        with self._lock:
            self._next += 1
            request = self._next
            self._requests[request] = (log, {})
        try:
            message = StackRequest(request=request)
            for conn_id in supervisors.values():
                send(conn_id, message)
            deadline = time.monotonic() + timeout
            while len(self._answers(request)) < len(supervisors):
                if time.monotonic() > deadline:
                    break
                time.sleep(_POLL_S)
            answers = self._answers(request)
        finally:
            with self._lock:
                self._requests.pop(request, None)  # a late answer is dropped
        stacks: dict[int, str] = {}
        for rank in sorted(set(range(num_processes)) | set(supervisors)):
            answer = answers.get(rank)
            if answer is not None:
                stacks[rank] = f"{answer.where}\n{answer.text}"
            elif rank in supervisors:
                stacks[rank] = f"did not answer within {timeout:g} s"
            elif rank in exits:
                stacks[rank] = f"exited ({exits[rank]}) before it was asked"
            else:
                stacks[rank] = "never connected: no supervisor to ask"
        return stacks

    def _answers(self, request: int) -> dict[int, RankStacks]:
        with self._lock:
            return dict(self._requests[request][1])

    def answered(self, rank: int, stacks: RankStacks) -> None:
        """``rank``'s supervisor answered a request (on the channel's thread)."""
        with self._lock:
            pending = self._requests.get(stacks.request)
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
