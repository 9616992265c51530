"""The ranks' and agents' output on the driver: every line forwarded to the run's logger as it
arrives (stdout at INFO, stderr at WARNING, prefixed with rank and host), a bounded tail kept
per rank for failures, and rank 0's stdout kept as a script's value.

What is kept is bounded, so that no rank can exhaust the driver's memory: each tail holds the
last ``TAIL_LINES`` lines and ``TAIL_CHARS`` characters, a line longer than ``TAIL_LINE_CHARS``
cut to its head with a marker (lines are decoded text: characters are bytes for ASCII), while
every line still reaches the logger whole; a script's value keeps the last
``SCRIPT_OUTPUT_CAP`` characters, with a note.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

from sparktorch_ops.results import OUTPUT_CUT_NOTE

TAIL_LINES = 200
TAIL_CHARS = 256 << 10  # per rank (and for the agents' output)
TAIL_LINE_CHARS = 16 << 10
SCRIPT_OUTPUT_CAP = 4 << 20


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

    def __iter__(self) -> Iterator[str]:
        return iter(self._lines)

    def __len__(self) -> int:
        return len(self._lines)


class Rank0Stdout:
    """Rank 0's stdout, kept as a script's value: its last :data:`SCRIPT_OUTPUT_CAP`
    characters, and why it may be incomplete."""

    def __init__(self) -> None:
        self._lines: deque[str] = deque()
        self._bytes = 0
        self.truncated = False
        self.incomplete: str | None = None

    def extend(self, lines: list[str]) -> None:
        """Keep ``lines``; the supervisor's own note that it stopped reading marks the value
        incomplete."""
        if lines and lines[0].startswith(OUTPUT_CUT_NOTE):
            self.mark_incomplete("rank 0's supervisor stopped reading its output early")
        for line in lines:
            self._lines.append(line)
            self._bytes += len(line) + 1
        while self._bytes > SCRIPT_OUTPUT_CAP and len(self._lines) > 1:
            self._bytes -= len(self._lines.popleft()) + 1
            self.truncated = True

    def mark_incomplete(self, reason: str) -> None:
        """Output of the run may be missing at its end (the first reason is kept)."""
        if self.incomplete is None:
            self.incomplete = reason

    @property
    def cut(self) -> bool:
        """Whether the value is not all of rank 0's stdout (cut or incomplete)."""
        return self.truncated or self.incomplete is not None

    def text(self) -> str:
        """Rank 0's stdout (its tail, with a note, when it exceeded the cap; with a note at the
        end when output may be missing)."""
        text = "\n".join(self._lines) + ("\n" if self._lines else "")
        # The notes are part of the value on purpose: a caller must not mistake a part for all.
        if self.truncated:
            note = f"[sparktorch_ops: output cut to its last {SCRIPT_OUTPUT_CAP} bytes]"
            text = f"{note}\n{text}"
        if self.incomplete is not None:
            text += f"[sparktorch_ops: output may be incomplete: {self.incomplete}]\n"
        return text


class Forwarder:
    """Output lines to the run's logger as they arrive, prefixed with rank (or agent) and host.

    Args:
        log: receives every forwarded line.
        log_ranks: ranks whose lines are forwarded (None: all); every rank's tail keeps them.
    """

    def __init__(self, log: Any, log_ranks: frozenset[int] | None) -> None:
        self._log = log
        self._log_ranks = log_ranks
        self.tearing_down = False

    def rank(self, rank: int, host: str, level: int, lines: list[str]) -> None:
        """A rank's lines at ``level`` (stdout at INFO, stderr at WARNING)."""
        if self._log_ranks is None or rank in self._log_ranks:
            self._emit(level, f"[rank {rank}|{host}]", lines)

    def agent(self, node: int, host: str, stderr: bool, lines: list[str]) -> None:
        """A node's torchrun agent's lines."""
        # While tearing down, torchrun's own traceback about the signal we sent is not news.
        level = logging.WARNING if stderr else logging.INFO
        if self.tearing_down:
            level = logging.DEBUG
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
