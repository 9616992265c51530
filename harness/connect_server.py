"""A Spark Connect server of the pyspark package, for the benchmarks: ``spark-submit --class
SparkConnectServer`` in its own process group, on loopback.

(The tests' shared server, with its broken executor environment and its 3.5 handling, is
``tests/support/connect_server.py``.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

from harness.ports import free_port

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
# What makes a process look like a Connect client to pyspark: never for the server.
_CLIENT_ENV = ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE", "SPARK_API_MODE")


def spark_home() -> str:
    """The pyspark package's directory (its ``bin/spark-submit``)."""
    import pyspark

    return os.path.dirname(pyspark.__file__)


def server_command(port: int, master: str, confs: Mapping[str, str] | None = None) -> list[str]:
    """``spark-submit ... SparkConnectServer ... spark-internal`` with ``confs`` over the
    loopback defaults."""
    settings = {
        "spark.connect.grpc.binding.port": str(port),
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.showConsoleProgress": "false",
        "spark.ui.port": "0",
        **(confs or {}),
    }
    command = [os.path.join(spark_home(), "bin", "spark-submit"), "--class", SERVER_CLASS]
    command += ["--master", master]
    for key, value in settings.items():
        command += ["--conf", f"{key}={value}"]
    return [*command, "spark-internal"]


class ConnectServer:
    """A Spark Connect server in its own process group; :meth:`stop` ends it and every process
    it started (its Python workers call ``setpgid``: they are waited for as descendants).

    Args:
        workdir: its working directory; its output goes to ``connect-server.log`` there.
        master: the server's Spark master.
        confs: Spark settings for the server.
        env: environment variables for the server, over this process's.
    """

    def __init__(
        self,
        workdir: Path,
        master: str = "local[2]",
        confs: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"sc://127.0.0.1:{self.port}"
        self.log_path = workdir / "connect-server.log"
        server_env = {k: v for k, v in os.environ.items() if k not in _CLIENT_ENV}
        server_env.update(SPARK_HOME=spark_home(), SPARK_LOCAL_IP="127.0.0.1", **(env or {}))
        with open(self.log_path, "wb") as out:
            self.process = subprocess.Popen(
                server_command(self.port, master, confs),
                cwd=workdir,
                env=server_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def log(self) -> str:
        """The server's output so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_listening(self, timeout: float) -> float:
        """Wait until the gRPC port accepts connections (the server binds it last); the
        seconds it took."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"Connect server exited {code}:\n{self.log()[-4000:]}")
            with socket.socket() as sock:
                sock.settimeout(1)
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return time.monotonic() - started
            time.sleep(0.5)
        raise TimeoutError(f"Connect server not up within {timeout:g} s:\n{self.log()[-4000:]}")

    def descendants(self) -> list[psutil.Process]:
        """The server's processes below its JVM (Python workers, ranks)."""
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            return []

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the group and the descendants, SIGKILL what is left after ``grace`` s."""
        others = self.descendants()
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            for proc in others:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if self.process.poll() is not None and not any(alive(p) for p in others):
                    return
                time.sleep(0.2)
        left = [p.pid for p in others if alive(p)]
        raise RuntimeError(f"Connect server (pid {self.process.pid}) or {left} outlived SIGKILL")


def alive(proc: psutil.Process) -> bool:
    """Whether ``proc`` runs (a zombie does not)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
