"""The example DAG under Airflow's real scheduler against ``airflow dags test``, and how long
after "mark failed" the last process of a barrier-mode training try is gone.

- ``dags_test``: ``airflow dags test retrain_digits -c '{"state": FRESH, "epochs": E}'`` as a
  command (one process runs every task; its own SQLite home), wall time of the command;
- ``scheduler``: the same DAG run triggered through the REST API of a running installation
  (``airflow scheduler`` with the LocalExecutor, ``airflow dag-processor``, ``airflow
  api-server``; harness/airflow_services.py), wall time from the trigger request until the
  API reports the run ended (each task a supervised process that talks to the execution API);
- ``mark_failed``: ``tests/airflow/dags/sto_scheduled.py``'s ``sto_scheduled_mark_failed``
  (2 ranks in barrier mode on ``local[2]``, training forever) marked failed through the API once
  both ranks train; seconds until none of that try's processes (ranks, launchers, Spark's Python
  workers, the JVM, the task process) is left.

The two ways alternate, each run on a fresh state directory; the scheduled run the scheduler
creates when the DAG is unpaused is a discarded warm-up. Startup of the components is reported
apart.

    python benchmarks/airflow_scheduler.py --repeats 2 --epochs 5
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import pages
from common import log, ratio

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()
sys.path.insert(0, str(common.ROOT))

from harness.airflow_services import (
    RankMarkers,
    airflow_command,
    airflow_env,
    free_port,
    running_airflow,
    seconds_until_gone,
    wait_for_ranks,
)

NAME = "airflow_scheduler"
DAG = "retrain_digits"
DAG_FILES = [common.ROOT / "dags" / "retrain_digits.py"]
FAULT_DAGS = common.ROOT / "tests" / "airflow" / "dags" / "sto_scheduled.py"


def dags_test(home: Path, state: Path, epochs: int) -> float:
    """Seconds ``airflow dags test`` takes for one run of the DAG."""
    env = airflow_env(home, home / "dags", free_port(), {"MLFLOW_TRACKING_URI": None})
    conf = json.dumps({"state": str(state), "epochs": epochs})
    started = time.perf_counter()
    airflow_command(env, "dags", "test", DAG, "-c", conf, timeout=1800)
    return time.perf_counter() - started


def measure(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-airflow-"))
    # airflow dags test's own installation: a migrated SQLite home with the DAG.
    test_home = work / "dags-test-home"
    (test_home / "dags").mkdir(parents=True)
    for source in DAG_FILES:
        (test_home / "dags" / source.name).symlink_to(source)
    airflow_command(airflow_env(test_home, test_home / "dags", free_port(), {}), "db", "migrate")

    started = time.perf_counter()
    extra = {"SPARKTORCH_STATE": str(work / "warmup-state"), "MLFLOW_TRACKING_URI": None}
    with running_airflow(work / "services", [*DAG_FILES, FAULT_DAGS], extra) as airflow:
        startup = time.perf_counter() - started
        log(f"components healthy after {startup:.1f} s")
        airflow.wait_for_dag(DAG)
        airflow.unpause(DAG)
        warmup = airflow.wait_until("the scheduled run", lambda: airflow.runs(DAG), 120)[0]
        airflow.wait_for_run(DAG, warmup["dag_run_id"], timeout=1800)
        log("warm-up (scheduled) run done")

        def scheduled() -> float:
            run_id = airflow.trigger(DAG, {"state": str(fresh("scheduler")), "epochs": args.epochs})
            outcome = airflow.wait_for_run(DAG, run_id, timeout=1800)
            if outcome != "success":
                raise RuntimeError(f"run {run_id}: {outcome}")
            run = airflow.api("GET", f"/dags/{DAG}/dagRuns/{run_id}")
            return _span(run["queued_at"], run["end_date"])

        def fresh(name: str) -> Path:
            return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))

        series = common.alternate(
            {
                "dags_test": lambda: dags_test(test_home, fresh("dags_test"), args.epochs),
                "scheduler": scheduled,
            },
            args.repeats,
            warmup=args.warmup,
            check=lambda name, span: {"api_span_s": span} if name == "scheduler" else None,
            settle_s=args.settle,
        )
        mark_failed = common.Series("mark_failed")
        fault = "sto_scheduled_mark_failed"
        markers = RankMarkers(work / "markers")
        markers.path.mkdir()
        airflow.wait_for_dag(fault)
        airflow.unpause(fault)
        for round_ in range(args.repeats):
            for old in markers.path.iterdir():
                old.unlink()
            run_id = airflow.trigger(fault, {"markers": str(markers.path)})
            processes, marker = wait_for_ranks(airflow, markers, fault, run_id)
            airflow.mark_failed(fault, run_id, "train")
            seconds = seconds_until_gone(processes, marker, timeout=120)
            mark_failed.seconds.append(seconds)
            log(f"round {round_}: mark failed -> last process gone after {seconds:.1f} s")
            airflow.wait_for_run(fault, run_id, timeout=300)

    summary = {name: s.summary() for name, s in {**series, "mark_failed": mark_failed}.items()}
    return {
        "epochs": args.epochs,
        "repeats": args.repeats,
        "startup_s": startup,
        "scheduler_api_queued_to_end_s": [e["api_span_s"] for e in series["scheduler"].extra],
        "variants": summary,
        "ratios": {
            "scheduler_vs_dags_test": ratio(
                summary["scheduler"]["median_s"], summary["dags_test"]["median_s"]
            )
        },
    }


def _span(start: str, end: str) -> float:
    from datetime import datetime

    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "The example DAG under Airflow's scheduler"


def render(doc: dict[str, Any]) -> str:
    """This benchmark\'s section of benchmarks/README.md, from its JSON."""
    labels = {
        "dags_test": "`airflow dags test` command, whole",
        "scheduler": "trigger (REST API) -> run ended, under scheduler + LocalExecutor",
        "mark_failed": "mark failed -> last process of the try gone",
    }
    ratio = (doc.get("ratios") or {}).get("scheduler_vs_dags_test")
    out = [
        f"`dags/retrain_digits.py` ({doc.get('epochs')} epochs, fresh state each run), median of "
        f"{doc.get('repeats')}, alternating, after a warm-up run; the components were healthy "
        f"{pages.num(doc.get('startup_s'), 1)} s after start. Scheduler / `dags test`: "
        f"{pages.num(ratio, suffix='x')}.",
        pages.measured(labels, doc["variants"]),
    ]
    return "\n\n".join(out) + pages.notes(doc.get("notes"))


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline row: the DAG under the scheduler over ``airflow dags test``."""
    ratio = doc.get("ratios", {}).get("scheduler_vs_dags_test")
    if ratio is None:
        return []
    return [
        [
            "example DAG under Airflow's scheduler",
            "scheduler / `dags test`",
            pages.num(ratio, suffix="x"),
            "-",
        ]
    ]


BENCH = pages.Benchmark(
    name=NAME,
    title=TITLE,
    measure=measure,
    render=render,
    summary=summary_rows,
    options=lambda parser: parser.add_argument("--epochs", type=int, default=5),
    defaults={"repeats": 2, "warmup": 0},
    quick=("--repeats=1", "--epochs=1"),
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
