"""The warm agent: a process that has imported torch and forks each run's torchrun agent.

Started by :mod:`sparktorch_ops.node.prefork` with the first run of a launcher (the driver in local
mode, a Spark Python worker in barrier mode) as ``python -m sparktorch_ops.node.forkserver FD``, it
imports what an agent imports (torch, torchrun, the rank bootstrap) once, then waits. Each run
sends it the agent's argv, environment and working directory with three file descriptors (the
run's own socket, the agent's stdout and stderr); it forks, and the child becomes that run's
agent exactly as ``python -m sparktorch_ops.node.agent`` would, minus the interpreter start and the
imports (DESIGN section 9). This process never runs a run's code itself, so nothing a run does
(environment, imported modules, thread settings) is seen by the next: each agent is a fresh
fork of the same untouched image. A barrier task 0 also asks it for its run's rendezvous store
(one socket, ``{"store": host}``): a forked child hosts torch's TCPStore on a port the OS picks
and keeps it while the task holds the socket, so the task's own Python never imports torch.

Lifetime: the server reports each agent's pid and exit status on the run's socket and stops an
agent whose run socket closes first (its launcher gave up or died). When the control socket
closes (the launcher dropped this server, or died) it takes no more runs and leaves once its
agents are gone; when its parent dies it stops every agent and leaves at once. When its imports
fail (torch missing or broken), it forks nothing: it answers every run with the error.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, NoReturn

from sparktorch_ops.wire.env import RUN_ID_ENV, WARM_PROCESS_ENV

#: Marks the warm agent in the process table (value: a token of its launcher); the entry is the
#: last of the server's environment and long enough for a run's marker to take its place.
MARKER_SLOT_CHARS = 96
_MAX_REQUEST_BYTES = 16 << 20
_POLL_S = 1.0
_TERMINATE_GRACE_S = 5.0


def slot_value(token: str) -> str:
    """The warm marker's value: the token, padded so that a run id fits in its place."""
    return token.ljust(MARKER_SLOT_CHARS, "~")


def _own_areas() -> tuple[int, int, int, int] | None:
    """Where the kernel keeps this process's argv and environment (``/proc/self/stat``)."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        # arg_start, arg_end, env_start, env_end: fields 48-51 (Linux >= 3.5)
        return int(fields[45]), int(fields[46]), int(fields[47]), int(fields[48])
    except (OSError, IndexError, ValueError):
        return None


def rewrite_marker(entry: str) -> bool:
    """Put ``entry`` (``NAME=value``) where this process's warm marker is in the environment
    the process table shows (``/proc/PID/environ``, the block the kernel gave ``exec``).

    A forked agent's block is the server's: without this, neither it nor the supervisors and
    ranks it forks would carry their run's marker, by which the launcher's sweep (and anyone
    reading the process table) finds every process of a run. Returns whether it did.
    """
    areas = _own_areas()
    if areas is None:
        return False
    start, end = areas[2], areas[3]
    block = ctypes.string_at(start, end - start)
    offset = block.rfind(f"{WARM_PROCESS_ENV}=".encode())
    if offset < 0 or (offset > 0 and block[offset - 1] != 0):
        return False
    length = block.index(b"\0", offset) - offset
    data = entry.encode()
    if len(data) > length:
        return False
    # NUL padding ends the block for readers: the slot is the block's last entry.
    ctypes.memmove(start + offset, data + b"\0" * (length - len(data)), length)
    return True


def rewrite_command_line(argv: list[str]) -> bool:
    """Show ``argv`` as this process's command line (``ps``, ``/proc/PID/cmdline``), in the
    room the server's own (padded) command line leaves: a forked agent looks like the
    ``python -m sparktorch_ops.node.agent RUN_ID ...`` it stands for. What does not fit is cut to
    the first four arguments; the last argument is padded with spaces."""
    areas = _own_areas()
    if areas is None:
        return False
    start, end = areas[0], areas[1]
    room = end - start - 1  # the area ends with a NUL
    for shown in (argv, argv[:4]):
        data = "\0".join(shown).encode()
        if len(data) <= room:
            ctypes.memmove(start, data + b" " * (room - len(data)) + b"\0", room + 1)
            return True
    return False


def command_line_room(argv: list[str]) -> str:
    """The padding argument that leaves room for ``argv`` (and a little more) in the
    server's command line."""
    return "~" * (len("\0".join(argv)) + 128)


@dataclass
class _Agent:
    pid: int
    pidfd: int
    sock: socket.socket
    kill_at: float | None = None


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        sock.send(json.dumps(message).encode())


def _enter_run(run_id: str, argv: list[str], inherited: list[int]) -> None:
    """In a forked child: its own session (as a Popen'd agent's: a terminal's Ctrl-C is not
    for it), none of the server's descriptors, and the run's marker and ``argv`` in the
    process table."""
    os.setsid()
    for fd in inherited:
        with contextlib.suppress(OSError):
            os.close(fd)
    rewrite_marker(f"{RUN_ID_ENV}={run_id}")
    rewrite_command_line(argv)


def _become_agent(request: dict[str, Any], outputs: list[int], inherited: list[int]) -> NoReturn:
    """In the forked child: take the run's stdio (``outputs``: stdout and stderr),
    environment and directory, then run the agent (never returns)."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        for target, source in enumerate((null, *outputs)):
            os.dup2(source, target)
        env: dict[str, str] = request["env"]
        argv: list[str] = request["argv"]
        _enter_run(env.get(RUN_ID_ENV, ""), argv, [null, *inherited])
        cwd = request["cwd"]
        if sys.path and sys.path[0] == os.getcwd():  # ``-m`` put the start directory first
            sys.path[0] = cwd
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        from sparktorch_ops.node import agent

        sys.argv = [agent.__file__, *argv[3:]]  # as ``python -m sparktorch_ops.node.agent ...``
        agent.run(expected_parent=os.getppid())
    except BaseException:  # pragma: no cover - reported through the agent's stderr
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _become_store(
    request: dict[str, Any], run_sock: socket.socket, inherited: list[int]
) -> NoReturn:
    """In the forked child: host a run's rendezvous store (torch's TCPStore) on a port the OS
    picks, say which on the run's socket, and keep it until that socket closes: the barrier
    task that asked holds it for its whole run (never returns). It carries the run's marker,
    as the run's other processes do."""
    code = 1
    try:
        run_id = str(request.get("run_id", ""))
        shown = [sys.executable, "-m", "sparktorch_ops.node.forkserver", "store", run_id]
        _enter_run(run_id, shown, [fd for fd in inherited if fd != run_sock.fileno()])
        from torch.distributed import TCPStore

        host = str(request["store"])
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False, multi_tenant=True)
        _send(run_sock, {"pid": os.getpid(), "port": int(store.port)})
        while run_sock.recv(1 << 10):
            pass
        code = 0
    except BaseException as exc:  # pragma: no cover - reported to the task that asked
        _send(run_sock, {"error": f"{type(exc).__name__}: {exc}"})
    finally:
        os._exit(code)


class _Server:
    def __init__(self, control: socket.socket, parent: int, import_error: str | None) -> None:
        self.control = control
        self.parent = parent
        self.import_error = import_error
        self.accepting = True
        self.agents: dict[int, _Agent] = {}  # by pidfd

    def serve(self) -> None:
        while self.accepting or self.agents:
            if os.getppid() != self.parent:  # the launcher died: nothing may outlive it
                self._stop_all()
                return
            watched: list[Any] = [self.control] if self.accepting else []
            for agent in self.agents.values():
                watched += [agent.pidfd, agent.sock]
            ready, _, _ = select.select(watched, [], [], _POLL_S)
            for item in ready:
                if item is self.control:
                    self._take_request()
                elif isinstance(item, int):
                    self._reap(self.agents[item])
                else:
                    self._on_run_socket(item)
            self._escalate()

    def _take_request(self) -> None:
        try:
            message, fds, _, _ = socket.recv_fds(self.control, _MAX_REQUEST_BYTES, 3)
        except OSError:
            message, fds = b"", []
        if not message or len(fds) not in (1, 3):
            for fd in fds:
                os.close(fd)
            if not message:
                self.accepting = False  # dropped by the launcher: no more runs
            return
        # The run's socket; for an agent, its stdout and stderr too (a store has no output).
        run_fd, *outputs = fds
        run_sock = socket.socket(fileno=run_fd)
        refusal = None
        if self.import_error is not None:
            refusal = {"refused": "its imports failed", "import_error": self.import_error}
        else:
            from sparktorch_ops.rank.bootstrap import fork_keeps_cuda_usable

            if not fork_keeps_cuda_usable():
                # A fork of a process that touched CUDA could not use it: the launcher must
                # start a fresh interpreter, and drop this server.
                refusal = {"refused": "this warm process has initialised CUDA"}
        if refusal is not None:
            _send(run_sock, refusal)
            for fd in outputs:
                os.close(fd)
            run_sock.close()
            return
        request = json.loads(message)
        inherited = [self.control.fileno(), run_fd, *outputs]
        for agent in self.agents.values():
            inherited += [agent.pidfd, agent.sock.fileno()]
        pid = os.fork()
        if pid == 0:
            if "store" in request:
                _become_store(request, run_sock, inherited)
            _become_agent(request, outputs, inherited)
        for fd in outputs:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.agents[pidfd] = _Agent(pid, pidfd, run_sock)
        if "store" not in request:  # a store says its pid with its port
            _send(run_sock, {"pid": pid})

    def _reap(self, agent: _Agent) -> None:
        _, status = os.waitpid(agent.pid, 0)
        _send(agent.sock, {"exit": os.waitstatus_to_exitcode(status)})
        self._forget(agent)

    def _on_run_socket(self, sock: socket.socket) -> None:
        """The launcher closed a run's socket before its agent exited: stop the agent."""
        try:
            data = sock.recv(1 << 10)
        except OSError:
            data = b""
        if data:
            return
        for agent in list(self.agents.values()):
            if agent.sock is sock and agent.kill_at is None:
                self._terminate(agent)

    def _terminate(self, agent: _Agent) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent.pid, signal.SIGTERM)
        agent.kill_at = time.monotonic() + _TERMINATE_GRACE_S

    def _escalate(self) -> None:
        now = time.monotonic()
        for agent in self.agents.values():
            if agent.kill_at is not None and now > agent.kill_at:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(agent.pid, signal.SIGKILL)

    def _forget(self, agent: _Agent) -> None:
        del self.agents[agent.pidfd]
        os.close(agent.pidfd)
        agent.sock.close()

    def _stop_all(self) -> None:
        for agent in self.agents.values():
            self._terminate(agent)
        deadline = time.monotonic() + _TERMINATE_GRACE_S
        while self.agents and time.monotonic() < deadline:
            ready, _, _ = select.select(list(self.agents), [], [], 0.1)
            for pidfd in ready:
                self._reap(self.agents[pidfd])
        for agent in list(self.agents.values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent.pid, signal.SIGKILL)
            self._reap(agent)


def main() -> None:
    """Entry point: ``python -m sparktorch_ops.node.forkserver CONTROL_FD LAUNCHER_PID ROOM``
    (``ROOM``: padding, the space a forked agent's command line takes)."""
    control = socket.socket(fileno=int(sys.argv[1]))
    launcher = int(sys.argv[2])
    # No parent-death signal: it fires when the launcher's *thread* that started this process
    # ends (a Prefect task's worker thread), not the launcher. The serve loop watches the
    # parent instead, and the control socket closes with the launcher.
    # A Spark Python worker may ignore SIGCHLD; exit statuses must be collectable here.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # What an agent would import first thing, so that no run pays for it. A failure is each
    # run's news (this interpreter cannot run ranks: torch missing or broken): the server
    # stays, answering every run with it, until the launcher drops it.
    import_error = None
    try:
        from sparktorch_ops.rank.pickling import cloudpickle_module

        cloudpickle_module()
        import torch.distributed.run  # noqa: F401

        import sparktorch_ops.node.agent
        import sparktorch_ops.rank.bootstrap  # noqa: F401
    except Exception as exc:
        import_error = f"{type(exc).__name__}: {exc}"

    # Children inherit these objects; keep the collector off them, so that collections in the
    # agents and ranks neither walk them nor copy their shared pages.
    gc.freeze()
    _send(control, {"ready": os.getpid()})
    _Server(control, launcher, import_error).serve()
    os._exit(0)


if __name__ == "__main__":
    main()
