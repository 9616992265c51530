"""The operator run by Airflow's own entry point in a process of its own.

``airflow dags test`` runs each task through Airflow's task runner, which installs the SIGTERM
handler that calls ``on_kill``. The cluster and Spark Connect tests need their own process for
another reason: one SparkContext per process, and this one may already have a local one (which
a run would reuse instead of the Connect session); and a Connect client leaves its state behind.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harness.procs import wait_until_gone
from tests.airflow.conftest import airflow_env, read_xcom
from tests.support.connect_server import ConnectServer

RUN_STARTED = re.compile(r"sparktorch_ops: (sparktorch-[0-9a-f]+) started")
HISTORY = "http://history.example:18080"  # as in dags/sto_cluster.py


class AirflowCommand:
    """An ``airflow ...`` subprocess whose output is collected line by line as it comes."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        airflow = str(Path(sys.executable).with_name("airflow"))
        self.proc = subprocess.Popen(
            [airflow, *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """Wait until a line matches ``pattern``; fail with the output when it does not."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if found := regex.search(line):
                    return found
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.1)
        pytest.fail(f"no line matching {pattern!r} within {timeout} s:\n{self.output[-20000:]}")

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"airflow did not finish within {timeout} s:\n{self.output[-20000:]}")
        self._reader.join(10)
        return code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()


def latest_run_id(dag_id: str) -> str:
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        run_id = session.scalar(
            select(DagRun.run_id).where(DagRun.dag_id == dag_id).order_by(DagRun.id.desc())
        )
    assert run_id is not None, f"no run of {dag_id}"
    return str(run_id)


def test_sigterm_to_the_task_process_cancels_the_run(airflow_db: Path) -> None:
    command = AirflowCommand(["dags", "test", "sto_sigterm"], airflow_env())
    try:
        command.wait_for(r"\[rank 1\|[^\]]+\] training started on rank 1", timeout=120)
        command.wait_for(r"\[rank 0\|[^\]]+\] training started on rank 0", timeout=30)
        run_id = RUN_STARTED.search(command.output)
        assert run_id, command.output
        # The task runs in this very process (dag.test): Airflow's task runner handles SIGTERM
        # by calling the operator's on_kill().
        command.proc.send_signal(signal.SIGTERM)
        code = command.wait(timeout=90)
    finally:
        if command.proc.poll() is None:
            command.kill()
    output = command.output
    assert code != 0, output[-5000:]
    assert (
        "TorchTrainingError: training cancelled: the Airflow task was killed (on_kill)" in output
    ), output[-5000:]
    assert wait_until_gone(run_id[1], timeout=30) == []

    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        state = session.scalar(
            select(TaskInstance.state).where(
                TaskInstance.dag_id == "sto_sigterm",
                TaskInstance.run_id == latest_run_id("sto_sigterm"),
                TaskInstance.task_id == "train",
            )
        )
    assert state == "failed"


@pytest.mark.cluster
def test_operator_on_a_standalone_cluster_from_a_connection(
    airflow_db: Path, standalone_cluster: Any
) -> None:
    host, port = standalone_cluster.master_url.rsplit(":", 1)
    connection = {
        "conn_type": "spark",
        "host": host,
        "port": int(port),
        # Executors on this machine reach the driver on loopback.
        "extra": {"spark.driver.host": "127.0.0.1", "spark.executor.memory": "1g"},
    }
    env = airflow_env(AIRFLOW_CONN_SPARK_CLUSTER=json.dumps(connection))
    command = AirflowCommand(["dags", "test", "sto_cluster"], env)
    code = command.wait(timeout=400)
    output = command.output
    assert code == 0, output[-20000:]
    run_id = latest_run_id("sto_cluster")

    on_cluster = read_xcom("sto_cluster", run_id, "on_cluster")
    assert (on_cluster["mode"], on_cluster["num_processes"]) == ("barrier", 2)
    assert on_cluster["value"]["world_size"] == 2
    assert on_cluster["app_id"].startswith("app-")  # a standalone master's application
    history = f"{HISTORY}/history/{on_cluster['app_id']}/jobs/"
    assert on_cluster["ui_url"] == history
    assert read_xcom("sto_cluster", run_id, "on_cluster", key="_link_SparkUILink") == history
    assert f"Spark master {standalone_cluster.master_url} from connection spark_cluster" in output
    assert f"starting a SparkSession (master {standalone_cluster.master_url})" in output

    default = read_xcom("sto_cluster", run_id, "default_conn")
    assert default["mode"] == "barrier"
    assert default["app_id"].startswith("local-")
    assert (
        "no connection 'spark_default': the master is spark_conf's spark.master, else local[*]"
        in output
    )
    # Its live UI died with the task and no History Server is configured: no link.
    assert read_xcom("sto_cluster", run_id, "default_conn", key="_link_SparkUILink") == ""
    assert re.search(r"\[info\s*\] \[rank 1\|[^\]]+\] training started on rank 1", output)


def test_operator_over_spark_connect_from_a_spark_connect_connection(
    airflow_db: Path, connect_server: ConnectServer
) -> None:
    token = "s3cret-connect-token"
    connection = {
        "conn_type": "spark_connect",
        # localhost: pyspark sends a token over a plain channel only to localhost.
        "host": "localhost",
        "port": connect_server.port,
        "login": "airflow-user",
        "password": token,
        "extra": {"use_ssl": False},
    }
    env = airflow_env(AIRFLOW_CONN_SPARK_CONNECT_TEST=json.dumps(connection))
    command = AirflowCommand(["dags", "test", "sto_connect"], env)
    code = command.wait(timeout=400)
    output = command.output
    server_log = connect_server.log()
    assert code == 0, f"{output[-20000:]}\nserver log:\n{server_log}"
    run_id = latest_run_id("sto_connect")

    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        state = session.scalar(
            select(TaskInstance.state).where(
                TaskInstance.dag_id == "sto_connect",
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == "over_connect",
            )
        )
    assert state == "success"
    summary = read_xcom("sto_connect", run_id, "over_connect")
    assert summary["value"] == {"sum": 3.0, "world_size": 2}
    assert (summary["mode"], summary["num_processes"]) == ("barrier", 2)
    assert summary["exit_codes"] == {"0": 0, "1": 0}
    # The server's application ran it (a Connect client has no SparkContext of its own).
    assert summary["app_id"].startswith("local-")
    redacted = f"sc://localhost:{connect_server.port}/;user_id=airflow-user;token=***;use_ssl=False"
    assert f"Spark master {redacted} from connection spark_connect_test" in output
    assert f"connecting to Spark Connect at {redacted}" in output
    assert "starting a SparkSession" not in output  # no JVM here
    for rank in (0, 1):
        assert re.search(
            rf"\[info\s*\] \[rank {rank}\|[^\]]+\] training started on rank {rank}", output
        ), output[-20000:]
        assert re.search(rf"\[rank {rank}\|[^\]]+\] rank {rank} all-reduced 3\b", output)
    assert token not in output
    run = RUN_STARTED.search(output)
    assert run, output[-20000:]
    assert wait_until_gone(run[1], timeout=30) == []
