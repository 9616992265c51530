"""Log streaming: each of 2 ranks prints 20,000 lines; ours into a logger, torchrun to /dev/null.

Variants, alternating round by round after a discarded warm-up round:

- ``torchrun``: bare torchrun runs ``jobs.py lines``; its stdout goes to /dev/null (the floor:
  nothing is read, the ranks' stdout is block-buffered).
- ``ours_local_script``: the same script through ``run("jobs.py", "lines")``; every line goes
  through the channel to a logger with a ``FileHandler`` on a temp file (as Airflow's task log).
- ``ours_local_fn``: the same through ``run(jobs.print_lines, N)``.
- control runs (``--control``, on by default) of torchrun and ours with 0 lines, so the cost
  of the lines themselves can be told apart from launch time.

After every run of ours the log file is checked: every rank's lines all there, in order
(``seq`` 0..N-1 for each rank). The driver's CPU time during the run is recorded too.

    python benchmarks/logs.py --repeats 5
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import common
import pages
from common import JOBS_SCRIPT, median, ratio

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()

import jobs

NAME = "logs"
TARGET_RATIO = 1.10
LINE = re.compile(r"\[rank (\d+)\|[^\]]*\] rank (\d+) seq (\d+) ")


def verify_log(path: str, ranks: int, count: int) -> dict[str, Any]:
    """Every rank's ``count`` lines present once, in order; return what was found.

    Raises:
        AssertionError: a line is missing, duplicated, out of order or attributed to the
            wrong rank.
    """
    next_seq = dict.fromkeys(range(ranks), 0)
    problems: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            match = LINE.search(line)
            if match is None:
                continue
            prefix_rank, rank, seq = (int(g) for g in match.groups())
            if prefix_rank != rank:
                problems.append(f"line of rank {rank} logged as rank {prefix_rank}")
            elif seq != next_seq.get(rank, -1):
                problems.append(f"rank {rank}: expected seq {next_seq.get(rank)}, got {seq}")
            next_seq[rank] = next_seq.get(rank, 0) + 1
            if len(problems) > 5:
                break
    for rank in range(ranks):
        if next_seq[rank] != count:
            problems.append(f"rank {rank}: {next_seq[rank]} of {count} lines delivered")
    if problems:
        raise AssertionError("; ".join(problems[:6]))
    return {"lines_per_rank": dict(next_seq), "in_order": True}


class FileLogger:
    """A fresh logger writing to a fresh temp file (closed and removed by ``close``)."""

    def __init__(self) -> None:
        handle, self.path = tempfile.mkstemp(prefix="sparktorch-bench-", suffix=".log")
        os.close(handle)
        self.logger = logging.getLogger(f"bench.logs.{os.path.basename(self.path)}")
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        self.handler = logging.FileHandler(self.path, encoding="utf-8")
        self.handler.setFormatter(
            logging.Formatter("[%(asctime)s] {%(filename)s:%(lineno)d} %(levelname)s - %(message)s")
        )
        self.logger.addHandler(self.handler)

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        self.handler.close()
        os.unlink(self.path)


def build_variants(count: int, control: bool, timeout: float) -> dict[str, Callable[[], Any]]:
    """name -> run once; ours return (the log sink, lines expected per rank)."""

    def ours(lines: int, as_function: bool) -> Callable[[], Any]:
        def run() -> Any:
            sink = FileLogger()
            distributor = common.ours(logger=sink.logger, timeout=timeout)
            if as_function:
                distributor.run(jobs.print_lines, lines)
            else:
                distributor.run(str(JOBS_SCRIPT), "lines", f"--count={lines}")
            return sink, lines

        return run

    def bare(lines: int) -> Callable[[], Any]:
        return lambda: common.run_torchrun(
            JOBS_SCRIPT, ["lines", f"--count={lines}"], capture=False, timeout=timeout
        )

    variants: dict[str, Callable[[], Any]] = {
        "torchrun": bare(count),
        "ours_local_script": ours(count, as_function=False),
        "ours_local_fn": ours(count, as_function=True),
    }
    if control:
        variants["torchrun_0_lines"] = bare(0)
        variants["ours_local_script_0_lines"] = ours(0, as_function=False)
    return variants


def check(name: str, value: Any) -> dict[str, Any] | None:
    """Verify ours' log file (then remove it)."""
    if not name.startswith("ours"):
        return None
    sink, lines = value
    try:
        found = verify_log(sink.path, 2, lines)
        size = os.path.getsize(sink.path)
    finally:
        sink.close()
    return {"log_bytes": size, **found}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    variants = build_variants(args.lines, args.control, args.timeout)
    series = common.alternate(
        variants, args.repeats, warmup=args.warmup, check=check, settle_s=args.settle
    )
    results: dict[str, Any] = {}
    for name, s in series.items():
        summary = s.summary()
        reference = "torchrun_0_lines" if name.endswith("_0_lines") else "torchrun"
        summary["ratio_vs_torchrun"] = ratio(summary["median_s"], median(series[reference].seconds))
        if name.startswith("ours"):
            summary["verified_runs"] = len(s.extra)
        results[name] = summary
    cost: dict[str, float | None] = {}
    if args.control:

        def less(a: Any, b: Any) -> float | None:
            return None if a is None or b is None else a - b

        for name in ("torchrun", "ours_local_script"):
            for what, key in (("wall", "median_s"), ("cpu", "tree_cpu_median_s")):
                cost[f"{name}_{what}_s"] = less(results[name][key], results[f"{name}_0_lines"][key])
        for what in ("wall", "cpu"):
            cost[f"ours_extra_{what}_s"] = less(
                cost[f"ours_local_script_{what}_s"], cost[f"torchrun_{what}_s"]
            )
    return {
        "repeats": args.repeats,
        "warmup": args.warmup,
        "lines_per_rank": args.lines,
        "ranks": 2,
        "target_ratio": TARGET_RATIO,
        "variants": results,
        "lines_cost_s": cost,
        "notes": (
            "torchrun's ranks write to /dev/null (block-buffered); ours' ranks run with -u and "
            "every line goes rank -> supervisor -> channel -> logger -> FileHandler (flushed "
            "per record). Every run of ours is verified line by line (count and order per rank)."
        ),
    }


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "Logs"


def render(doc: dict[str, Any]) -> str:
    """This benchmark\'s section of benchmarks/README.md, from its JSON."""
    cols: list[pages.Column] = [
        ("variant", pages.name),
        ("seconds", pages.field_("median_s")),
        ("min-max s", pages.min_max),
        ("vs torchrun", pages.field_("ratio_vs_torchrun", suffix="x")),
        ("driver CPU s", pages.field_("driver_cpu_median_s")),
        ("all CPU s", pages.field_("tree_cpu_median_s")),
        (
            "verified",
            lambda n, s: (
                f"{s.get('verified_runs', '-')}/{s.get('runs')}" if n.startswith("ours") else "-"
            ),
        ),
        ("errors", lambda _n, s: pages.errors(s)),
    ]
    cost = doc.get("lines_cost_s") or {}
    tail = (
        "\n\nWhat the lines add over a 0-line run: torchrun "
        f"{pages.num(cost.get('torchrun_wall_s'))} s wall / {pages.num(cost.get('torchrun_cpu_s'))} s CPU, "
        f"ours {pages.num(cost.get('ours_local_script_wall_s'))} s wall / "
        f"{pages.num(cost.get('ours_local_script_cpu_s'))} s CPU."
        if cost
        else ""
    )
    return (
        f"{doc.get('ranks', 2)} ranks x {doc.get('lines_per_rank')} lines, target <= "
        f"{doc.get('target_ratio')}x of bare torchrun, median of {doc.get('repeats')}; "
        "`*_0_lines` variants print nothing (the same job otherwise).\n\n"
        + pages.columns(cols, doc["variants"])
        + tail
        + pages.notes(doc.get("notes"))
        + "\n\nReading it: the `*_0_lines` variants are the same job printing nothing; the "
        "difference is what the lines themselves cost."
    )


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline row: the slower of ours against bare torchrun."""
    ours_logs = [
        s
        for name, s in doc.get("variants", {}).items()
        if name.startswith("ours") and not name.endswith("_0_lines")
    ]
    if not ours_logs:
        return []
    worst = max(ours_logs, key=lambda s: s.get("ratio_vs_torchrun") or 0.0)
    ratio = worst.get("ratio_vs_torchrun")
    total = doc.get("ranks", 2) * doc.get("lines_per_rank", 0)
    verified = sum(s.get("verified_runs", 0) for s in ours_logs)
    runs = sum(s.get("runs", 0) for s in ours_logs)
    return [
        [
            f"logs, {total:,} lines ({verified}/{runs} runs verified whole)",
            "time / bare torchrun's (to /dev/null)",
            pages.num(ratio, suffix="x"),
            pages.met(ratio, doc.get("target_ratio"), at_most=True),
        ]
    ]


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lines", type=int, default=20_000, help="lines per rank")
    parser.add_argument(
        "--no-control", dest="control", action="store_false", help="skip the 0-line runs"
    )


BENCH = pages.Benchmark(
    name=NAME,
    title=TITLE,
    measure=measure,
    render=render,
    summary=summary_rows,
    options=options,
    defaults={"timeout": 300},
    quick=("--repeats=1", "--warmup=0", "--lines=2000"),
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
