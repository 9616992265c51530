"""A real MLflow tracking server (``mlflow server``) on loopback: SQLite store, local artifacts.

The server runs in its own process group (``mlflow server`` starts uvicorn as a child), so
stopping it ends every process it started. It takes a while to come up (imports, database
migrations): :func:`start_mlflow_server` waits up to ``timeout`` seconds for ``/health``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from harness.ports import free_port
from harness.procs import group_members


@dataclass
class MlflowServer:
    """A running tracking server."""

    url: str
    workdir: Path
    log_path: Path
    process: subprocess.Popen[bytes]

    @property
    def backend_store_uri(self) -> str:
        """The server's SQLite store (read it directly only after the server is stopped)."""
        return f"sqlite:///{self.workdir / 'mlflow.db'}"

    def log(self, last: int = 6000) -> str:
        """The end of the server's output."""
        try:
            return self.log_path.read_text(errors="replace")[-last:]
        except OSError:
            return ""

    def group_members(self) -> list[psutil.Process]:
        """Live processes of the server's process group."""
        return group_members(self.process.pid)


def server_command() -> list[str]:
    """``mlflow server`` of the test interpreter's environment."""
    script = Path(sys.executable).parent / "mlflow"
    if script.exists():
        return [str(script), "server"]
    return [sys.executable, "-m", "mlflow", "server"]


def server_env() -> dict[str, str]:
    """The server's environment: no client settings, no background job runner (huey)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    # The job runner starts several huey consumers: slow to start, not needed for tracking.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _wait_group_gone(process: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.poll()  # reap the leader as soon as it exits
        if not group_members(process.pid):
            return True
        time.sleep(0.2)
    process.poll()
    return not group_members(process.pid)


def stop_server(process: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after ``grace`` seconds.

    Raises:
        RuntimeError: some process of the group is still alive 10 s after SIGKILL.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    if _wait_group_gone(process, grace):
        process.wait(timeout=5)
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    if not _wait_group_gone(process, 10):
        left = [p.pid for p in group_members(process.pid)]
        raise RuntimeError(f"mlflow server processes {left} outlived SIGKILL")
    process.wait(timeout=5)


def _wait_healthy(server: MlflowServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = server.process.poll()
        if code is not None:
            raise RuntimeError(f"mlflow server exited {code} before it was up:\n{server.log()}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:  # not listening yet
            pass
        time.sleep(0.5)
    raise TimeoutError(
        f"mlflow server at {server.url} not up within {timeout:g} s:\n{server.log()}"
    )


@contextlib.contextmanager
def start_mlflow_server(workdir: Path, *, timeout: float = 120.0) -> Iterator[MlflowServer]:
    """Start ``mlflow server`` on 127.0.0.1 and a free port with its store under ``workdir``;
    wait until ``/health`` answers; stop its whole process group after."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = workdir / "mlflow-server.log"
    command = [
        *server_command(),
        "--backend-store-uri",
        f"sqlite:///{workdir / 'mlflow.db'}",
        "--default-artifact-root",
        str(workdir / "artifacts"),
        "--artifacts-destination",
        str(workdir / "artifacts-proxied"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            cwd=workdir,  # anything the server writes by default lands here
            env=server_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    server = MlflowServer(f"http://127.0.0.1:{port}", workdir, log_path, process)
    try:
        _wait_healthy(server, timeout)
        yield server
    finally:
        stop_server(process)
