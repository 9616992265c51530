"""Starting a run's torchrun agent from a warm process (DESIGN section 9), else cold.

A launcher (the driver in local mode, each barrier task's Spark Python worker) keeps one warm
agent per interpreter, :mod:`sparktorch_ops.node.forkserver`, started with its first run and reused
by the later ones while it lives: each run's agent is forked from it with torch already
imported, instead of starting an interpreter and importing torch (1.4 s locally, 2.4 s per task
in barrier mode on 2 cores). The fork server never runs a run's code, so runs cannot see each
other's environment, modules or thread settings.

When the warm process is not used: ``SPARKTORCH_OPS_WARM_AGENT=0`` in the launcher's
environment; a platform without ``pidfd_open``; an agent environment that differs from the one
the warm process started with in what torch's import may read (anything but the run's own
variables, its GPUs and a torch group's ranks: a new warm process takes its place); a warm
process that has initialised CUDA (refused: a fork could not use it). A warm process is dropped
after any run that did not succeed (failure, cancel, timeout), so none is left after those; it
goes with its launcher. A warm process whose imports failed (torch missing or broken) answers
each run with its error, which :func:`start_agent` raises (:class:`TorchImportError`): a cold
agent would only fail the same way, later and less clearly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Any

from sparktorch_ops.node.forkserver import command_line_room, slot_value
from sparktorch_ops.node.process import (
    ProcessHandle,
    marked_processes,
    pump_lines,
    terminate_processes,
    terminate_tree,
)
from sparktorch_ops.wire.env import (
    PER_RUN_VARIABLES,
    RUN_ID_ENV,
    TORCH_GROUP_VARIABLES,
    WARM_AGENT_ENV,
    WARM_PROCESS_ENV,
)

# How long a run waits for the warm process to fork its agent (its first run includes the
# imports, which a cold agent would pay the same); past it, the run starts a cold agent.
_FORK_TIMEOUT_S = 120.0
# Our own variables, which the warm process's imports never read: those of a run, and any
# other SPARKTORCH_* a caller sets for its own code.
_OWN_PREFIX = "SPARKTORCH_"
# Read only once a process starts CUDA or joins a process group, never by torch's import (the
# warm process does neither): the GPUs Spark assigns a run, and a torch group's ranks.
_READ_AFTER_IMPORT = TORCH_GROUP_VARIABLES | {"CUDA_VISIBLE_DEVICES"}

_log = logging.getLogger(__name__)


class WarmUnavailable(Exception):
    """The warm process could not fork this run's agent (the run starts a cold one)."""


class TorchImportError(Exception):
    """The interpreter cannot import what an agent needs (torch): no agent can start on it."""


def warm_enabled(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether runs started by this process may use a warm agent."""
    setting = environ.get(WARM_AGENT_ENV, "1").strip().lower()
    return setting not in {"0", "false", "no", "off"} and hasattr(os, "pidfd_open")


def import_environment(env: dict[str, str]) -> dict[str, str]:
    """The part of an agent's environment that its imports may read: all but the run's own
    variables and those torch reads only after its import."""
    return {
        k: v
        for k, v in env.items()
        if not k.startswith(_OWN_PREFIX)
        and k not in PER_RUN_VARIABLES
        and k not in _READ_AFTER_IMPORT
    }


class WarmServer:
    """The launcher's handle on one fork server."""

    def __init__(self, python: str, env: dict[str, str], room_for: list[str]) -> None:
        self.python = python
        self.env = env
        self._lock = threading.Lock()
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        token = f"{os.getpid()}-{secrets.token_hex(8)}"
        try:
            # The marker comes last: a forked agent writes its run's marker in its place.
            self.proc = subprocess.Popen(
                [
                    python,
                    "-m",
                    "sparktorch_ops.node.forkserver",
                    str(theirs.fileno()),
                    str(os.getpid()),
                    command_line_room(room_for),
                ],
                env={
                    **{k: v for k, v in env.items() if k != WARM_PROCESS_ENV},
                    WARM_PROCESS_ENV: slot_value(token),
                },
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            theirs.close()

    def alive(self) -> bool:
        """Whether the server still runs and takes runs."""
        return self.proc.poll() is None and self._control.fileno() >= 0

    def fork_agent(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        on_stdout: Callable[[list[str]], None],
        on_stderr: Callable[[list[str]], None],
    ) -> ForkedAgent:
        """Have the server fork this run's agent.

        Raises:
            WarmUnavailable: the server is gone, refused, or did not answer in time.
            TorchImportError: the server could not import torch.
        """
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        try:
            sock, reply = self._ask({"argv": argv, "env": env, "cwd": cwd}, [out_write, err_write])
        except BaseException:
            os.close(out_read)
            os.close(err_read)
            raise
        return ForkedAgent(self, int(reply["pid"]), sock, out_read, err_read, on_stdout, on_stderr)

    def host_store(self, host: str, run_id: str) -> HostedStore:
        """Have the server fork a child that hosts run ``run_id``'s rendezvous store on
        ``host``.

        Raises:
            WarmUnavailable: the server is gone, refused, or did not answer in time.
            TorchImportError: the server could not import torch.
        """
        sock, reply = self._ask({"store": host, "run_id": run_id}, [])
        return HostedStore(int(reply["port"]), sock)

    def _ask(self, request: dict[str, Any], fds: list[int]) -> tuple[socket.socket, dict[str, Any]]:
        """Send ``request`` with a new socket's far end and ``fds`` (closed here either way);
        the near end, which the child's run holds, and the server's reply."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with self._lock:
                message = [json.dumps(request).encode()]
                socket.send_fds(self._control, message, [theirs.fileno(), *fds])
        except OSError as exc:
            mine.close()
            raise WarmUnavailable(f"the warm agent is gone ({exc})") from exc
        finally:
            theirs.close()
            for fd in fds:
                os.close(fd)
        try:
            return mine, self._await_reply(mine)
        except BaseException:
            mine.close()
            raise

    def _await_reply(self, sock: socket.socket) -> dict[str, Any]:
        deadline = time.monotonic() + _FORK_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([sock], [], [], 0.25)
            if ready:
                data = sock.recv(1 << 16)
                if not data:
                    raise WarmUnavailable("the warm agent exited before it forked the run's agent")
                reply: dict[str, Any] = json.loads(data)
                if "import_error" in reply:
                    raise TorchImportError(str(reply["import_error"]))
                if "pid" not in reply:
                    refusal = reply.get("refused") or reply.get("error")
                    raise WarmUnavailable(f"the warm agent refused: {refusal}")
                return reply
            if self.proc.poll() is not None:
                raise WarmUnavailable(f"the warm agent exited with code {self.proc.returncode}")
        raise WarmUnavailable(f"the warm agent did not fork within {_FORK_TIMEOUT_S:g} s")

    def close(self) -> None:
        """Take no more runs; the server leaves once its agents have (idempotent)."""
        with self._lock:
            if self._control.fileno() < 0:
                return
            self._control.close()
        # Reap it when it leaves (no zombie in the process table).
        threading.Thread(target=self.proc.wait, name="sparktorch-warm-reaper", daemon=True).start()

    def kill(self) -> None:
        """Stop the server now (its agents get SIGTERM from their parent's death)."""
        self.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


class HostedStore:
    """A run's rendezvous store, hosted by a child of the warm process for as long as this
    object is open (the child leaves when :meth:`close` closes its socket)."""

    def __init__(self, port: int, sock: socket.socket) -> None:
        self.port = port
        self._sock = sock

    def close(self) -> None:
        """Let the store go (idempotent)."""
        self._sock.close()


class _PumpedAgent:
    """A run's agent whose stdout and stderr are pumped, in lines, to two callbacks."""

    def _pump(
        self,
        streams: Sequence[IO[bytes]],
        on_stdout: Callable[[list[str]], None],
        on_stderr: Callable[[list[str]], None],
    ) -> None:
        self._streams = streams
        self._pumps = [
            threading.Thread(target=pump_lines, args=(stream, emit), daemon=True)
            for stream, emit in zip(streams, (on_stdout, on_stderr), strict=True)
        ]
        for pump in self._pumps:
            pump.start()

    def finish_output(self, timeout: float = 5.0) -> None:
        """Wait for the output pumps to reach the end of the streams."""
        for pump in self._pumps:
            pump.join(timeout)

    def _close_output(self) -> None:
        self.finish_output()
        for stream in self._streams:
            stream.close()


class AgentProcess(_PumpedAgent):
    """A node's torchrun agent started cold: a fresh interpreter in its own session."""

    def __init__(
        self,
        argv: Iterable[str],
        env: dict[str, str],
        cwd: str | None,
        on_stdout: Callable[[list[str]], None],
        on_stderr: Callable[[list[str]], None],
    ) -> None:
        # Own session: a terminal's Ctrl-C reaches the launcher, which tears down in order.
        self.proc = subprocess.Popen(
            list(argv),
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._pump([self.proc.stdout, self.proc.stderr], on_stdout, on_stderr)

    @property
    def pid(self) -> int:
        """The agent's pid."""
        return self.proc.pid

    def poll(self) -> int | None:
        """The exit code once the agent exited, else None."""
        return self.proc.poll()

    def terminate(self, grace: float = 5.0) -> None:
        """Terminate the agent and everything under it. Idempotent."""
        terminate_tree(self.proc.pid, grace)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._close_output()


class ForkedAgent(_PumpedAgent):
    """A run's agent forked by a :class:`WarmServer`: the surface of :class:`AgentProcess`
    (the server, its parent, reports its exit)."""

    def __init__(
        self,
        server: WarmServer,
        pid: int,
        sock: socket.socket,
        out_read: int,
        err_read: int,
        on_stdout: Callable[[list[str]], None],
        on_stderr: Callable[[list[str]], None],
    ) -> None:
        self.server = server
        self.pid = pid
        self._sock = sock
        self._returncode: int | None = None
        self._process = ProcessHandle.of(pid)
        streams = [os.fdopen(fd, "rb", buffering=0) for fd in (out_read, err_read)]
        self._pump(streams, on_stdout, on_stderr)

    def poll(self) -> int | None:
        """The exit code once the agent exited (``-N``: killed by signal N), else None."""
        if self._returncode is not None:
            return self._returncode
        with contextlib.suppress(OSError, ValueError):
            while select.select([self._sock], [], [], 0)[0]:
                data = self._sock.recv(1 << 16)
                if not data:  # the server is gone: the agent died with it (SIGTERM)
                    if not self._running():
                        self._returncode = -signal.SIGTERM
                    break
                message = json.loads(data)
                if "exit" in message:
                    self._returncode = int(message["exit"])
                    break
        return self._returncode

    def _running(self) -> bool:
        return self._process is not None and self._process.running()

    def terminate(self, grace: float = 5.0) -> None:
        """Terminate the agent and everything under it, then wait for its exit. Idempotent."""
        if self.poll() is None and self._process is not None:
            terminate_tree(self._process.pid, grace)
        deadline = time.monotonic() + 5.0
        while self.poll() is None and time.monotonic() < deadline and self._running():
            time.sleep(0.02)
        self._close_output()
        self._sock.close()


_servers: dict[str, WarmServer] = {}
_servers_lock = threading.Lock()


def start_agent(
    argv: Iterable[str],
    env: dict[str, str],
    cwd: str | None,
    on_stdout: Callable[[list[str]], None],
    on_stderr: Callable[[list[str]], None],
) -> AgentProcess | ForkedAgent:
    """Start a run's agent: forked from this process's warm agent (started here if there is
    none, or none for this interpreter and environment), else as a fresh interpreter.

    Raises:
        TorchImportError: the warm process could not import torch (a cold agent could not
            either: no fallback).
    """
    argv = list(argv)
    if not warm_enabled():
        return AgentProcess(argv, env, cwd, on_stdout, on_stderr)
    for attempt in (1, 2):  # a server that died since its last run is replaced once
        server = _server_for(argv, env)
        try:
            return server.fork_agent(argv, env, cwd or os.getcwd(), on_stdout, on_stderr)
        except TorchImportError:
            discard(server)
            raise
        except WarmUnavailable as exc:
            _log.debug("warm agent not used (%s); attempt %d", exc, attempt)
            discard(server)
            if "refused" in str(exc):
                break
    return AgentProcess(argv, env, cwd, on_stdout, on_stderr)


def host_store(argv: Iterable[str], env: dict[str, str], host: str) -> tuple[Any, int]:
    """A run's rendezvous store (torch's TCPStore) on ``host``, on a port the OS picks, kept
    while the caller holds the first value; the port. Hosted by a child of the warm process
    that :func:`start_agent` with this argv and environment forks from (started here if need
    be), so that this process need not import torch; else, where warm processes are off or
    this one cannot serve, in this process.

    Raises:
        TorchImportError: torch does not import (in the warm process, or here).
    """
    argv = list(argv)
    if warm_enabled():
        server = _server_for(argv, env)
        try:
            hosted = server.host_store(host, env.get(RUN_ID_ENV, ""))
            return hosted, hosted.port
        except TorchImportError:
            discard(server)
            raise
        except WarmUnavailable as exc:
            _log.debug("the warm agent hosts no store (%s)", exc)
    try:
        from torch.distributed import TCPStore
    except Exception as exc:
        raise TorchImportError(f"{type(exc).__name__}: {exc}") from exc
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    return store, int(store.port)


def prestart(argv: Iterable[str], env: dict[str, str]) -> None:
    """Start the warm process that :func:`start_agent` with this argv and environment will
    fork from, now, without waiting for it: its imports then overlap what the launcher does
    before it starts the agent. A no-op where warm agents are off or such a process runs; an
    environment that turns out different later only means :func:`start_agent` replaces it."""
    argv = list(argv)
    if argv and warm_enabled():
        _server_for(argv, env)


def _server_for(argv: list[str], env: dict[str, str]) -> WarmServer:
    python, wanted = argv[0], import_environment(env)
    with _servers_lock:
        server = _servers.get(python)
        if server is not None and (not server.alive() or server.env != wanted):
            server.close()  # it finishes what it runs, then leaves
            server = None
        if server is None:
            server = _servers[python] = WarmServer(python, wanted, room_for=argv)
        return server


def discard(server: WarmServer) -> None:
    """Drop a warm process: no further run uses it, and it leaves once its agents have."""
    with _servers_lock:
        if _servers.get(server.python) is server:
            del _servers[server.python]
    server.close()


def after_run(agent: AgentProcess | ForkedAgent, succeeded: bool) -> None:
    """Keep the warm process for the next run only after a run that succeeded."""
    if isinstance(agent, ForkedAgent) and not succeeded:
        discard(agent.server)


def stop_run(agent: AgentProcess | ForkedAgent | None, run_id: str, succeeded: bool) -> None:
    """Stop a run's agent (SIGTERM, then SIGKILL; see :func:`after_run` for its warm process)
    and every process that carries the run's marker."""
    if agent is not None:
        agent.terminate(grace=3.0)
        after_run(agent, succeeded)
    terminate_processes(marked_processes(RUN_ID_ENV, run_id), grace=1.0)


def shutdown() -> None:
    """Stop every warm process this process keeps now (each holds an interpreter with torch
    imported; interpreter exit closes them too); a later run starts a new one."""
    with _servers_lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        server.kill()
