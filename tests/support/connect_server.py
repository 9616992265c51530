"""A real Spark Connect server (``SparkConnectServer``) from the pyspark package, on loopback.

The server is ``spark-submit --class org.apache.spark.sql.connect.service.SparkConnectServer``
of the installed pyspark (its ``jars/`` holds ``spark-connect_2.13-*.jar``), with its own
driver on ``master`` (``local[2]`` by default). It runs in its own process group (spark-submit
is a shell script that execs java, and the driver starts Spark's Python workers), so stopping
it ends every process it started.

Start-up takes a while (a JVM, a SparkContext): :func:`running_connect_server` waits up to
``timeout`` seconds until the gRPC port accepts connections and a Connect client, in a
subprocess so that the caller's interpreter stays free of Connect state, runs
``spark.range(1).collect()``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from harness.ports import free_port
from harness.procs import alive, group_members
from tests.support.cluster import cluster_env, spark_home

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"

# Run by the readiness probe: a Connect client in a fresh interpreter, one trivial job.
PROBE = """\
import sys
from pyspark.sql.connect.session import SparkSession
spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
try:
    assert spark.range(1).collect()[0][0] == 0
finally:
    spark.stop()
"""


@dataclass
class ConnectServer:
    """A running Spark Connect server."""

    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    executor_python: str | None = None  # None: this interpreter

    def log(self, last: int = 6000) -> str:
        """The end of the server's output."""
        try:
            return self.log_path.read_text(errors="replace")[-last:]
        except OSError:
            return ""

    def group_members(self) -> list[psutil.Process]:
        """Live processes of the server's process group (java, Python workers)."""
        return group_members(self.process.pid)

    def stop(self, grace: float = 15.0) -> None:
        """Stop the whole process group and wait for it (safe to call twice)."""
        stop_server(self.process, grace)


def server_command(
    port: int, master: str = "local[2]", conf: Mapping[str, str] | None = None
) -> list[str]:
    """``spark-submit ... SparkConnectServer ... spark-internal`` of the pyspark package."""
    command = [
        os.path.join(spark_home(), "bin", "spark-submit"),
        "--class",
        SERVER_CLASS,
        "--master",
        master,
        "--conf",
        f"spark.connect.grpc.binding.port={port}",
        "--conf",
        "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf",
        "spark.driver.host=127.0.0.1",
        "--conf",
        "spark.driver.bindAddress=127.0.0.1",
        "--conf",
        "spark.ui.showConsoleProgress=false",
        "--conf",
        "spark.ui.port=0",
        # Results that tasks relay (a client the executors cannot reach) pass through the
        # server's heap as task results: room for the 256 MiB test value.
        "--conf",
        "spark.driver.memory=2g",
    ]
    for key, value in (conf or {}).items():
        command += ["--conf", f"{key}={value}"]
    return [*command, "spark-internal"]


def server_env() -> dict[str, str]:
    """The server's environment: loopback, the test interpreter on executors, no Connect mode.

    ``SPARK_REMOTE`` and friends are dropped: the server's own Python workers must run classic.
    """
    drop = ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE", "SPARK_API_MODE")
    return {k: v for k, v in cluster_env().items() if k not in drop}


def _descendants(pid: int) -> list[psutil.Process]:
    """The leader's descendants, wherever their group: ``pyspark.daemon`` calls
    ``setpgid(0, 0)``, so Spark's Python workers are not in the server's process group."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _wait_gone(
    process: subprocess.Popen[bytes], others: list[psutil.Process], timeout: float
) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        process.poll()  # reap the leader as soon as it exits
        if not group_members(process.pid) and not alive(others):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def stop_server(process: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM the server's process group and its other descendants (Spark's Python
    workers), SIGKILL what is left after ``grace`` seconds. Safe to call twice.

    Raises:
        RuntimeError: some process is still alive 10 s after SIGKILL.
    """
    others = _descendants(process.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    for proc in alive(others):
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    if _wait_gone(process, others, grace):
        process.wait(timeout=5)
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    for proc in alive(others):
        with contextlib.suppress(psutil.Error):
            proc.kill()
    if not _wait_gone(process, others, 10):
        left = sorted({p.pid for p in group_members(process.pid) + alive(others)})
        raise RuntimeError(f"Spark Connect server processes {left} outlived SIGKILL")
    process.wait(timeout=5)


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _wait_ready(server: ConnectServer, timeout: float) -> None:
    """Wait for the gRPC port, then for a Connect client's first job to succeed."""
    deadline = time.monotonic() + timeout
    probe_error = ""
    while time.monotonic() < deadline:
        code = server.process.poll()
        if code is not None:
            raise RuntimeError(
                f"Spark Connect server exited {code} before it was up:\n{server.log()}"
            )
        if not _port_open(server.port):
            time.sleep(0.5)
            continue
        try:
            probe = subprocess.run(
                [sys.executable, "-c", PROBE, server.url],
                env=server_env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=max(5.0, deadline - time.monotonic()),
                check=False,
            )
        except subprocess.TimeoutExpired:
            break
        if probe.returncode == 0:
            return
        probe_error = probe.stderr[-3000:]
        time.sleep(1.0)
    raise TimeoutError(
        f"Spark Connect server at {server.url} not up within {timeout:g} s"
        + (f"; last client probe:\n{probe_error}" if probe_error else "")
        + f"\nserver log:\n{server.log()}"
    )


def start_connect_server(
    tmp_dir: Path,
    master: str = "local[2]",
    conf: Mapping[str, str] | None = None,
    *,
    timeout: float = 120.0,
    executor_python: str | None = None,
) -> ConnectServer:
    """Start a Connect server on 127.0.0.1 and a free port, logging to ``tmp_dir``; wait until
    a client can run a job. ``executor_python``: its Python workers' interpreter (default:
    this one). The caller must :meth:`ConnectServer.stop` it."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = tmp_dir / "connect-server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            server_command(port, master, conf),
            cwd=tmp_dir,  # spark-warehouse, metastore_db and the like land here
            env={
                **server_env(),
                **({"PYSPARK_PYTHON": executor_python} if executor_python else {}),
            },
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    server = ConnectServer(f"sc://127.0.0.1:{port}", port, process, log_path, executor_python)
    try:
        _wait_ready(server, timeout)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def running_connect_server(
    tmp_dir: Path,
    master: str = "local[2]",
    conf: Mapping[str, str] | None = None,
    *,
    timeout: float = 120.0,
    executor_python: str | None = None,
) -> Iterator[ConnectServer]:
    """A Connect server for the duration of the block (see :func:`start_connect_server`)."""
    server = start_connect_server(
        tmp_dir, master, conf, timeout=timeout, executor_python=executor_python
    )
    try:
        yield server
    finally:
        server.stop()
