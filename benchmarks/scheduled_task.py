"""A whole scheduled task: from the start of the task's process to rank 0's result, with the
Spark session's start as its own phase, under ``airflow dags test`` and as a Prefect flow.

Every run is a fresh process, as a scheduled task is, training the trivial 2-rank all-reduce in
barrier mode:

- ``airflow_embedded``: ``airflow dags test`` of a one-task DAG whose TorchDistributorOperator
  starts an embedded ``local[2]`` session (the example DAG's way);
- ``airflow_connect``: the same task with a ``spark_connect`` connection to a Connect server
  (``local[2]``) that runs the whole time, as a deployment keeps one;
- ``prefect_embedded``: a flow run (``python flow.py``, Prefect's ephemeral server) whose first
  task starts the embedded session and whose second trains on it.

Phases, in wall-clock seconds since the process was started: the session ready (the operator's
``session_ready`` event; the flow's session task), rank 0's result (the time rank 0 returned),
the process gone. Variants alternate round by round.

    python benchmarks/scheduled_task.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import pages

if __name__ == "__main__":
    common.prepare_environment()
sys.path.insert(0, str(common.ROOT))

from harness.airflow_services import airflow_command, airflow_env, free_port
from harness.connect_server import ConnectServer

NAME = "scheduled_task"
TITLE = "A whole scheduled task, from its process's start"
EVENTS_ENV = "SPARKTORCH_BENCH_EVENTS"

# The training of both: the trivial 2-rank all-reduce, noting when rank 0 returned.
ALLREDUCE = f"""
import sys, time
sys.path.insert(0, {str(common.BENCH_DIR)!r})
import jobs


def allreduce():
    return {{"sum": jobs.allreduce(), "returned_at": time.time()}}
"""

# The DAG: one task, its events written (wall clock) to $SPARKTORCH_BENCH_EVENTS.
DAG = (
    """
import json, os, time
import pendulum
from airflow.sdk import DAG
from sparktorch_ops.airflow import TorchDistributorOperator

"""
    + ALLREDUCE
    + """


class Timed(TorchDistributorOperator):
    def _on_event(self, event, ti):
        super()._on_event(event, ti)
        with open(os.environ["SPARKTORCH_BENCH_EVENTS"], "a") as out:
            out.write(json.dumps([event.name, event.time]) + "\\n")


with DAG(dag_id="bench_scheduled_task", schedule=None,
         start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=False) as dag:
    Timed(task_id="train", train=allreduce, num_processes=2, local_mode=False, use_gpu=False,
          conn_id=os.environ.get("BENCH_CONN_ID", "spark_default"),
          spark_conf={"spark.master": "local[2]"} if not os.environ.get("BENCH_CONN_ID") else None)
"""
)

# The flow: the session first (timed), then the training on it.
FLOW = (
    """
import json, sys, time
from prefect import flow, task
from sparktorch_ops.prefect import run_torch_distributor

"""
    + ALLREDUCE
    + """


@task
def start_spark() -> float:
    from pyspark.sql import SparkSession
    SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1").getOrCreate()
    return time.time()


@flow
def bench_scheduled_task() -> dict:
    ready = start_spark()
    value = run_torch_distributor(allreduce, num_processes=2, local_mode=False, use_gpu=False,
                                  spark_master="local[2]")
    return {"session_ready": ready, **value}


if __name__ == "__main__":
    print("RESULT " + json.dumps(bench_scheduled_task()), flush=True)
"""
)


def airflow_run(home: Path, events: Path, conn: str | None) -> dict[str, float]:
    """One ``airflow dags test``: its phases in seconds since the process was started."""
    env = airflow_env(home, home / "dags", free_port(), {EVENTS_ENV: str(events)})
    if conn is not None:
        env["BENCH_CONN_ID"] = "bench_connect"
        env["AIRFLOW_CONN_BENCH_CONNECT"] = conn
    events.unlink(missing_ok=True)
    started = time.time()
    airflow_command(env, "dags", "test", "bench_scheduled_task", timeout=600)
    gone = time.time()
    seen = dict(json.loads(line) for line in events.read_text().splitlines())
    return {
        "session_ready": seen["session_ready"] - started,
        "result": seen["result_received"] - started,
        "process_gone": gone - started,
    }


def prefect_run(script: Path, home: Path) -> dict[str, float]:
    """One flow run as a script: its phases in seconds since the process was started."""
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    started = time.time()
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    gone = time.time()
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"flow exited {proc.returncode}: {proc.stderr[-2000:]}")
    value = json.loads(line[len("RESULT ") :])
    return {
        "session_ready": value["session_ready"] - started,
        "result": value["returned_at"] - started,
        "process_gone": gone - started,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-scheduled-"))
    home = work / "airflow"
    (home / "dags").mkdir(parents=True)
    (home / "dags" / "bench_scheduled_task.py").write_text(DAG)
    airflow_command(airflow_env(home, home / "dags", free_port(), {}), "db", "migrate")
    flow_script = work / "bench_flow.py"
    flow_script.write_text(FLOW)
    server = ConnectServer(work, master="local[2]")
    try:
        server.wait_listening(240)
        port = server.url.rsplit(":", 1)[1]
        conn = json.dumps({"conn_type": "spark_connect", "host": "127.0.0.1", "port": int(port)})
        series = common.alternate(  # the warm-up round is the server's first run
            {
                "airflow_embedded": lambda: airflow_run(home, work / "events.jsonl", None),
                "airflow_connect": lambda: airflow_run(home, work / "events.jsonl", conn),
                "prefect_embedded": lambda: prefect_run(flow_script, work / "prefect"),
            },
            args.repeats,
            warmup=args.warmup,
            check=lambda _name, phases: {"seconds": phases["result"], **phases},
            settle_s=args.settle,
        )
    finally:
        server.stop()
    variants = {}
    for name, s in series.items():
        summary = s.summary()
        for phase in ("session_ready", "result", "process_gone"):
            summary[f"{phase}_median_s"] = common.median([p[phase] for p in s.extra])
        variants[name] = summary
    return {"repeats": args.repeats, "variants": variants}


def render(doc: dict[str, Any]) -> str:
    """This benchmark's section of benchmarks/README.md, from its JSON."""
    rows = [
        [
            f"`{name}`",
            pages.num(s.get("session_ready_median_s")),
            pages.num(s.get("result_median_s")),
            pages.num(
                (s.get("result_median_s") or 0) - (s.get("session_ready_median_s") or 0)
                if s.get("result_median_s") is not None
                else None
            ),
            pages.num(s.get("process_gone_median_s")),
            f"{s.get('runs')}{pages.errors(s) if s.get('runs') else ''}",
        ]
        for name, s in doc["variants"].items()
    ]
    return "\n\n".join(
        [
            "A scheduled task's whole life, a fresh process each time, training the trivial "
            "2-rank all-reduce in barrier mode: seconds from the process's start until the "
            "Spark session is ready, until rank 0 returned, and until the process is gone. "
            "`airflow_*`: `airflow dags test` of a one-task DAG (an embedded `local[2]` session "
            "per task, or a `spark_connect` connection to a Connect server that keeps running); "
            "`prefect_embedded`: a flow run as a script on Prefect's ephemeral server, its first "
            f"task starting the session. Median of {doc.get('repeats')} rounds after a warm-up.",
            pages.table(
                [
                    "variant",
                    "session ready s",
                    "rank 0's result s",
                    "session -> result s",
                    "process gone s",
                    "runs",
                ],
                rows,
            ),
        ]
    )


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline row: a scheduled Airflow task, embedded Spark against Connect."""
    v = doc["variants"]
    embedded = v.get("airflow_embedded", {}).get("result_median_s")
    connect = v.get("airflow_connect", {}).get("result_median_s")
    if embedded is None:
        return []
    return [
        [
            "a scheduled Airflow task (trivial all-reduce, barrier)",
            "s from the task process's start to rank 0's result: embedded local[2] / Connect",
            f"{pages.num(embedded)} / {pages.num(connect)} s",
            "-",
        ]
    ]


BENCH = pages.Benchmark(
    name=NAME,
    title=TITLE,
    measure=measure,
    render=render,
    summary=summary_rows,
    defaults={"repeats": 3},
    headline=True,
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
