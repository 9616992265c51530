"""Processes: die-with-parent, output line splitting, and tree termination."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:  # not Linux: the watchdogs alone keep ranks from outliving their parents
    _libc = None

# A line longer than this is delivered in pieces of this size (no log record may eat all memory).
MAX_LINE_BYTES = 8 << 20
# A progress bar redrawn with '\r' is logged at most this often; its last state always is.
CARRIAGE_RETURN_INTERVAL_S = 5.0


def set_parent_death_signal(signum: int) -> None:
    """Ask Linux to send ``signum`` to this process when its parent thread exits."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


def exit_status(exc: SystemExit) -> int:
    """The process exit status the interpreter would give for ``exc``."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")  # as the interpreter does for sys.exit("message")
    return 1


def finish_like_an_interpreter() -> None:
    """What interpreter exit does that matters before ``os._exit``: wait for non-daemon
    threads, run the exit handlers, flush stdout and stderr. (The rest, tearing down every
    module and object of torch, costs a third of a second and changes nothing.)"""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def set_process_name(name: str) -> None:
    """Name this process in ``ps -o comm``/``top`` (15 bytes): forked ranks share the agent's
    command line, so the name is what tells them apart."""
    if _libc is not None:
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def die_with_parent(signum: int, expected_parent: int) -> None:
    """Set the death signal and close the race where the parent died before it was set."""
    set_parent_death_signal(signum)
    if os.getppid() != expected_parent:
        os.kill(os.getpid(), signum)


def start_parent_watchdog(on_orphaned: Callable[[], None], interval: float = 1.0) -> None:
    """Call ``on_orphaned`` once the parent process is gone (the backup to PDEATHSIG)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        on_orphaned()

    threading.Thread(target=watch, name="sparktorch-parent-watchdog", daemon=True).start()


class LineSplitter:
    """Turns a byte stream into text lines.

    Invalid UTF-8 is replaced, never fatal. A line redrawn with ``\\r`` (tqdm, Lightning) keeps
    only its latest state, emitted at most every ``CARRIAGE_RETURN_INTERVAL_S`` and once more
    when the line ends. Lines longer than ``MAX_LINE_BYTES`` come out in pieces.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._partial = bytearray()
        self._clock = clock
        self._last_redraw_emit = clock()

    def feed(self, data: bytes) -> list[str]:
        """Add bytes; return the lines they completed."""
        lines: list[str] = []
        self._partial += data
        newline = self._partial.rfind(b"\n")
        if newline >= 0:
            # Whole chunks are decoded at once: '\n' never occurs inside a UTF-8 sequence.
            complete = bytes(self._partial[:newline])
            del self._partial[: newline + 1]
            lines = _decode(complete).split("\n")
            if b"\r" in complete:
                lines = [line.rstrip("\r").rpartition("\r")[2] for line in lines]
        if b"\r" in self._partial:
            latest = _latest_redraw(bytes(self._partial))
            self._partial = bytearray(latest)
            now = self._clock()
            if latest.strip() and now - self._last_redraw_emit >= CARRIAGE_RETURN_INTERVAL_S:
                self._last_redraw_emit = now
                lines.append(_decode(latest))
        while len(self._partial) > MAX_LINE_BYTES:
            lines.append(_decode(bytes(self._partial[:MAX_LINE_BYTES])))
            del self._partial[:MAX_LINE_BYTES]
        return lines

    def finish(self) -> list[str]:
        """The last unterminated line, if any."""
        rest = _latest_redraw(bytes(self._partial))
        self._partial.clear()
        return [_decode(rest)] if rest else []


def _latest_redraw(raw: bytes) -> bytes:
    """The text after the last carriage return that is followed by something."""
    return raw.rstrip(b"\r").rpartition(b"\r")[2]


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def read_until_eof(stream: IO[bytes]) -> Iterator[bytes]:
    """The bytes of ``stream`` as they arrive, to its end (or a read error)."""
    fd = stream.fileno()
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except OSError:
            return
        if not data:
            return
        yield data


def pump_lines(
    stream: IO[bytes], emit: Callable[[list[str]], None], chunks: Iterable[bytes] | None = None
) -> None:
    """Hand each batch of complete lines of ``stream`` to ``emit``, then its unfinished tail.

    Args:
        stream: what to read.
        emit: called with the lines of each chunk read (none for a chunk without a newline).
        chunks: the bytes to split, when the caller reads ``stream`` itself (default:
            :func:`read_until_eof`).
    """
    splitter = LineSplitter()
    for data in read_until_eof(stream) if chunks is None else chunks:
        lines = splitter.feed(data)
        if lines:
            emit(lines)
    tail = splitter.finish()
    if tail:
        emit(tail)


class ForkedChild:
    """A child made with ``os.fork`` whose output is piped back, with a ``Popen``-like surface.

    Only the thread that calls :meth:`wait` reaps the child; other threads may signal it until
    ``returncode`` is set.
    """

    def __init__(self, run_child: Callable[[], int]) -> None:
        """Fork; the child dies with this process, gets the pipes as fd 1 and 2 and /dev/null
        as stdin, runs ``run_child`` and exits with its status (1 if it raises)."""
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # else buffered text would be written twice, once by the child
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child; covered through the rank tests
            code = 1
            try:
                set_parent_death_signal(signal.SIGKILL)
                if os.getppid() == 1:
                    os._exit(code)
                null = os.open(os.devnull, os.O_RDONLY)
                for target, source in ((0, null), (1, out_write), (2, err_write)):
                    os.dup2(source, target)
                for fd in (null, out_read, out_write, err_read, err_write):
                    os.close(fd)
                code = run_child()
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(out_write)
        os.close(err_write)
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = os.fdopen(out_read, "rb", buffering=0)
        self.stderr = os.fdopen(err_read, "rb", buffering=0)

    def poll(self) -> int | None:
        """The exit status once :meth:`wait` has reaped the child, else None."""
        return self.returncode

    def wait(self) -> int:
        """Reap the child; its exit code, or ``-signal`` when a signal killed it."""
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Signal the child unless it has been reaped (its pid could be someone else's)."""
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL the child."""
        self.send_signal(signal.SIGKILL)


@dataclass(frozen=True)
class ProcessHandle:
    """A process by its pid and its start time, so that a pid the kernel has since given to
    another process is never signalled (read from ``/proc``: the executors need no psutil)."""

    pid: int
    started: int  # clock ticks after boot (/proc/<pid>/stat, field 22)

    @classmethod
    def of(cls, pid: int) -> ProcessHandle | None:
        """The process ``pid`` now, or None when there is none."""
        stat = _stat(pid)
        return None if stat is None else cls(pid, stat.started)

    def running(self) -> bool:
        """Whether this very process still runs (a zombie has ended)."""
        stat = _stat(self.pid)
        return stat is not None and stat.started == self.started and stat.state not in "ZX"

    def send_signal(self, signum: int) -> bool:
        """Signal the process if it still runs; whether the signal was sent."""
        if not self.running():
            return False
        try:
            os.kill(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            return False
        return True


@dataclass(frozen=True)
class _Stat:
    state: str
    parent: int
    started: int


def _stat(pid: int) -> _Stat | None:
    """Fields of ``/proc/<pid>/stat`` (the command name may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            text = file.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return _Stat(state=fields[0], parent=int(fields[1]), started=int(fields[19]))


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def tree_of(pid: int) -> list[ProcessHandle]:
    """The process and all its descendants that are still alive (parents first)."""
    root = ProcessHandle.of(pid)
    if root is None:
        return []
    children: dict[int, list[ProcessHandle]] = {}
    for other in _pids():
        stat = _stat(other)
        if stat is not None:
            children.setdefault(stat.parent, []).append(ProcessHandle(other, stat.started))
    found, index = [root], 0
    while index < len(found):
        found.extend(children.get(found[index].pid, []))
        index += 1
    return [proc for proc in found if proc.running()]


def _wait_gone(processes: list[ProcessHandle], timeout: float) -> list[ProcessHandle]:
    """Wait up to ``timeout`` seconds for the processes to end; the ones still running."""
    deadline = time.monotonic() + timeout
    alive = [proc for proc in processes if proc.running()]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [proc for proc in alive if proc.running()]
    return alive


def terminate_processes(processes: Iterable[ProcessHandle], grace: float = 5.0) -> None:
    """SIGTERM every process, wait up to ``grace`` seconds, then SIGKILL the survivors.

    Safe to call twice and on processes that already exited.
    """
    signalled = [proc for proc in processes if proc.send_signal(signal.SIGTERM)]
    survivors = _wait_gone(signalled, grace)
    for proc in survivors:
        proc.send_signal(signal.SIGKILL)
    _wait_gone(survivors, 5.0)


def terminate_tree(pid: int, grace: float = 5.0) -> None:
    """Terminate a process and every descendant, found before the first signal is sent.

    The tree is read first because torchrun starts its workers in their own sessions: a
    process-group kill would miss them.
    """
    terminate_processes(tree_of(pid), grace)


def marked_processes(marker_env: str, value: str) -> list[ProcessHandle]:
    """Processes of this user whose environment has ``marker_env=value`` (ours excluded)."""
    found = []
    me, wanted = os.getpid(), f"{marker_env}={value}".encode()
    for pid in _pids():
        if pid == me:
            continue
        proc = ProcessHandle.of(pid)
        try:
            with open(f"/proc/{pid}/environ", "rb") as file:
                environ = file.read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        if proc is not None and wanted in environ:
            found.append(proc)
    return found
