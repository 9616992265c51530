"""Airflow as it runs in production, on one machine: the scheduler (LocalExecutor), the DAG
processor and the API server, each its own process, on a SQLite database and a free loopback
port. Tasks then run as Airflow 3 runs them: a LocalExecutor worker supervises a task process
that talks to the execution API.

Used by ``tests/airflow/test_real_scheduler.py`` and the scheduler benchmarks
(``benchmarks/airflow_scheduler.py``, ``sweep_dag.py``, ``deferred.py``). The REST API is
reached without credentials (``simple_auth_manager_all_admins``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from harness.ports import free_port
from harness.procs import alive, measuring_coverage, processes_with_marker

COMPONENTS = {
    "api-server": ["api-server", "--host", "127.0.0.1", "--port", "{port}"],
    "scheduler": ["scheduler"],
    "dag-processor": ["dag-processor"],
    "triggerer": ["triggerer"],  # runs the triggers of deferred tasks
}
FINAL_RUN_STATES = {"success", "failed"}


def airflow_env(
    home: Path, dags_folder: Path, port: int, extra: Mapping[str, str | None]
) -> dict[str, str]:
    """The environment every component (and ``airflow`` command) of one installation shares;
    ``extra`` over it (a None value removes the variable)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("AIRFLOW__") and key != "AIRFLOW_HOME"
    }
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(dags_folder),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__EXECUTOR="LocalExecutor",
        AIRFLOW__CORE__PARALLELISM="4",
        AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT="120",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True",
        AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{port}/execution/",
        AIRFLOW__API__BASE_URL=f"http://127.0.0.1:{port}",
        AIRFLOW__API__PORT=str(port),
        AIRFLOW__API__WORKERS="1",
        # Shared by the API server (which checks task tokens) and the scheduler (which makes them).
        AIRFLOW__API_AUTH__JWT_SECRET=secrets.token_hex(32),
        AIRFLOW__API__SECRET_KEY=secrets.token_hex(16),
        AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME="0.5",
        AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="5",
        AIRFLOW__LOGGING__COLORED_CONSOLE_LOG="False",
        PYTHONUNBUFFERED="1",
    )
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@dataclass
class AirflowServices:
    """A running Airflow installation and a client for its REST API."""

    home: Path
    port: int
    env: dict[str, str]
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200,)) -> Any:
        """Call the REST API (``/api/v2`` + ``path``); fail on an unexpected status.

        A "Database error" answer is asked again: with several trainings starting at once,
        SQLite's single writer can keep the API server waiting past its lock timeout, and the
        request's transaction was rolled back.
        """
        for _ in range(5):
            response = httpx.request(method, f"{self.url}/api/v2{path}", json=body, timeout=30)
            if response.status_code != 500 or "Database error" not in response.text:
                break
            time.sleep(1)
        if response.status_code not in ok:
            raise AssertionError(f"{method} {path}: {response.status_code} {response.text}")
        return response.json() if response.content else None

    def start(self, name: str) -> None:
        """Start (or start again) the component ``name``; its output goes to ``<name>.log``."""
        airflow = str(Path(sys.executable).with_name("airflow"))
        with (self.home / f"{name}.log").open("ab") as log:
            self.processes[name] = subprocess.Popen(
                [airflow, *(arg.format(port=self.port) for arg in COMPONENTS[name])],
                env=self.env,
                cwd=str(self.home),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def check_alive(self) -> None:
        """Fail with a component's log tail when it exited."""
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                tail = (self.home / f"{name}.log").read_text(errors="replace")[-6000:]
                raise AssertionError(f"airflow {name} exited with {proc.returncode}:\n{tail}")

    def wait_until(self, what: str, check: Any, timeout: float, every: float = 1.0) -> Any:
        """Poll ``check()`` until it returns something truthy; fail after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            with contextlib.suppress(httpx.TransportError):
                value = check()
                if value:
                    return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(every)

    def wait_healthy(self, timeout: float = 240) -> None:
        """Wait until the API answers and reports the scheduler and DAG processor healthy."""

        def healthy() -> bool:
            health = self.api("GET", "/monitor/health")
            return all(
                (health.get(part) or {}).get("status") == "healthy"
                for part in ("metadatabase", "scheduler", "dag_processor", "triggerer")
            )

        self.wait_until("the Airflow components to report healthy", healthy, timeout)

    def wait_for_dag(self, dag_id: str, timeout: float = 180) -> dict[str, Any]:
        """Wait until the DAG processor has parsed ``dag_id``; fail on an import error."""

        def parsed() -> Any:
            errors = self.api("GET", "/importErrors")["import_errors"]
            if errors:
                raise AssertionError(f"DAG import errors: {errors}")
            response = httpx.get(f"{self.url}/api/v2/dags/{dag_id}", timeout=30)
            return response.json() if response.status_code == 200 else None

        return dict(self.wait_until(f"DAG {dag_id} to be parsed", parsed, timeout))

    def unpause(self, dag_id: str) -> None:
        self.api("PATCH", f"/dags/{dag_id}", {"is_paused": False})

    def trigger(self, dag_id: str, conf: Mapping[str, Any] | None = None) -> str:
        """Start a manual DAG run (as "Trigger DAG" in the UI); return its run id."""
        run = self.api(
            "POST",
            f"/dags/{dag_id}/dagRuns",
            {"logical_date": None, "conf": dict(conf or {})},
        )
        return str(run["dag_run_id"])

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return list(self.api("GET", f"/dags/{dag_id}/dagRuns")["dag_runs"])

    def run_state(self, dag_id: str, run_id: str) -> str:
        return str(self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"])

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float) -> str:
        """Wait until the run ends; return ``success`` or ``failed``."""
        state = self.wait_until(
            f"run {run_id} of {dag_id} to end",
            lambda: (s := self.run_state(dag_id, run_id)) in FINAL_RUN_STATES and s,
            timeout,
            every=2.0,
        )
        return str(state)

    def task_instance(self, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
        return dict(self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}"))

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        instances = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")
        return {ti["task_id"]: ti["state"] for ti in instances["task_instances"]}

    def mark_failed(self, dag_id: str, run_id: str, task_id: str) -> None:
        """Set a running task instance to failed (the UI's "Mark as failed")."""
        self.api(
            "PATCH",
            f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}",
            {"new_state": "failed"},
        )

    def task_log(
        self, dag_id: str, run_id: str, task_id: str, try_number: int
    ) -> list[dict[str, Any]]:
        """The records of a task try's log file (JSON lines, as the task runner writes them),
        then those of its trigger's log files (a deferred try's, one per triggerer that ran it)."""
        folder = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
        paths = [
            folder / f"attempt={try_number}.log",
            *sorted(folder.glob(f"attempt={try_number}.log.trigger.*.log")),
        ]
        records = []
        for path in paths:
            for line in path.read_text(errors="replace").splitlines():
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        records.append({"event": line, "level": "unparsed"})
        return records

    def stop(self) -> None:
        """Stop every component (SIGTERM, then SIGKILL after a few seconds: nothing of the
        installation outlives it, so a graceful end buys nothing but coverage data; a triggerer
        waits 10 s for its trigger runner) with everything it started (task processes may run
        in sessions of their own)."""
        started: list[psutil.Process] = []
        for proc in self.processes.values():
            with contextlib.suppress(psutil.Error):
                started += psutil.Process(proc.pid).children(recursive=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        # Under scripts/test.sh --coverage they get the time to end on their own and write what
        # they measured (the trigger runner's data would be lost with a SIGKILL).
        grace = 20 if measuring_coverage() else 3
        deadline = time.monotonic() + grace
        for proc in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for child in started:
            with contextlib.suppress(psutil.Error):
                child.kill()


def airflow_command(env: Mapping[str, str], *args: str, timeout: float = 300) -> str:
    """Run ``airflow ARGS`` to completion; its output (fails on a non-zero exit)."""
    airflow = str(Path(sys.executable).with_name("airflow"))
    proc = subprocess.run(
        [airflow, *args], env=dict(env), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"airflow {' '.join(args)}: {proc.returncode}\n{proc.stdout}{proc.stderr}"
        )
    return proc.stdout


@contextlib.contextmanager
def running_airflow(
    home: Path,
    dag_files: list[Path],
    extra_env: Mapping[str, str | None] | None = None,
    migrated_db: Path | None = None,
) -> Iterator[AirflowServices]:
    """Run the three components on a SQLite database under ``home`` until the block ends; the
    DAGs folder holds links to ``dag_files``. The database is a copy of ``migrated_db`` (a
    freshly migrated one, never used) when given, else migrated here (``airflow db migrate``
    takes a dozen seconds)."""
    dags_folder = home / "dags"
    dags_folder.mkdir(parents=True)
    for source in dag_files:
        (dags_folder / source.name).symlink_to(source)
    port = free_port()
    env = airflow_env(home, dags_folder, port, extra_env or {})
    if migrated_db is None:
        airflow_command(env, "db", "migrate")
    else:
        shutil.copyfile(migrated_db, home / "airflow.db")
    services = AirflowServices(home, port, env)
    try:
        for name in COMPONENTS:
            services.start(name)
        services.wait_healthy()
        yield services
    finally:
        services.stop()


def task_process_tree(rank_pid: int, scheduler_pid: int) -> list[psutil.Process]:
    """The processes a task try started to run ``rank_pid``: its ancestors below the
    scheduler's LocalExecutor worker (the task process, its Spark JVM, the Python workers, the
    launcher), and the rank itself."""
    rank = psutil.Process(rank_pid)
    chain = [rank]
    for parent in rank.parents():
        if parent.pid == scheduler_pid or parent.ppid() == scheduler_pid:
            return chain
        chain.append(parent)
    raise AssertionError(f"rank {rank_pid} does not run under the scheduler {scheduler_pid}")


@dataclass
class RankMarkers:
    """Where the ranks of ``tests/airflow/dags/sto_scheduled.py`` announce themselves."""

    path: Path

    def ranks(self, dag_id: str, try_number: int) -> list[tuple[int, str]]:
        """``(pid, run marker)`` of each rank of that try that started, by rank."""
        found = []
        for rank in (0, 1):
            marker = self.path / f"{dag_id}.{try_number}.rank{rank}"
            if marker.exists():
                pid, run_id = marker.read_text().split()
                found.append((int(pid), run_id))
        return found


def wait_for_ranks(
    airflow: AirflowServices, markers: RankMarkers, dag_id: str, run_id: str, timeout: float = 400
) -> tuple[list[psutil.Process], str]:
    """Wait until both ranks of the run's first try train; the processes of that try (ranks,
    launchers, Python workers, the JVM, the task process) and the run marker."""
    ranks = airflow.wait_until(
        f"both ranks of {dag_id} to start",
        lambda: len(found := markers.ranks(dag_id, 1)) == 2 and found,
        timeout=timeout,
    )
    scheduler = airflow.processes["scheduler"].pid
    tree: dict[int, psutil.Process] = {}
    for pid, _ in ranks:
        tree.update({p.pid: p for p in task_process_tree(pid, scheduler)})
    assert airflow.run_state(dag_id, run_id) == "running"
    return list(tree.values()), ranks[0][1]


class RankWatcher:
    """Records the processes of a try as soon as both its ranks announce themselves, so that a
    test that looks later (the try may have ended by then) still knows what to check."""

    def __init__(self, airflow: AirflowServices, markers: RankMarkers, dag_ids: list[str]) -> None:
        self._airflow, self._markers, self._dag_ids = airflow, markers, dag_ids
        self._seen: dict[tuple[str, int], tuple[list[psutil.Process], str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        scheduler = self._airflow.processes["scheduler"].pid
        while not self._stop.wait(0.3):
            for dag_id in self._dag_ids:
                for try_number in (1, 2):
                    ranks = self._markers.ranks(dag_id, try_number)
                    if (dag_id, try_number) in self._seen or len(ranks) < 2:
                        continue
                    tree: dict[int, psutil.Process] = {}
                    for pid, _ in ranks:
                        with contextlib.suppress(psutil.Error, AssertionError):
                            tree.update({p.pid: p for p in task_process_tree(pid, scheduler)})
                    self._seen[(dag_id, try_number)] = (list(tree.values()), ranks[0][1])

    def processes(
        self, dag_id: str, try_number: int = 1, timeout: float = 400
    ) -> tuple[list[psutil.Process], str]:
        """The processes of that try (recorded while its ranks trained) and its run marker."""
        return tuple(  # type: ignore[return-value]
            self._airflow.wait_until(
                f"both ranks of {dag_id} (try {try_number}) to start",
                lambda: self._seen.get((dag_id, try_number)),
                timeout,
                every=0.3,
            )
        )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def seconds_until_gone(processes: list[psutil.Process], run_id: str, timeout: float) -> float:
    """Seconds until every one of ``processes`` and of the run's marked processes is gone;
    fail when something is still there after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not alive(processes) and not processes_with_marker(run_id):
            return time.monotonic() - start
        time.sleep(0.2)
    left = [_describe(p) for p in alive(processes) + processes_with_marker(run_id)]
    raise AssertionError(f"still running {timeout:.0f} s later: {left}")


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:120]}"
    except psutil.Error:
        return str(proc.pid)
