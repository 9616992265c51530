"""Driver memory: the RSS a run adds to the driver, its peak during a run, and whether it grows.

The driver's RSS is read after ``gc.collect()`` at start, after importing the distributor,
and after every run; a thread samples it every 10 ms during each run for the peak. Then ``--repeats``
runs in a row (default 20) show whether it stays flat: the slope over the runs after the first
is the figure to watch (a leak shows up as MiB per run).

Jobs: ``allreduce`` (the trivial job) or ``lines`` (each rank prints ``--lines`` lines into a
logger that drops them: what log streaming keeps in the driver). Local mode by default;
``--mode barrier`` runs on a ``local[2]`` session (the JVM's memory is not the driver's and is
reported apart).

    python benchmarks/memory.py --repeats 20
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
from typing import Any

import common
import pages
import psutil
from common import RssSampler, log

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()

import jobs

NAME = "memory"


def slope(values: list[float]) -> float | None:
    """Least-squares slope of ``values`` against their index (MiB per run)."""
    n = len(values)
    if n < 2:
        return None
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


def jvm_rss_mib() -> float | None:
    """RSS of the Spark JVM started by this driver, if any."""
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.name() == "java":
                return float(proc.memory_info().rss / 2**20)
        except psutil.Error:
            continue
    return None


def settled_rss() -> float:
    gc.collect()
    return common.rss_mib()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rss: dict[str, Any] = {"start": settled_rss()}
    session = None
    if args.mode == "barrier":
        session = common.start_spark("local[2]")
        rss["after_spark_session"] = settled_rss()
    import sparktorch_ops.distributor  # noqa: F401  (what the import adds is a figure)

    rss["after_import"] = settled_rss()
    if args.job == "allreduce":
        job: Any = jobs.allreduce
        expected: Any = 3.0
    else:
        job = functools.partial(jobs.print_lines, args.lines)
        expected = args.lines

    runs = []
    for index in range(args.repeats):
        before = settled_rss()
        distributor = common.ours(
            local_mode=args.mode == "local", spark=session, timeout=args.timeout
        )
        with RssSampler(interval=0.01) as sampler:
            value = distributor.run(job)
        if value != expected:
            raise AssertionError(f"run {index + 1} returned {value!r}, expected {expected!r}")
        del distributor
        after = settled_rss()
        runs.append(
            {
                "run": index + 1,
                "before_mib": before,
                "peak_mib": sampler.peak_mib,
                "after_mib": after,
            }
        )
        log(
            f"run {index + 1}/{args.repeats}: before {before:.1f}, peak {sampler.peak_mib:.1f}, after {after:.1f} MiB"
        )

    afters = [r["after_mib"] for r in runs]
    summary = {
        "first_run_added_mib": afters[0] - rss["after_import"] if afters else None,
        "peak_during_run_added_mib_max": max(r["peak_mib"] - r["before_mib"] for r in runs)
        if runs
        else None,
        "after_last_minus_after_first_mib": afters[-1] - afters[0] if afters else None,
        "slope_after_first_mib_per_run": slope(afters[1:]),
        "jvm_rss_mib": jvm_rss_mib(),
    }
    if session is not None:
        session.stop()
    return {
        "mode": args.mode,
        "job": args.job,
        "runs": args.repeats,
        "rss_mib": rss,
        "per_run": runs,
        "summary": summary,
        "notes": (
            "RSS read after gc.collect(); peaks sampled every 10 ms. 'first_run_added' includes "
            "one-time costs (modules imported lazily by the first run); the slope over the later "
            "runs is what a leak would show."
        ),
    }


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "Memory"


MEMORY_LABELS = {
    "first_run_added_mib": "added by the first run (one-time costs included)",
    "peak_during_run_added_mib_max": "peak during a run above its start, the highest",
    "after_last_minus_after_first_mib": "after the last run minus after the first",
    "slope_after_first_mib_per_run": "growth per run after the first (slope)",
    "jvm_rss_mib": "JVM RSS",
}


def render(doc: dict[str, Any]) -> str:
    """This benchmark\'s section of benchmarks/README.md, from its JSON."""
    s = doc["summary"]
    rows = [[MEMORY_LABELS.get(k, k.replace("_", " ")), pages.num(v)] for k, v in s.items()]
    rss = doc.get("rss_mib") or {}
    start = (
        f" The driver process starts at {pages.num(rss.get('start'), 1)} MiB, "
        f"{pages.num(rss.get('after_import'), 1)} MiB after importing sparktorch_ops."
        if rss
        else ""
    )
    return (
        f"Driver RSS, {doc.get('mode')} mode, job `{doc.get('job')}`, {doc.get('runs')} runs in a "
        f"row in a fresh process, MiB.{start}\n\n"
        + pages.table(["figure", "MiB"], rows)
        + pages.notes(doc.get("notes"))
    )


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline row: what the first run adds, and the runs after it."""
    s = doc["summary"]
    return [
        [
            "memory, driver RSS",
            f"added by the first run / by {doc.get('runs', 0) - 1} more",
            f"{pages.num(s.get('first_run_added_mib'))} / "
            f"{pages.num(s.get('after_last_minus_after_first_mib'))} MiB",
            "-",
        ]
    ]


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=["local", "barrier"], default="local")
    parser.add_argument("--job", choices=["allreduce", "lines"], default="allreduce")
    parser.add_argument("--lines", type=int, default=20_000, help="lines per rank for --job lines")


BENCH = pages.Benchmark(
    name=NAME,
    title=TITLE,
    measure=measure,
    render=render,
    summary=summary_rows,
    options=options,
    defaults={"repeats": 20, "timeout": 300},
    quick=("--repeats=3",),
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
