"""Deferred against attached trainings under Airflow's real scheduler: the worker slot a
training holds, its wall time, the triggerer's CPU, and how soon a restarted triggerer watches.

One installation (LocalExecutor on SQLite, with a triggerer: harness/airflow_services.py)
serves every figure:

- **worker-slot seconds**: a training of ``--long-minutes`` (10 by default) run attached and
  deferred at the same time; the seconds its task held a worker slot are the lifetimes of the
  task's worker processes (``airflow worker -- <task instance id>``, sampled every 0.1 s);
- **end to end**: a short barrier training (a trivial 2-rank all-reduce on ``local[2]``),
  attached and deferred in alternating order, ``--repeats`` each; the DAG run's wall time
  from the API (goal: deferred at most 1.1x attached plus one poll interval, 5 s);
- **triggerer CPU**: the triggerer's CPU seconds (its whole process tree) per minute while it
  watches the long training and ``--watched`` more deferred ones, against an idle minute;
- **reattach**: during the long deferred training the triggerer is SIGKILLed and started
  again; the seconds from the new triggerer's start to its first record in the try's log,
  and to the training's next line forwarded.

    python benchmarks/deferred.py --long-minutes 10 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import common
import pages
from common import ratio

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()
sys.path.insert(0, str(common.ROOT))

import psutil

from harness.airflow_services import AirflowServices, running_airflow

NAME = "deferred"
POLL_S = 5.0  # the trigger's longest pause between two looks (detached.handle.MAX_POLL_S)

DAGS = """
import os, time
import pendulum
from airflow.sdk import DAG
from sparktorch_ops.airflow import TorchDistributorOperator

SPARK = {"spark.master": "local[2]", "spark.ui.enabled": "false"}


def train(seconds):
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    deadline = time.monotonic() + float(seconds)
    step = 0
    while True:
        t = torch.ones(1)
        dist.all_reduce(t)
        if step % 10 == 0:
            print(f"step {step}", flush=True)
        step += 1
        if time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    dist.destroy_process_group()
    return int(t.item())


for name, deferrable in (("attached", False), ("deferred", True)):
    for size in ("short", "long", "watched"):
        with DAG(
            dag_id=f"bench_{name}_{size}",
            schedule=None,
            start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
            catchup=False,
            params={"seconds": 0},
        ) as dag:
            TorchDistributorOperator(
                task_id="train", train=train, train_args=["{{ params.seconds }}"],
                num_processes=2, local_mode=False, use_gpu=False, spark_conf=SPARK,
                deferrable=deferrable, durable=False,
            )
        globals()[dag.dag_id] = dag
"""


class SlotWatcher:
    """Samples the LocalExecutor's workers every 0.1 s: a worker holds a slot while its title
    names a task instance (``airflow worker -- LocalExecutor: <ti id>``); the spans each task
    instance held one, per worker (a gap of over a second starts a new span)."""

    def __init__(self) -> None:
        self.spans: dict[str, dict[int, list[list[float]]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            now = time.time()
            for proc in psutil.process_iter(["pid", "cmdline"]):
                title = " ".join(proc.info["cmdline"] or [])
                if not title.startswith("airflow worker -- LocalExecutor: "):
                    continue
                ti_id = title.rsplit(" ", 1)[-1]
                if ti_id == "<idle>":
                    continue
                spans = self.spans.setdefault(ti_id, {}).setdefault(proc.info["pid"], [])
                if spans and now - spans[-1][1] <= 1.0:
                    spans[-1][1] = now
                else:
                    spans.append([now, now])

    def slot_seconds(self, ti_id: str) -> float:
        return sum(
            last - first for spans in self.spans.get(ti_id, {}).values() for first, last in spans
        )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its descendants so far."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


def run_wall_s(airflow: AirflowServices, dag_id: str, run_id: str) -> float:
    run = airflow.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")
    start, end = datetime.fromisoformat(run["start_date"]), datetime.fromisoformat(run["end_date"])
    return (end - start).total_seconds()


def wait_state(airflow: AirflowServices, dag_id: str, run_id: str, state: str) -> None:
    airflow.wait_until(
        f"{dag_id} {state}",
        lambda: airflow.task_instance(dag_id, run_id, "train")["state"] == state,
        600,
        every=0.2,
    )


def trigger_log_records(airflow: AirflowServices, dag_id: str, run_id: str) -> dict[str, list]:
    folder = airflow.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / "task_id=train"
    found = {}
    for path in sorted(folder.glob("attempt=1.log.trigger.*.log")):
        found[path.name] = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return found


def stamp(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-deferred-"))
    long_minutes, watched = args.long_minutes, args.watched
    dag_file = work / "bench_deferred_dags.py"
    dag_file.write_text(DAGS)
    home = work / "home"
    extra = {"AIRFLOW__CORE__PARALLELISM": "8", "MLFLOW_TRACKING_URI": None}
    with running_airflow(home, [dag_file], extra) as airflow:
        ids = [
            f"bench_{n}_{s}" for n in ("attached", "deferred") for s in ("short", "long", "watched")
        ]
        for dag_id in ids:
            airflow.wait_for_dag(dag_id)
            airflow.unpause(dag_id)
        watcher = SlotWatcher()

        # End to end, short trainings, alternating, before anything else runs.
        def short_run(name: str) -> float:
            dag_id = f"bench_{name}_short"
            run_id = airflow.trigger(dag_id, {"seconds": 0})
            assert airflow.wait_for_run(dag_id, run_id, timeout=600) == "success"
            return run_wall_s(airflow, dag_id, run_id)

        series = common.alternate(  # the warm-up round warms the machine's caches
            {name: functools.partial(short_run, name) for name in ("attached", "deferred")},
            args.repeats,
            warmup=args.warmup,
            check=lambda _name, wall: {"seconds": wall},
            settle_s=0,
        )
        short = {name: s.seconds for name, s in series.items()}

        triggerer = airflow.processes["triggerer"]
        idle_start = tree_cpu(triggerer.pid)
        time.sleep(60)
        idle_cpu = tree_cpu(triggerer.pid) - idle_start

        seconds = long_minutes * 60
        long_runs = {
            name: airflow.trigger(f"bench_{name}_long", {"seconds": seconds})
            for name in ("attached", "deferred")
        }
        extra_runs = [
            airflow.trigger("bench_deferred_watched", {"seconds": seconds}) for _ in range(watched)
        ]
        wait_state(airflow, "bench_deferred_long", long_runs["deferred"], "deferred")
        for run_id in extra_runs:
            wait_state(airflow, "bench_deferred_watched", run_id, "deferred")
        time.sleep(30)  # every training past its start
        busy_start = tree_cpu(triggerer.pid)
        time.sleep(60)
        busy_cpu = tree_cpu(triggerer.pid) - busy_start

        # The triggerer SIGKILLed and started again: how soon its successor watches again.
        before = trigger_log_records(airflow, "bench_deferred_long", long_runs["deferred"])
        os.killpg(triggerer.pid, signal.SIGKILL)
        triggerer.wait(30)
        killed = time.time()
        airflow.start("triggerer")
        started = time.time()

        def successor_lines() -> list | None:
            now = trigger_log_records(airflow, "bench_deferred_long", long_runs["deferred"])
            new = [r for name, rs in now.items() if name not in before for r in rs]
            lines = [r for r in new if str(r.get("event", "")).startswith("[rank ")]
            return new if lines else None

        new_records = airflow.wait_until("the successor's first line", successor_lines, 300, 0.2)
        first_record = min(stamp(r) for r in new_records)
        first_line = min(stamp(r) for r in new_records if str(r["event"]).startswith("[rank "))

        for name, run_id in long_runs.items():
            assert airflow.wait_for_run(f"bench_{name}_long", run_id, seconds + 600) == "success"
        for run_id in extra_runs:
            airflow.wait_for_run("bench_deferred_watched", run_id, seconds + 600)
        watcher.stop()
        slots = {
            name: watcher.slot_seconds(
                airflow.task_instance(f"bench_{name}_long", run_id, "train")["id"]
            )
            for name, run_id in long_runs.items()
        }
        walls = {
            name: run_wall_s(airflow, f"bench_{name}_long", run_id)
            for name, run_id in long_runs.items()
        }
    watching = 1 + watched
    return {
        "long_minutes": long_minutes,
        "slot_seconds": slots,
        "long_wall_s": walls,
        "short_wall_s": short,
        "short_median_s": {k: common.median(v) for k, v in short.items()},
        "short_ratio": ratio(common.median(short["deferred"]), common.median(short["attached"])),
        "short_goal_s": 1.1 * common.median(short["attached"]) + POLL_S,
        "triggerer_cpu_s_per_min": {"idle": idle_cpu, "watching": busy_cpu},
        "watched_trainings": watching,
        "triggerer_cpu_s_per_training_min": (busy_cpu - idle_cpu) / watching,
        "reattach_s": {
            "start_to_first_record": first_record - started,
            "start_to_first_line": first_line - started,
            "kill_to_first_line": first_line - killed,
        },
    }


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "Deferred trainings under Airflow's scheduler"


def render(doc: dict[str, Any]) -> str:
    """This benchmark's section of benchmarks/README.md, from its JSON."""
    slots, walls, short = doc["slot_seconds"], doc["long_wall_s"], doc["short_median_s"]
    cpu, reattach = doc["triggerer_cpu_s_per_min"], doc["reattach_s"]
    rows = [
        [
            f"worker-slot seconds, a {pages.num(doc['long_minutes'], 0)}-minute training",
            pages.num(slots["attached"], 1),
            pages.num(slots["deferred"], 1),
        ],
        [
            "its DAG run's wall time, s",
            pages.num(walls["attached"], 1),
            pages.num(walls["deferred"], 1),
        ],
        [
            f"a short training's DAG run, s (median of {len(doc['short_wall_s']['attached'])})",
            pages.num(short["attached"], 2),
            pages.num(short["deferred"], 2),
        ],
    ]
    return (
        "One installation (LocalExecutor, SQLite, a triggerer); barrier mode on `local[2]`, "
        "2 ranks. Slot seconds are the lifetimes of the task's worker processes.\n\n"
        + pages.table(["figure", "attached", "deferred"], rows)
        + f"\n\nShort training, deferred / attached: {pages.num(doc['short_ratio'], suffix='x')} "
        f"(goal: at most {pages.num(doc['short_goal_s'], 2)} s, 1.1x attached plus one "
        f"{pages.num(POLL_S, 0)} s poll). Triggerer CPU: {pages.num(cpu['idle'], 2)} s per "
        f"minute idle, {pages.num(cpu['watching'], 2)} s watching "
        f"{doc['watched_trainings']} trainings: "
        f"{pages.num(doc['triggerer_cpu_s_per_training_min'], 3)} CPU s per training per "
        f"minute. Triggerer SIGKILLed and started again: its first record in the try's log "
        f"{pages.num(reattach['start_to_first_record'], 1)} s after its start, the training's "
        f"next line forwarded after {pages.num(reattach['start_to_first_line'], 1)} s "
        f"({pages.num(reattach['kill_to_first_line'], 1)} s after the kill): Airflow gives a "
        "dead triggerer's triggers to another once its last heartbeat is "
        "`[triggerer] triggerer_health_check_threshold` old (30 s by default; "
        "tests/airflow/test_real_scheduler.py sets 5 s)."
    )


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline rows: slot seconds and the short training's ratio."""
    slots = doc["slot_seconds"]
    return [
        [
            f"a {pages.num(doc['long_minutes'], 0)}-minute barrier training, real scheduler",
            "worker-slot seconds, attached / deferred",
            f"{pages.num(slots['attached'], 0)} / {pages.num(slots['deferred'], 1)} s",
            "-",
        ],
        [
            "a short training, deferred (real scheduler)",
            "DAG run wall time / attached",
            pages.num(doc["short_ratio"], suffix="x"),
            f"<= 1.1x + {pages.num(POLL_S, 0)} s "
            f"({'met' if doc['short_median_s']['deferred'] <= doc['short_goal_s'] else 'not met'})",
        ],
    ]


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--long-minutes", type=float, default=10.0)
    parser.add_argument("--watched", type=int, default=3)


BENCH = pages.Benchmark(
    name=NAME,
    title=TITLE,
    measure=measure,
    render=render,
    summary=summary_rows,
    options=options,
    defaults={"repeats": 3},
    quick=("--repeats=1", "--warmup=0", "--long-minutes=1", "--watched=1"),
    headline=True,
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
