"""Where a rank's threads are: its stacks, taken on request, for stalls and stops.

The supervisor (:mod:`sparktorch_ops.rank.bootstrap`) holds one end of a socket pair and of a
pipe; the rank process holds the others (named in :data:`~sparktorch_ops.wire.env.STACK_FDS_ENV`).
Asked by the driver, the supervisor writes a byte on the socket and a helper thread of the rank
answers with every thread's stack (``sys._current_frames``, the training thread first). A rank
whose helper cannot run (the training thread holds the GIL in C code) gets :data:`STACK_SIGNAL`:
``faulthandler`` dumps its threads into the pipe from the signal handler itself. A rank that
answers neither (stopped, or gone) is reported as such. Standard library only.
"""

from __future__ import annotations

import faulthandler
import os
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType

#: Not SIGUSR1 (Lightning's) nor SIGUSR2 (preemption handlers'): a real-time signal of our own.
STACK_SIGNAL = signal.SIGRTMIN + 4
THREADS_ANSWER_S = 1.0  # how long the helper thread has to answer
DUMP_ANSWER_S = 0.8  # then faulthandler; together under the driver's capture cap
_END = b"\0"
_MAX_TEXT = 256 << 10
_QUIET_S = 0.1  # a faulthandler dump is complete once the pipe is quiet this long
_FRAME_LINE = re.compile(r'^\s*File "(?P<path>[^"]*)", line (?P<line>\d+) in (?P<name>\S+)')


@dataclass(frozen=True)
class Stacks:
    """What a rank answered: every thread's stack, the training thread's innermost frame in one
    line (``"in fn (train.py:40) <- time.sleep(60)"``), and how it was taken."""

    text: str
    where: str
    source: str  # one of wire.messages.STACK_SOURCES


def _format_stack(frame: FrameType, entry: CodeType | None) -> list[str]:
    """``frame``'s stack, outermost first, from below ``entry`` (the code that calls the user's)
    when ``entry`` is on it, so a stack shows training, not the launcher's frames above it."""
    inner: list[FrameType] = []
    walker: FrameType | None = frame
    while walker is not None and walker.f_code is not entry:
        inner.append(walker)
        walker = walker.f_back
    if walker is None:
        return traceback.format_stack(frame)
    summary = traceback.StackSummary.extract((f, f.f_lineno) for f in reversed(inner))
    return summary.format()


def format_threads(skip: int | None = None, entry: CodeType | None = None) -> Stacks:
    """Every thread of this process (but ``skip``), the main (training) thread first; frames
    outside ``entry`` (the code that calls the user's) are left out."""
    frames = sys._current_frames()
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    order = sorted(
        (ident for ident in frames if ident != skip), key=lambda ident: (ident != main, ident)
    )
    parts = []
    where = "in no Python code"
    for ident in order:
        frame = frames[ident]
        name = names.get(ident, f"0x{ident:x}")
        parts.append(f"Thread {name} (most recent call last):\n")
        parts.extend(_format_stack(frame, entry))
        if ident == order[0]:
            summary = traceback.extract_stack(frame, limit=1)[-1]
            where = f"in {summary.name} ({os.path.basename(summary.filename)}:{summary.lineno})"
            if summary.line:
                where += f" <- {summary.line.strip()}"
    del frames
    return Stacks(_cap("".join(parts)), where, "threads")


def tidy_dump(text: str, entry: CodeType | None = None) -> str:
    """A ``faulthandler`` dump with the thread that took the signal (the training thread)
    first, and each thread's frames from ``entry`` outwards (the launcher's) left out."""
    blocks = [block for block in text.strip("\n").split("\n\n") if block.strip()]
    blocks.sort(key=lambda block: not block.startswith("Current thread"))
    if entry is not None:
        marker = f'File "{entry.co_filename}", line '
        for index, block in enumerate(blocks):
            lines = block.splitlines()
            for cut, line in enumerate(lines):
                if marker in line and line.endswith(f" in {entry.co_name}"):
                    blocks[index] = "\n".join(lines[:cut])
                    break
    return "\n\n".join(blocks) + "\n"


def where_in_dump(text: str) -> str:
    """The innermost frame of the first thread of a ``faulthandler`` dump, in one line."""
    for line in text.splitlines():
        match = _FRAME_LINE.match(line)
        if match:
            path = os.path.basename(match["path"])
            return f"in {match['name']} ({path}:{match['line']})"
    return "in no Python code"


def _cap(text: str) -> str:
    if len(text) <= _MAX_TEXT:
        return text
    return text[:_MAX_TEXT] + "\n[sparktorch_ops: stacks cut]\n"


# -- in the rank ------------------------------------------------------------------------------
def serve(fds: str, entry: CodeType | None = None) -> None:
    """In the rank process: answer stack requests on the first fd of ``fds`` (``"REQ,DUMP"``)
    from a daemon thread, and let :data:`STACK_SIGNAL` dump every thread into the second.
    Stacks start below ``entry``, the function that calls the user's code."""
    request_fd, dump_fd = (int(fd) for fd in fds.split(","))
    faulthandler.register(STACK_SIGNAL, file=dump_fd, all_threads=True)
    line = socket.socket(fileno=request_fd)

    def answer() -> None:  # first line: where the training thread is; then every stack
        me = threading.get_ident()
        while True:
            try:
                if not line.recv(1):
                    return  # the supervisor is gone
                stacks = format_threads(skip=me, entry=entry)
                line.sendall(f"{stacks.where}\n{stacks.text}".encode("utf-8", "replace") + _END)
            except OSError:
                return

    threading.Thread(target=answer, name="sparktorch-stacks", daemon=True).start()


# -- in the supervisor ------------------------------------------------------------------------
class StackLine:
    """The supervisor's ends of the rank's stack line; made before the rank is started.

    ``child_fds`` are the rank's ends (inherited by a fork, passed to a fresh interpreter);
    :meth:`started` closes this process's copies of them.
    """

    def __init__(self, entry: CodeType | None = None) -> None:
        self._entry = entry  # the function that calls the user's code, as in serve()
        self._request, request_child = socket.socketpair()
        self._dump, dump_child = os.pipe()
        self._children = (request_child, dump_child)
        self.child_fds = f"{request_child.fileno()},{dump_child}"
        self._lock = threading.Lock()

    def pass_fds(self) -> tuple[int, int]:
        """The fds a fresh interpreter must inherit."""
        return self._children[0].fileno(), self._children[1]

    def started(self) -> None:
        """The rank has its ends: close this process's copies of them."""
        request_child, dump_child = self._children
        request_child.close()
        os.close(dump_child)

    def close_in_child(self) -> None:
        """In the forked rank: close the supervisor's ends (they are not the rank's)."""
        self._request.close()
        os.close(self._dump)

    def ask(self, send_signal: Callable[[int], None]) -> Stacks:
        """The rank's stacks: from its helper thread, else from faulthandler, else none.

        Args:
            send_signal: signals the rank process (a no-op once it has been reaped).

        Takes at most about ``THREADS_ANSWER_S + DUMP_ANSWER_S``; one request at a time.
        """
        with self._lock:
            _drain(self._request.fileno())
            _drain(self._dump)
            try:
                self._request.sendall(b"?")
                answer = _read(self._request.fileno(), THREADS_ANSWER_S, dump=False)
            except OSError:
                answer = b""
            if answer.endswith(_END):
                where, _, stacks = answer[:-1].decode("utf-8", "replace").partition("\n")
                return Stacks(stacks, where, "threads")
            try:
                send_signal(STACK_SIGNAL)
            except OSError:
                return Stacks("", "did not answer: the rank process is gone", "none")
            dump = _cap(_read(self._dump, DUMP_ANSWER_S, dump=True).decode("utf-8", "replace"))
            if dump:
                dump = tidy_dump(dump, self._entry)
                note = "[the rank's helper thread did not answer: faulthandler's dump]\n"
                return Stacks(note + dump, where_in_dump(dump), "faulthandler")
            waited = THREADS_ANSWER_S + DUMP_ANSWER_S
            return Stacks("", f"did not answer within {waited:g} s", "none")


def _drain(fd: int) -> None:
    """Drop a late answer to an earlier request."""
    while select.select([fd], [], [], 0)[0]:
        if not os.read(fd, 1 << 16):
            return


def _read(fd: int, timeout: float, dump: bool) -> bytes:
    """What arrives on ``fd`` within ``timeout``: up to the helper's end marker, or for a
    faulthandler ``dump`` (which has none) until the pipe is quiet for ``_QUIET_S``."""
    deadline = time.monotonic() + timeout
    data = bytearray()
    while dump or not data.endswith(_END):
        remaining = deadline - time.monotonic()
        wait = min(remaining, _QUIET_S) if dump and data else remaining
        if wait <= 0 or not select.select([fd], [], [], wait)[0]:
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        data += chunk
    return bytes(data)
