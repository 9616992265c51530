"""Launch overhead over Spark Connect: a trivial 2-rank gloo all-reduce in barrier mode, from a
classic session and from a Spark Connect session, ours and pyspark's, alternating.

Variants (one of each per round, the order rotated every round, after a discarded warm-up
round), each a 2-rank ``jobs.allreduce`` (rank 0's all-reduced 3.0 comes back):

- ``ours_classic``: ``sparktorch_ops.TorchDistributor(..., local_mode=False, spark=classic)``
  on a ``local[2]`` session of this process (the baseline of the ratios);
- ``ours_connect``: the same with ``spark=`` a Spark Connect session to a Connect server on
  ``local[2]``, which this benchmark starts (``spark-submit --class SparkConnectServer``);
- ``ours_connect_relayed``: the same with ``channel_host`` an address no executor reaches, so
  every task relays its ranks' frames with its rows instead of live;
- ``pyspark_connect``: pyspark's ``TorchDistributor(num_processes=2, local_mode=False,
  use_gpu=False)`` with the Connect session active;
- ``pyspark_classic``: pyspark's on the classic session.

One process is both: the classic session (this process's SparkContext) and the Connect client
(``pyspark.sql.connect.session.SparkSession.builder.remote(url)``, which, unlike
``pyspark.sql.SparkSession.builder.remote``, does not refuse next to a running SparkContext).
pyspark decides "Connect or classic" from ``SPARK_CONNECT_MODE_ENABLED`` (``is_remote()``;
``SparkSession.active()``, which its TorchDistributor calls, dispatches on it), which
``pyspark.sql.SparkSession.builder.remote`` sets for good in a Connect-only process: the
Connect variants run with it set, as they would there, and the classic ones without it.

The Connect server has its own JVM and Python workers, so the Connect variants pay a gRPC
round trip per Spark call and the server's scheduling, not a second JVM start. Before each run
a tiny job on each session keeps Spark's Python workers warm (Spark stops them after a minute
idle), and before each of ours an untimed run of the same variant starts the warm agents on the
Python workers it will get: pyspark's runs over Connect end the server's Python workers (the
tasks' workers are gone from the process table after each), and a run of ours on fresh ones
starts cold, which the launch benchmark measures. A variant that fails is recorded with its
error (the table shows it in place of the median), and the others go on.

    python benchmarks/connect_launch.py --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import common
import pages
import psutil
from common import log, ratio

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()
sys.path.insert(0, str(common.ROOT))

import jobs

from harness.connect_server import ConnectServer

NAME = "connect_launch"
MASTER = "local[2]"
VARIANTS = (
    "ours_classic",
    "ours_connect",
    "ours_connect_relayed",
    "pyspark_connect",
    "pyspark_classic",
)
#: An address no executor reaches (TEST-NET-1): the tasks relay their ranks' frames instead.
UNREACHABLE_CHANNEL = "192.0.2.1"
BASELINE = "ours_classic"
CONNECT_ENV = "SPARK_CONNECT_MODE_ENABLED"
TARGET_RATIO = 1.2  # ours over Connect / ours classic, the goal
# Rank-side processes of a barrier run, to kill when a pyspark run times out.
RANK_MARKERS = ("torch_run_process_wrapper", "torch.distributed.run", "sparktorch_ops.node.agent")


def start_connect_session(url: str) -> Any:
    """A Connect session to ``url`` beside this process's classic one, warmed with a job."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    session = ConnectSession.builder.remote(url).getOrCreate()
    assert session.range(1).collect()[0][0] == 0
    return session


def _identity(batches: Iterator[Any]) -> Iterator[Any]:
    yield from batches


def touch_connect_workers(session: Any) -> None:
    """A tiny Python job on every slot of the server: its Python workers stay warm."""
    session.range(2, numPartitions=2).mapInArrow(_identity, "id long").collect()


# -- the variants ----------------------------------------------------------------------------
class Launchers:
    """Builds the run-once callables of every variant."""

    def __init__(self, classic: Any, connect: Any, server: ConnectServer, timeout: float) -> None:
        self.classic = classic
        self.connect = connect
        self.server = server
        self.timeout = timeout
        self.logger = common.quiet_logger()
        self.fn = functools.partial(jobs.allreduce, None, False)

    def ours(self, session: Any, channel_host: str | None = None) -> Any:

        distributor = common.ours(
            local_mode=False, spark=session, timeout=self.timeout, channel_host=channel_host
        )
        return distributor.run(self.fn)

    def pyspark(self, connect: bool) -> Any:
        def call() -> Any:
            # Built inside the block: it takes SparkSession.active() of the mode it runs in.
            return common.pyspark_distributor(local_mode=False).run(self.fn)

        def on_timeout() -> None:
            if connect:
                self.connect.interruptAll()
                procs = self.server.descendants()
            else:
                self.classic.sparkContext.cancelAllJobs()
                procs = psutil.Process().children(recursive=True)
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    if any(m in " ".join(proc.cmdline()) for m in RANK_MARKERS):
                        proc.kill()

        return common.run_with_timeout(call, self.timeout, on_timeout)

    def build(self, name: str) -> Callable[[], Any]:
        connect = "_connect" in name
        if name.startswith("ours"):
            session = self.connect if connect else self.classic
            host = UNREACHABLE_CHANNEL if name.endswith("_relayed") else None

            def run() -> Any:
                return self.ours(session, host)

        elif name.startswith("pyspark"):

            def run() -> Any:
                return self.pyspark(connect)

        else:
            raise ValueError(f"unknown variant {name!r}")
        root = self.server.process.pid if connect else os.getpid()

        def census() -> dict[str, Any]:
            # A run that finds Spark's Python workers gone pays for new ones.
            before = common.python_workers(root)
            if connect:
                with common.env_var(CONNECT_ENV, "1"):
                    value = run()
            else:
                value = run()
            return {"value": value, "new_python_workers": len(common.python_workers(root) - before)}

        return census


def check_value(name: str, value: Any) -> dict[str, Any]:
    """Every variant must return the all-reduced 3.0 (1 + 2)."""
    if value["value"] != 3.0:
        raise AssertionError(f"{name} returned {value['value']!r}, expected 3.0")
    return {"new_python_workers": value["new_python_workers"]}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants: {', '.join(sorted(unknown))}")
    workdir = Path(tempfile.mkdtemp(prefix="sparktorch-bench-connect-"))
    log(f"starting a Spark Connect server on {MASTER} (log: {workdir / 'connect-server.log'})")
    server = ConnectServer(workdir, MASTER)
    classic = connect = None
    started = time.perf_counter()
    try:
        server.wait_listening(args.server_timeout)
        connect = start_connect_session(server.url)
        log(f"Connect server {server.url} up after {time.perf_counter() - started:.1f} s")
        log(f"starting a {MASTER} SparkSession")
        classic = common.start_spark(MASTER)
        common.ship_by_value_for_pyspark(jobs)
        launchers = Launchers(classic, connect, server, args.timeout)
        runs = {name: launchers.build(name) for name in variants}

        def prepare(name: str) -> None:
            common.touch_python_workers(classic)
            touch_connect_workers(connect)
            if name.startswith("ours"):
                # pyspark's runs over Connect end the server's Python workers their tasks ran
                # in; an untimed run of the same variant starts the warm agents the timed one
                # finds (cold starts are the launch benchmark's).
                runs[name]()

        series = common.alternate(
            runs,
            args.repeats,
            warmup=args.warmup,
            check=check_value,
            settle_s=args.settle,
            before_each=prepare,
        )
    finally:
        if connect is not None:
            with contextlib.suppress(Exception):
                connect.stop()
        if classic is not None:
            classic.stop()
        server.stop()
    summaries = {name: series[name].summary() for name in variants}
    for name, s in summaries.items():
        s["ratio_vs_ours_classic"] = ratio(
            s["median_s"], summaries.get(BASELINE, {}).get("median_s")
        )
        s["new_python_workers"] = [e.get("new_python_workers") for e in series[name].extra]

    def med(name: str) -> float | None:
        return summaries.get(name, {}).get("median_s")

    return {
        "repeats": args.repeats,
        "warmup": args.warmup,
        "master": MASTER,
        "baseline": BASELINE,
        "variants": summaries,
        "ratios": {
            "ours: connect / classic": ratio(med("ours_connect"), med("ours_classic")),
            "ours: relayed / live (connect)": ratio(
                med("ours_connect_relayed"), med("ours_connect")
            ),
            "pyspark: connect / classic": ratio(med("pyspark_connect"), med("pyspark_classic")),
            "classic: pyspark / ours": ratio(med("pyspark_classic"), med("ours_classic")),
            "connect: pyspark / ours": ratio(med("pyspark_connect"), med("ours_connect")),
        },
        "notes": (
            "One process holds the classic local[2] session and the Connect client (to a "
            "Connect server on local[2] started by the benchmark); the Connect variants "
            f"run with {CONNECT_ENV}=1, the classic ones without. Python workers of both "
            "are kept warm by a tiny job before every run. A run of pyspark's distributor "
            "on the Connect server ends the server's Python workers its tasks ran in, so "
            "our next run there would start its warm agents anew (2-3 s; the launch "
            "benchmark measures cold starts): before each of our runs an untimed run of "
            "the same variant warms them, classic and Connect alike."
        ),
    }


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "Launch over Spark Connect"


def render(doc: dict[str, Any]) -> str:
    """This benchmark\'s section of benchmarks/README.md, from its JSON."""
    cols: list[pages.Column] = [
        ("variant", pages.name),
        ("seconds", pages.seconds),
        ("min-max s", pages.min_max),
        ("vs ours classic", pages.field_("ratio_vs_ours_classic", suffix="x")),
        ("fresh workers", lambda _n, s: str(sum(1 for n in s.get("new_python_workers", []) if n))),
        ("runs", pages.runs),
    ]
    ratio_rows = [
        [name, pages.num(value, suffix="x")] for name, value in doc.get("ratios", {}).items()
    ]
    out = [
        f"Trivial 2-rank all-reduce in barrier mode on `{doc.get('master', 'local[2]')}`, from the "
        f"call to its return, from a classic session and from a Spark Connect session (to a "
        f"Connect server on `{doc.get('master', 'local[2]')}`); median of {doc.get('repeats')} "
        f"(after {doc.get('warmup', 0)} warm-up round).",
        pages.columns(cols, doc["variants"]),
        pages.table(["ratio of medians", "x"], ratio_rows),
    ]
    before = doc.get("before")
    if before:
        out.append(_render_before(doc, before))
    return "\n\n".join(out) + pages.notes(doc.get("notes"))


def _render_before(doc: dict[str, Any], before: dict[str, Any]) -> str:
    """Our variants before and after a change, when the JSON holds the earlier code's run
    of this benchmark (``before``: its code, a note, its ``variants`` and, when the two runs
    had other variants than this one, the later code's run of the same, ``after_variants``)."""
    rows = []
    for name, after in (before.get("after_variants") or doc["variants"]).items():
        then = before["variants"].get(name)
        if then is None:
            continue
        rows.append(
            [
                f"`{name}`",
                *(
                    f"{pages.num(v.get('median_s'))} ({pages.spread(v)}), "
                    f"{pages.num(v.get('ratio_vs_ours_classic'), suffix='x')}"
                    for v in (then, after)
                ),
            ]
        )
    return (
        f"Before ({before.get('code')}) and after ({doc['machine'].get('git_commit')}), run one "
        f"process after the other on this machine ({before.get('note', '')}): seconds, median "
        "(min-max), and the ratio to our classic launch of the same run.\n\n"
        + pages.table(["variant", "before", "after"], rows)
    )


def _round_spread(doc: dict[str, Any]) -> str:
    """' (min-max by round)' of ours over Connect / ours classic (one of each per round)."""
    connect = doc["variants"].get("ours_connect", {}).get("seconds") or []
    classic = doc["variants"].get("ours_classic", {}).get("seconds") or []
    if not connect or len(connect) != len(classic):
        return ""
    per_round = [a / b for a, b in zip(connect, classic, strict=True)]
    return f" ({pages.num(min(per_round))}-{pages.num(max(per_round))} by round)"


def _was(before: dict[str, Any] | None) -> str:
    """'; was Mx at <code>' from the earlier code's run of our variants, when the JSON has it."""
    if not before:
        return ""
    then = before["variants"].get("ours_connect", {}).get("ratio_vs_ours_classic")
    return f"; was {pages.num(then, suffix='x')} at {before.get('code')}"


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline row: ours over Connect / ours classic, and pyspark's time / ours."""
    ratio = doc.get("ratios", {}).get("ours: connect / classic")
    if ratio is None:
        return []
    pyspark = doc["ratios"].get("connect: pyspark / ours")
    return [
        [
            "launch over Spark Connect (trivial all-reduce, barrier)",
            "ours over Connect / over a classic session (pyspark's time / ours, over Connect)",
            f"{pages.num(ratio, suffix='x')}{_round_spread(doc)}{_was(doc.get('before'))} "
            f"({pages.num(pyspark, suffix='x')})",
            pages.met(ratio, TARGET_RATIO, at_most=True),
        ]
    ]


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    parser.add_argument("--server-timeout", type=float, default=120, help="server start, seconds")


BENCH = pages.Benchmark(
    name=NAME,
    title=TITLE,
    measure=measure,
    render=render,
    summary=summary_rows,
    options=options,
    defaults={"timeout": 300},
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
