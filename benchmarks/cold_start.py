"""Cold start: the first run of a fresh process, which is what every scheduled task pays, next
to that process's second (warm) run and bare torchrun; local, barrier and Spark Connect.

Each round runs every variant once, in a rotated order, after a discarded warm-up round; every
run of ours is a fresh interpreter (``CHILD`` below) that makes its session first, then starts
the clock, runs the trivial 2-rank gloo all-reduce twice and reports both runs' seconds and the
first run's phase events:

- ``torchrun``: bare ``torchrun --standalone --nproc-per-node=2 jobs.py allreduce`` (the
  baseline of the ratios);
- ``<tree>_local``: ``local_mode=True``, no Spark at all;
- ``<tree>_barrier``: barrier mode on a ``local[2]`` session created before the clock starts;
- ``<tree>_connect_fresh``: barrier mode from a Spark Connect client, against a Connect server
  (``local[2]``) started for this round that has run nothing yet;
- ``<tree>_connect_warm``: the same against that server once it has run that tree's first
  run (its Python workers and their warm processes live on): a new client process.

``<tree>`` is ``ours`` (this checkout) and, with ``--before PATH``, ``before``: another
checkout with its own ``.venv`` (``git worktree add PATH REV``, then ``bash scripts/venv.sh``
there), run the same way in the same rounds, so that before and after share the machine's
state.

    python benchmarks/cold_start.py --repeats 3 --before ../base
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import common
import pages
from common import ratio

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()
sys.path.insert(0, str(common.ROOT))

from harness.connect_server import ConnectServer

NAME = "cold_start"
TITLE = "Cold start: the first run of a fresh process"
BASELINE = "torchrun"
TARGETS = {"barrier": 0.8}  # the cold barrier run over bare torchrun, at most
WARM_TARGETS = {"local": 0.3, "barrier": 0.6}  # warm runs, as the launch benchmark's goals
MODES = ("local", "barrier", "connect_fresh", "connect_warm")

# What a fresh interpreter runs: argv = mode, Connect URL (or "-"), output file, this folder
# (for the job, ``jobs.allreduce``). Only the public API of sparktorch_ops and pyspark: any
# checkout runs it.
CHILD = """
import json, sys, time
mode, url, out, bench = sys.argv[1:5]
sys.path.insert(0, bench)
from jobs import allreduce

spark = None
if mode == "barrier":
    from pyspark.sql import SparkSession
    spark = (SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
elif mode.startswith("connect"):
    from pyspark.sql import SparkSession
    spark = SparkSession.builder.remote(url).getOrCreate()
from sparktorch_ops import TorchDistributor

runs = []
for _ in range(2):
    events = []
    started = time.monotonic()
    distributor = TorchDistributor(
        num_processes=2, local_mode=mode == "local", use_gpu=False, spark=spark,
        on_event=lambda e: events.append([e.name, round(time.monotonic() - started, 3)]),
    )
    value = distributor.run(allreduce)
    runs.append({"seconds": time.monotonic() - started, "value": value, "events": events})
with open(out, "w") as handle:
    json.dump(runs, handle)
"""


def run_child(python: str, cwd: Path, mode: str, url: str | None) -> list[dict[str, Any]]:
    """One fresh interpreter of ``python`` (a checkout's venv) running :data:`CHILD`: its two
    runs, the first cold."""
    with tempfile.TemporaryDirectory(prefix="cold-start-") as directory:
        out = Path(directory, "runs.json")
        env = {**os.environ, "PYSPARK_PYTHON": python, "PYSPARK_DRIVER_PYTHON": python}
        proc = subprocess.run(
            [python, "-c", CHILD, mode, url or "-", str(out), str(common.BENCH_DIR)],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{mode} exited {proc.returncode}: {proc.stderr[-2000:]}")
        runs: list[dict[str, Any]] = json.loads(out.read_text())
    for one in runs:
        if one["value"] != 3.0:
            raise RuntimeError(f"{mode}: the all-reduce gave {one['value']}, not 3.0")
    return runs


def start_connect_server(directory: Path) -> ConnectServer:
    """A Connect server on ``local[2]`` that has run nothing yet."""
    directory.mkdir(parents=True, exist_ok=True)
    server = ConnectServer(directory, master="local[2]")
    server.wait_listening(240)
    return server


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Rounds of every variant: each variant's cold seconds (and warm ones), and one cold
    barrier run's phase events per tree."""
    trees = {"ours": common.ROOT}
    if args.before is not None:
        trees["before"] = args.before.resolve()
    names = [BASELINE] + [f"{tree}_{mode}" for tree in trees for mode in MODES]
    if args.no_connect:
        names = [name for name in names if "connect" not in name]
    servers: dict[str, ConnectServer] = {}
    timelines: dict[str, list[list[Any]]] = {}

    @contextlib.contextmanager
    def each_round() -> Iterator[None]:
        # One server per tree per round: each tree's first run is a fresh server's first.
        with tempfile.TemporaryDirectory(prefix="cold-start-servers-") as scratch:
            try:
                for tree in trees if not args.no_connect else ():
                    servers[tree] = start_connect_server(Path(scratch) / tree)
                yield
            finally:
                for server in servers.values():
                    server.stop()
                servers.clear()

    def variant(name: str) -> Any:
        if name == BASELINE:
            return lambda: common.run_torchrun(common.JOBS_SCRIPT, ["allreduce"])
        tree, mode = name.split("_", 1)
        python = str(trees[tree] / ".venv" / "bin" / "python")

        def run() -> list[dict[str, Any]]:
            server = servers.get(tree)
            runs = run_child(python, trees[tree], mode, server.url if server else None)
            if mode == "barrier":
                timelines.setdefault(tree, runs[0]["events"])
            return runs

        return run

    series = common.alternate(
        {name: variant(name) for name in names},
        args.repeats,
        warmup=args.warmup,
        # the cold run's own seconds, from the call (the child's interpreter and session apart)
        check=lambda name, runs: (
            {"seconds": runs[0]["seconds"], "warm_s": runs[1]["seconds"]}
            if name != BASELINE
            else None
        ),
        settle_s=args.settle,
        each_round=each_round,
        # A fresh server's first run comes before that server's warm one.
        order=lambda names: sorted(names, key=lambda n: n.endswith("connect_warm")),
    )
    base = common.median(series[BASELINE].seconds)
    variants = {}
    for name, s in series.items():
        summary = s.summary()
        summary["ratio"] = ratio(summary["median_s"], base)
        warm_s = [one["warm_s"] for one in s.extra]
        summary["warm_median_s"] = common.median(warm_s)
        summary["warm_ratio"] = ratio(summary["warm_median_s"], base)
        summary["warm_seconds"] = [round(x, 4) for x in warm_s]
        variants[name] = summary
    return {
        "repeats": args.repeats,
        "trees": {tree: str(path) for tree, path in trees.items()},
        "variants": variants,
        "timelines": timelines,
    }


def _phases(events: list[list[Any]]) -> list[list[str]]:
    """A run's events as rows: each event's time, and the time since the one before."""
    rows, previous = [], 0.0
    for name, at in events:
        rows.append([f"`{name}`", pages.num(at), pages.num(at - previous)])
        previous = at
    return rows


def render(doc: dict[str, Any]) -> str:
    """This benchmark's section of benchmarks/README.md, from its JSON."""
    rows = []
    for name, s in doc["variants"].items():
        rows.append(
            [
                f"`{name}`",
                pages.num(s.get("median_s")),
                pages.spread(s),
                pages.num(s.get("ratio"), suffix="x"),
                pages.num(s.get("warm_median_s")),
                pages.num(s.get("warm_ratio"), suffix="x"),
                f"{s.get('runs')}{pages.errors(s) if s.get('runs') else ''}",
            ]
        )
    out = [
        "A trivial 2-rank gloo all-reduce, from the call to its return. Every run of ours is a "
        "fresh interpreter that first makes its session (a `local[2]` one, or a Spark Connect "
        "client), then runs twice: the first run (cold) is what a scheduled task pays, the "
        "second (warm) what a long-lived driver pays. `connect_fresh`: against a Connect server "
        "that has run nothing yet; `connect_warm`: against that server after it ran the first. "
        f"Median of {doc.get('repeats')} rounds (after a warm-up round), variants alternating.",
        pages.table(
            [
                "variant",
                "cold s",
                "min-max s",
                "cold / torchrun",
                "warm s",
                "warm / torchrun",
                "runs",
            ],
            rows,
        ),
    ]
    for tree, events in doc.get("timelines", {}).items():
        out.append(
            f"Phases of one cold barrier run, `{tree}` ({doc['trees'][tree]}): "
            "seconds since the call, and since the event before."
        )
        out.append(pages.table(["event", "at s", "phase s"], _phases(events)))
    return "\n\n".join(out)


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline rows: the cold and warm barrier runs over bare torchrun."""
    ours = doc["variants"].get("ours_barrier", {})
    before = doc["variants"].get("before_barrier", {})
    was = f" (was {pages.num(before.get('ratio'), suffix='x')})" if before.get("ratio") else ""
    return [
        [
            "cold start: a fresh process's first barrier run (trivial all-reduce)",
            "ours / bare torchrun",
            f"{pages.num(ours.get('ratio'), suffix='x')}{was}",
            pages.met(ours.get("ratio"), TARGETS["barrier"], at_most=True),
        ],
        [
            "the same process's second (warm) barrier run",
            "ours / bare torchrun",
            pages.num(ours.get("warm_ratio"), suffix="x"),
            pages.met(ours.get("warm_ratio"), WARM_TARGETS["barrier"], at_most=True),
        ],
    ]


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--before", type=Path, help="another checkout, run as 'before'")
    parser.add_argument("--no-connect", action="store_true", help="skip the Connect variants")


BENCH = pages.Benchmark(
    name=NAME,
    title=TITLE,
    measure=measure,
    render=render,
    summary=summary_rows,
    options=options,
    defaults={"repeats": 3},
    quick=("--repeats=1", "--warmup=0", "--no-connect"),
    headline=True,
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
