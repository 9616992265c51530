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
import sys
import threading
import time
from pathlib import Path
from typing import Any

import common
import pages
from common import log, print_table

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
    from sparktorch_ops import TorchDistributor

    return TorchDistributor(
        num_processes=2,
        local_mode=mode == "local",
        use_gpu=False,
        spark=session if mode == "barrier" else None,
        logger=common.quiet_logger(),
        **options,
    )


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stall-timeout", type=float, default=15.0)
    parser.add_argument("--workdir", default="/tmp/sparktorch-bench-stalls")
    args = parser.parse_args(argv)
    machine = common.machine_info()
    log("starting a local[2] SparkSession")
    session = common.start_spark("local[2]")
    series: dict[str, common.Series] = {
        name: common.Series(name) for name in ("stall_local", "stall_barrier", "capture", "cancel")
    }
    root = Path(args.workdir)
    for round_number in range(args.repeats):
        for mode in ("local", "barrier"):
            workdir = root / f"{mode}-{round_number}"
            workdir.mkdir(parents=True, exist_ok=True)
            try:
                series[f"stall_{mode}"].seconds.append(
                    stall_once(mode, session, args.stall_timeout, workdir)
                )
            except Exception as exc:  # recorded, not fatal: the table shows it
                series[f"stall_{mode}"].errors.append(f"{type(exc).__name__}: {exc}"[:300])
        workdir = root / f"cancel-{round_number}"
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            capture_s, cancel_s = cancel_once(session, workdir)
            series["capture"].seconds.append(capture_s)
            series["cancel"].seconds.append(cancel_s)
        except Exception as exc:
            series["cancel"].errors.append(f"{type(exc).__name__}: {exc}"[:300])
        log(f"round {round_number + 1} of {args.repeats} done")
    variants = {name: s.summary() for name, s in series.items()}
    print_table(
        f"stall_timeout={args.stall_timeout:g}: the silence to the error; a cancel's capture",
        ["variant", "median s", "min s", "max s", "runs"],
        [[n, v["median_s"], v["min_s"], v["max_s"], v["runs"]] for n, v in variants.items()],
    )
    common.write_results(
        NAME,
        {"repeats": args.repeats, "stall_timeout": args.stall_timeout, "variants": variants},
        machine,
    )
    session.stop()
    return 0 if all(v["runs"] for v in variants.values()) else 1


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "A hung training"

LABELS = {
    "stall_local": "stall to error, local mode",
    "stall_barrier": "stall to error, barrier mode (`local[2]`)",
    "capture": "`stacks()` of 2 ranks (what a cancel captures first)",
    "cancel": "`cancel()` to the raise (capture + teardown)",
}


def _beyond(s: dict[str, Any], limit: float | None) -> str:
    median = s.get("median_s")
    if median is None or limit is None:
        return "-"
    return f"+{median - limit:.2f}"


def render(doc: dict[str, Any]) -> str:
    """This benchmark's section of benchmarks/README.md, from its JSON."""
    variants, limit = doc["variants"], doc.get("stall_timeout")
    rows = [
        [
            LABELS.get(name, name),
            pages.num(s.get("median_s")),
            pages.spread(s),
            _beyond(s, limit) if name.startswith("stall_") else "-",
            str(s.get("runs", "-")),
        ]
        for name, s in variants.items()
    ]
    return (
        f"Two ranks: rank 1 sleeps in its data loading, rank 0 waits for it in an all-reduce. "
        f"With `stall_timeout={pages.num(limit, 0)}`, the time from the ranks' last line of "
        f"output to `TrainingStalledError` (every rank's stacks taken, the ranks torn down); a "
        f"cancel of the same run, and the stack capture it makes first, timed alone. Medians of "
        f"{doc.get('repeats')} rounds.\n\n"
        + pages.table(["what", "median s", "min-max s", "beyond stall_timeout s", "runs"], rows)
        + "".join(pages.errors(s) for s in variants.values())
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


if __name__ == "__main__":
    sys.exit(main())
