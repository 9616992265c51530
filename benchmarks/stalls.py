"""A hung training: how long after the stall the error comes, and what the stacks cost a cancel.

Two ranks: rank 1 sleeps in its "data loading", rank 0 waits for it in an all-reduce, both after
printing one line stamped with the time. With ``stall_timeout=S`` (``--stall-timeout``, 15 by
default) the run fails with ``TrainingStalledError``; the figure is the time from the last line
of any rank (when the silence began) to the error, and what it adds to S (the stack capture and
the teardown). Local mode, and barrier mode on a warm ``local[2]`` session.

Cancel: the same two ranks sleeping; ``stacks()`` is timed alone (the capture a cancel makes
first), then ``cancel()`` until ``run`` raises (capture and teardown together).

    python benchmarks/stalls.py --repeats 3
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import common
import pages
from common import log

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()

NAME = "stalls"
STAMP = "silent from "


def hang(ready_dir: str) -> None:
    """Rank 1 never comes back from its data loading; rank 0 waits for it in an all-reduce."""
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print(f"{STAMP}{time.time():.6f}", flush=True)
    Path(ready_dir, f"rank{os.environ['RANK']}").write_text("ready")
    if os.environ["RANK"] == "1":
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))


def _silent_since(error: Any) -> float:
    stamps = [
        float(line.split(STAMP, 1)[1])
        for failure in error.failures
        for line in failure.output_tail.splitlines()
        if STAMP in line
    ]
    return max(stamps)


def _distributor(mode: str, session: Any, **options: Any) -> Any:
    spark = session if mode == "barrier" else None
    return common.ours(local_mode=mode == "local", spark=spark, **options)


def stall_once(mode: str, session: Any, stall_timeout: float, workdir: Path) -> float:
    """Seconds from the ranks' last line to the TrainingStalledError."""
    from sparktorch_ops import TrainingStalledError

    try:
        _distributor(mode, session, stall_timeout=stall_timeout).run(hang, str(workdir))
    except TrainingStalledError as error:
        return time.time() - _silent_since(error)
    raise AssertionError("the hung run did not fail as stalled")


def cancel_once(session: Any, workdir: Path) -> tuple[float, float]:
    """(seconds ``stacks()`` took, seconds from ``cancel()`` to the raise) in local mode."""
    from sparktorch_ops import TrainingCancelledError

    distributor = _distributor("local", session)
    outcome: list[BaseException] = []

    def go() -> None:
        try:
            distributor.run(hang, str(workdir))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=go)
    thread.start()
    while not all((workdir / f"rank{r}").exists() for r in (0, 1)):
        time.sleep(0.05)
    time.sleep(0.5)  # both in their waits
    started = time.monotonic()
    stacks = distributor.stacks()
    capture_s = time.monotonic() - started
    started = time.monotonic()
    distributor.cancel()
    thread.join()
    cancel_s = time.monotonic() - started
    if not (outcome and isinstance(outcome[0], TrainingCancelledError) and len(stacks) == 2):
        raise AssertionError(f"cancel: {outcome!r}, stacks of {sorted(stacks)}")
    return capture_s, cancel_s


def measure(args: argparse.Namespace) -> dict[str, Any]:
    log("starting a local[2] SparkSession")
    session = common.start_spark("local[2]")
    root = Path(tempfile.mkdtemp(prefix="sparktorch-bench-stalls-"))

    def fresh() -> Path:
        return Path(tempfile.mkdtemp(dir=root))

    series = common.alternate(
        {
            "stall_local": lambda: stall_once("local", session, args.stall_timeout, fresh()),
            "stall_barrier": lambda: stall_once("barrier", session, args.stall_timeout, fresh()),
            "cancel": lambda: cancel_once(session, fresh()),
        },
        args.repeats,
        warmup=args.warmup,
        check=lambda name, value: (
            {"seconds": value}
            if name != "cancel"
            else dict(zip(("capture_s", "seconds"), value, strict=True))
        ),
        settle_s=args.settle,
    )
    session.stop()
    shutil.rmtree(root, ignore_errors=True)
    series["capture"] = common.Series("capture", [e["capture_s"] for e in series["cancel"].extra])
    variants = {name: series[name].summary() for name in LABELS}
    return {"repeats": args.repeats, "stall_timeout": args.stall_timeout, "variants": variants}


LABELS = {
    "stall_local": "stall to error, local mode",
    "stall_barrier": "stall to error, barrier mode (`local[2]`)",
    "capture": "`stacks()` of 2 ranks (what a cancel captures first)",
    "cancel": "`cancel()` to the raise (capture + teardown)",
}


def render(doc: dict[str, Any]) -> str:
    """This benchmark's section of benchmarks/README.md, from its JSON."""
    limit = doc.get("stall_timeout")

    def beyond(name: str, s: dict[str, Any]) -> str:
        median = s.get("median_s")
        if not name.startswith("stall_") or median is None or limit is None:
            return "-"
        return f"+{median - limit:.2f}"

    cols: list[pages.Column] = [
        ("what", lambda n, _s: LABELS.get(n, n)),
        ("median s", pages.field_("median_s")),
        ("min-max s", pages.min_max),
        ("beyond stall_timeout s", beyond),
        ("runs", lambda _n, s: str(s.get("runs", "-"))),
    ]
    return (
        f"Two ranks: rank 1 sleeps in its data loading, rank 0 waits for it in an all-reduce. "
        f"With `stall_timeout={pages.num(limit, 0)}`, the time from the ranks' last line of "
        f"output to `TrainingStalledError` (every rank's stacks taken, the ranks torn down); a "
        f"cancel of the same run, and the stack capture it makes first, timed alone. Medians of "
        f"{doc.get('repeats')} rounds.\n\n"
        + pages.columns(cols, doc["variants"])
        + "".join(pages.errors(s) for s in doc["variants"].values())
    )


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline row: a stall's error after stall_timeout, a cancel's capture."""
    variants, limit = doc["variants"], doc.get("stall_timeout")
    local, barrier = variants["stall_local"], variants["stall_barrier"]
    return [
        [
            f"hung run, `stall_timeout={pages.num(limit, 0)}` (local / barrier); stacks",
            "s from the silence to the error; s a cancel's stack capture takes",
            f"{pages.num(local.get('median_s'), 1)} / {pages.num(barrier.get('median_s'), 1)}; "
            f"{pages.num(variants['capture'].get('median_s'))}",
            "-",
        ]
    ]


BENCH = pages.Benchmark(
    name=NAME,
    title="A hung training",
    measure=measure,
    render=render,
    summary=summary_rows,
    options=lambda parser: parser.add_argument("--stall-timeout", type=float, default=15.0),
    defaults={"repeats": 3, "warmup": 0},
    quick=("--repeats=1", "--warmup=0", "--stall-timeout=5"),
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
