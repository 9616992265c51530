"""A flow script served by a Prefect runner in a subprocess, and the processes of its flow runs;
a standalone Prefect server (:func:`prefect_server`) for the benchmarks.

:func:`serve_flow_script` starts ``python SCRIPT ARGS`` (a script that calls ``flow.serve``)
against a given Prefect API, in its own process group and with a token of its own in the
environment (``SERVED_TOKEN_ENV``), which every process it starts inherits: the runner's flow
run subprocesses, their Spark JVMs and Python workers, the ranks. Stopping it (SIGINT to the
group, then SIGKILL) also kills whatever still carries the token, wherever it was reparented.

The runner (Prefect 3.7) starts each flow run in a ``multiprocessing`` spawn child of its own,
next to its resource tracker; the flow run's id is not in that child's environment, so a flow
run's process is found as the runner's child above its ranks (:func:`flow_run_process`), and
:func:`spawned_processes` is everything the served script started apart from the runner and
its resource tracker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from uuid import UUID

import psutil

from harness.ports import free_port
from harness.procs import alive, group_members

ROOT = Path(__file__).resolve().parents[2]
#: Carried by every process a served script starts (its value is unique to the script).
SERVED_TOKEN_ENV = "SPARKTORCH_TEST_SERVED"

T = TypeVar("T")


@dataclass
class ServedFlow:
    """A running ``flow.serve`` script."""

    process: subprocess.Popen[bytes]
    log_path: Path
    token: str

    def log(self, last: int = 8000) -> str:
        """The end of the runner's output."""
        try:
            return self.log_path.read_text(errors="replace")[-last:]
        except OSError:
            return ""

    def running(self) -> bool:
        """Whether the runner process is still alive."""
        return self.process.poll() is None

    def stop(self, grace: float = 20.0) -> None:
        """SIGINT the runner's process group, SIGKILL it after ``grace`` seconds, then SIGKILL
        every process still carrying the token (safe to call twice)."""
        stop_group(self.process, signal.SIGINT, grace)
        for proc in [
            *group_members(self.process.pid),
            *processes_with_env(SERVED_TOKEN_ENV, self.token),
        ]:
            with contextlib.suppress(psutil.Error):
                proc.kill()


def stop_group(process: subprocess.Popen[bytes], first: int, grace: float) -> None:
    """Send ``first`` to the process group ``process`` leads (started with
    ``start_new_session=True``), SIGKILL the group after ``grace`` seconds (at once when the
    leader has exited) and reap the leader; safe to call twice."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, first)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def prefect_env(workdir: Path, extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """This environment without ``PREFECT_API_URL`` (a flow run in it starts Prefect's
    ephemeral server), with Prefect's home and result storage under ``workdir`` and the
    repository on ``PYTHONPATH``; ``extra`` is applied last (a None value removes the
    variable)."""
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env.update(
        PREFECT_HOME=str(workdir / "prefect-home"),
        PREFECT_LOCAL_STORAGE_PATH=str(workdir / "prefect-results"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def served_env(
    api_url: str, workdir: Path, extra: Mapping[str, str | None] | None = None
) -> dict[str, str]:
    """The environment of a served script: :func:`prefect_env`'s, pointed at ``api_url``, the
    runner polling every 2 s; ``extra`` is applied last (a None value removes the variable)."""
    changes = {"PREFECT_API_URL": api_url, "PREFECT_RUNNER_POLL_FREQUENCY": "2"}
    return prefect_env(workdir, {**changes, **(extra or {})})


@dataclass
class PrefectServer:
    """A ``prefect server start`` in a process group of its own."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the server's group, SIGKILL it after ``grace`` seconds."""
        stop_group(self.process, signal.SIGTERM, grace)


@contextlib.contextmanager
def prefect_server(
    workdir: Path, timeout: float = 180, env: Mapping[str, str | None] | None = None
) -> Iterator[PrefectServer]:
    """A Prefect server (its services running, as in production; no UI) on 127.0.0.1 and a
    free port, its database under ``workdir``, from ``/api/health`` answering until the block
    ends; its output goes to ``workdir/prefect-server.log``. (The tests use
    ``prefect_test_harness`` instead.)

    Args:
        workdir: Prefect's home (and so the database) and the log.
        timeout: seconds it may take to answer.
        env: changes to :func:`prefect_env`'s environment (None removes a variable).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    prefect = Path(sys.executable).parent / "prefect"
    command = [str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    changes = {"PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log_path = workdir / "prefect-server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            cwd=str(workdir),
            env=prefect_env(workdir, {**changes, **(env or {})}),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    server = PrefectServer(f"http://127.0.0.1:{port}/api", process, log_path)

    def healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"prefect server exited:\n{log_path.read_text()[-4000:]}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{server.url}/health", timeout=2) as response,
        ):
            return response.status == 200
        return False

    try:
        wait_for(healthy, timeout, f"the Prefect server at {server.url}")
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def serve_flow_script(
    script: Path,
    args: Sequence[str] = (),
    *,
    api_url: str,
    workdir: Path,
    cwd: Path | None = None,
    env: Mapping[str, str | None] | None = None,
) -> Iterator[ServedFlow]:
    """Run ``python script *args`` (which serves a flow) against ``api_url`` until the block
    ends; its output goes to ``workdir/serve.log``.

    Args:
        script: the flow script.
        args: its arguments.
        api_url: the Prefect API the runner and its flow runs talk to.
        workdir: where Prefect's home, result storage and the log go.
        cwd: the runner's working directory (its flow runs inherit it); default the repository.
        env: changes to :func:`served_env`'s environment (None removes a variable).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    environment = served_env(api_url, workdir, env)
    environment[SERVED_TOKEN_ENV] = token
    log_path = workdir / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, str(script), *args],
            cwd=str(cwd or ROOT),
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    served = ServedFlow(process, log_path, token)
    try:
        yield served
    finally:
        served.stop()


def wait_for(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.5) -> T:
    """Poll ``condition`` until it returns something true; return that.

    Raises:
        AssertionError: not within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def wait_for_deployment(client: Any, name: str, served: ServedFlow, timeout: float = 120) -> Any:
    """The deployment ``flow-name/deployment-name`` once the runner registered it.

    Raises:
        AssertionError: the runner exited first (its log in the message), or the timeout.
    """
    from prefect.exceptions import ObjectNotFound

    def deployment() -> Any:
        assert served.running(), f"the runner exited:\n{served.log()}"
        try:
            return client.read_deployment_by_name(name)
        except ObjectNotFound:
            return None

    return wait_for(deployment, timeout, f"deployment {name}")


def wait_for_final_state(
    client: Any, flow_run_id: UUID, timeout: float, interval: float = 0.5
) -> Any:
    """The flow run's state once it is final (Completed, Failed, Cancelled, Crashed)."""

    def final() -> Any:
        state = client.read_flow_run(flow_run_id).state
        return state if state is not None and state.is_final() else None

    return wait_for(final, timeout, f"flow run {flow_run_id} to end", interval)


def processes_with_env(name: str, value: str) -> list[psutil.Process]:
    """Live (not zombie) processes whose environment has ``name=value``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(name) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def spawned_processes(served: ServedFlow) -> list[psutil.Process]:
    """Live processes the served script started (wherever they were reparented), apart from
    the runner itself and its ``multiprocessing`` resource tracker: its flow runs' processes
    and everything below them."""
    left = []
    for proc in processes_with_env(SERVED_TOKEN_ENV, served.token):
        try:
            if proc.pid == served.process.pid or (
                proc.ppid() == served.process.pid
                and "multiprocessing.resource_tracker" in command_line(proc)
            ):
                continue
        except psutil.Error:
            continue
        left.append(proc)
    return left


def flow_run_process(served: ServedFlow, below: Iterable[psutil.Process]) -> psutil.Process | None:
    """The runner's child (a flow run's process) that is ``below``'s ancestor (or one of them)."""
    for proc in below:
        with contextlib.suppress(psutil.Error):
            for candidate in [proc, *proc.parents()]:
                if candidate.ppid() == served.process.pid:
                    return candidate
    return None


def process_tree(roots: Iterable[psutil.Process]) -> list[psutil.Process]:
    """``roots`` and all their descendants, each once, zombies left out."""
    found: dict[int, psutil.Process] = {}
    for root in roots:
        with contextlib.suppress(psutil.Error):
            for proc in [root, *root.children(recursive=True)]:
                found.setdefault(proc.pid, proc)
    return alive(found.values())


def command_line(proc: psutil.Process) -> str:
    """The process's command line ("" once it is gone or a zombie)."""
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def describe(procs: Iterable[psutil.Process]) -> list[str]:
    """``pid name: command line`` of each process (for assertion messages)."""
    lines = []
    for proc in procs:
        try:
            lines.append(f"{proc.pid} {proc.name()}: {command_line(proc)[:300]}")
        except psutil.Error:
            lines.append(f"{proc.pid} (gone)")
    return lines
