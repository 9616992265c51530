"""A real Spark standalone cluster (master + workers) from the pyspark package, on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyspark

from harness.ports import free_port


def spark_home() -> str:
    """The SPARK_HOME of the installed pyspark package."""
    return os.path.dirname(pyspark.__file__)


def cluster_env() -> dict[str, str]:
    """Environment for daemons and drivers: loopback, the test interpreter on executors."""
    env = dict(os.environ)
    env.update(
        SPARK_HOME=spark_home(),
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        SPARK_NO_DAEMONIZE="1",
    )
    return env


@dataclass
class Cluster:
    """A running standalone cluster."""

    master_url: str
    web_ui: str
    workdir: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def worker_pids(self) -> list[int]:
        """Pids of the worker daemons."""
        return [p.pid for p in self.processes[1:]]


def stop_process_groups(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process group (last started first), SIGKILL what is left after 20 s."""
    for proc in reversed(processes):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in processes:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_for_workers(web_ui: str, workers: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{web_ui}/json/", timeout=2) as response:
                import json

                state = json.load(response)
                alive = [w for w in state.get("workers", []) if w.get("state") == "ALIVE"]
                if len(alive) >= workers:
                    return
        except (OSError, ValueError):  # not up yet, or a half-started UI's empty reply
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{workers} Spark workers did not register within {timeout} s")


@contextlib.contextmanager
def start_cluster(workdir: Path, workers: int = 2, cores: int = 1) -> Iterator[Cluster]:
    """Start a master and ``workers`` workers with ``bin/spark-class``; stop them after."""
    env = cluster_env()
    spark_class = os.path.join(spark_home(), "bin", "spark-class")
    port, ui_port = free_port(), free_port()
    master_url = f"spark://127.0.0.1:{port}"
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    processes: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, args: list[str]) -> None:
        log = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the daemon
        processes.append(
            subprocess.Popen(
                [spark_class, *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        )

    try:
        spawn(
            "master",
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--webui-port",
                str(ui_port),
            ],
        )
        for index in range(workers):
            spawn(
                f"worker{index}",
                [
                    "org.apache.spark.deploy.worker.Worker",
                    master_url,
                    "--host",
                    "127.0.0.1",
                    "--cores",
                    str(cores),
                    "--memory",
                    "2g",
                    "--webui-port",
                    str(free_port()),
                    "--work-dir",
                    str(workdir / f"work{index}"),
                ],
            )
        web_ui = f"http://127.0.0.1:{ui_port}"
        _wait_for_workers(web_ui, workers, timeout=120)
        yield Cluster(master_url, web_ui, workdir, processes)
    finally:
        stop_process_groups(processes)
