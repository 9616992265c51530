"""The sweep DAG (``dags/sweep_digits.py``: three mapped trainings, one learning rate each) under
Airflow's real scheduler, with the LocalExecutor's ``parallelism`` at 1 and at 3.

For each parallelism a fresh installation runs (harness/airflow_services.py: scheduler, DAG
processor, API server on SQLite); one DAG run is triggered through the REST API on a fresh state
directory, and its wall time is the API's end date minus its start date. The mapped trainings'
own start and end times say whether they overlapped. Startup of the components is not counted.

    python benchmarks/sweep_dag.py --epochs 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

import common
import pages
from common import log, ratio

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()
sys.path.insert(0, str(common.ROOT))

from harness.airflow_services import running_airflow

NAME = "sweep_dag"
DAG = "sweep_digits"
PARALLELISMS = (1, 3)


def one_run(work: Path, parallelism: int, epochs: int) -> dict[str, Any]:
    """One sweep run on a fresh installation with ``parallelism``: its wall time and spans."""
    home = work / f"home-p{parallelism}"
    extra = {
        "AIRFLOW__CORE__PARALLELISM": str(parallelism),
        "SPARKTORCH_STATE": str(home / "state"),
        "MLFLOW_TRACKING_URI": None,
    }
    with running_airflow(home, [common.ROOT / "dags" / "sweep_digits.py"], extra) as airflow:
        airflow.wait_for_dag(DAG)
        airflow.unpause(DAG)
        run_id = airflow.trigger(DAG, {"epochs": epochs})
        state = airflow.wait_for_run(DAG, run_id, timeout=1800)
        run = airflow.api("GET", f"/dags/{DAG}/dagRuns/{run_id}")
        mapped = airflow.api("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/train/listMapped")[
            "task_instances"
        ]
    spans = sorted(
        (datetime.fromisoformat(ti["start_date"]), datetime.fromisoformat(ti["end_date"]))
        for ti in mapped
    )
    start, end = datetime.fromisoformat(run["start_date"]), datetime.fromisoformat(run["end_date"])
    return {
        "state": state,
        "wall_s": (end - start).total_seconds(),
        "train_s": [(e - s).total_seconds() for s, e in spans],
        "trainings_overlap": max(s for s, _ in spans) < min(e for _, e in spans),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    runs = {}
    for parallelism in PARALLELISMS:
        log(f"parallelism {parallelism}: a fresh installation, one sweep run")
        runs[str(parallelism)] = one_run(work, parallelism, args.epochs)
        log(f"parallelism {parallelism}: {runs[str(parallelism)]}")
    together = ratio(runs["3"]["wall_s"], runs["1"]["wall_s"])
    return {"epochs": args.epochs, "runs": runs, "parallelism_3_over_1": together}


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "The sweep DAG under Airflow's scheduler"


def render(doc: dict[str, Any]) -> str:
    """This benchmark's section of benchmarks/README.md, from its JSON."""
    rows = [
        [
            parallelism,
            run["state"],
            pages.num(run["wall_s"], 1),
            ", ".join(pages.num(s, 1) for s in run["train_s"]),
            "yes" if run["trainings_overlap"] else "no",
        ]
        for parallelism, run in doc["runs"].items()
    ]
    return (
        f"`dags/sweep_digits.py` ({doc.get('epochs')} epoch per training, three mapped "
        "trainings of 1 rank on `local[1]` each) on a fresh installation per parallelism; one "
        "run each, wall time from the run's start to its end.\n\n"
        + pages.table(
            ["parallelism", "state", "run wall s", "each training s", "trainings overlap"], rows
        )
        + f"\n\nparallelism 3 / parallelism 1: {pages.num(doc.get('parallelism_3_over_1'), suffix='x')}"
    )


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline row: the sweep's wall time with parallelism 3 over 1."""
    return [
        [
            "sweep DAG, 3 mapped trainings, real scheduler",
            "run wall time, parallelism 3 / 1",
            pages.num(doc.get("parallelism_3_over_1"), suffix="x"),
            "-",
        ]
    ]


BENCH = pages.Benchmark(
    name=NAME,
    title=TITLE,
    measure=measure,
    render=render,
    summary=summary_rows,
    options=lambda parser: parser.add_argument("--epochs", type=int, default=1),
    quick=("--epochs=1",),
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
