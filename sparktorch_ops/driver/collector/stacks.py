"""Requests for the ranks' stacks and their answers, as they arrive on the channel
(``driver/stacks.py`` sends the requests and waits)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from sparktorch_ops.wire.messages import RankStacks


class StackRequests:
    """Open stack requests: id -> (log each answer?, answers by rank)."""

    def __init__(self, lock: threading.Lock, log: Any) -> None:
        self._lock = lock
        self._log = log
        self._requests: dict[int, tuple[bool, dict[int, RankStacks]]] = {}
        self._next = 0

    def open(self, log: bool) -> int:
        """A new request's id; with ``log``, each answer is logged as it arrives."""
        with self._lock:
            self._next += 1
            self._requests[self._next] = (log, {})
            return self._next

    def answers(self, request: int) -> dict[int, RankStacks]:
        """The answers to ``request`` so far, by rank."""
        with self._lock:
            return dict(self._requests[request][1])

    def close(self, request: int) -> None:
        """Forget ``request``; a late answer to it is dropped."""
        with self._lock:
            self._requests.pop(request, None)

    def answered(self, rank: int, stacks: RankStacks) -> None:
        """``rank``'s supervisor answered a request."""
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
