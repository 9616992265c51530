"""Result transfer: rank 0 returns a 256 MiB tensor; ours vs pyspark's TorchDistributor.

Variants (alternating, after a discarded warm-up round): ours and pyspark's, local mode and
barrier mode on a warm ``local[2]`` session. Each runs ``jobs.big_tensor`` (every rank builds
``torch.ones(64 * 1024 * 1024)`` and returns it: pyspark's local mode returns whichever rank
wrote last, so all ranks return the same value). Control runs (``--control``, on by default)
build the same tensor and return only its size, so that the cost of bringing the value back
can be told apart from launch time. The driver's peak RSS is sampled during every run.

pyspark's runs go through a timeout (``--timeout``): when one fails or hangs, the error is
recorded and the others go on.

    python benchmarks/result.py --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

import common
import pages
from common import RssSampler, log, median, print_table, ratio

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()

import jobs

NAME = "result"
MIB = 256
TARGET_SPEEDUP = 3.0


def build_variants(
    session: Any, modes: list[str], control: bool, timeout: float
) -> dict[str, Callable[[], Any]]:
    """name -> run once (returns (value, peak driver RSS MiB, RSS before MiB))."""
    from sparktorch_ops import TorchDistributor

    logger = common.quiet_logger()

    def sampled(run: Callable[[], Any]) -> Callable[[], Any]:
        def wrapper() -> Any:
            before = common.rss_mib()
            with RssSampler(interval=0.02) as sampler:
                value = run()
            return value, sampler.peak_mib, before

        return wrapper

    def ours(local_mode: bool, fn: Callable[[], Any]) -> Callable[[], Any]:
        distributor = functools.partial(
            TorchDistributor,
            num_processes=2,
            local_mode=local_mode,
            use_gpu=False,
            spark=None if local_mode else session,
            logger=logger,
            timeout=timeout,
        )
        return sampled(lambda: distributor().run(fn))

    def pyspark(local_mode: bool, fn: Callable[[], Any]) -> Callable[[], Any]:
        def on_timeout() -> None:
            session.sparkContext.cancelAllJobs()
            common.kill_descendants("torch_run_process_wrapper")
            common.kill_descendants("torch.distributed.run")

        def run() -> Any:
            distributor = common.pyspark_distributor(local_mode)
            return common.run_with_timeout(lambda: distributor.run(fn), timeout, on_timeout)

        return sampled(run)

    tensor = functools.partial(jobs.big_tensor, MIB, True)
    size_only = functools.partial(jobs.big_tensor, MIB, False)
    variants: dict[str, Callable[[], Any]] = {}
    for mode in modes:
        local_mode = mode == "local"
        variants[f"ours_{mode}"] = ours(local_mode, tensor)
        variants[f"pyspark_{mode}"] = pyspark(local_mode, tensor)
        if control:
            variants[f"ours_{mode}_control"] = ours(local_mode, size_only)
            variants[f"pyspark_{mode}_control"] = pyspark(local_mode, size_only)
    return variants


def check(name: str, outcome: Any) -> dict[str, Any]:
    """The tensor must come back whole (or, for a control run, its size); keep the RSS peak."""
    import torch

    value, peak, before = outcome
    expected = MIB * 1024 * 1024 // 4
    if name.endswith("_control"):
        if value != expected:
            raise AssertionError(f"{name} returned {value!r}, expected {expected}")
    else:
        if not isinstance(value, torch.Tensor) or value.numel() != expected:
            raise AssertionError(f"{name} returned {type(value).__name__}, not the tensor")
        if not bool((value == 1).all()):
            raise AssertionError(f"{name} returned a tensor that is not all ones")
    return {"peak_rss_mib": peak, "rss_before_mib": before, "peak_added_mib": peak - before}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--modes", default="local,barrier", help="comma-separated: local, barrier")
    parser.add_argument("--no-control", dest="control", action="store_false")
    parser.add_argument("--timeout", type=float, default=600, help="per run, seconds")
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument(
        "--no-warm-python-workers",
        dest="warm_python_workers",
        action="store_false",
        help="let Spark reap its idle Python workers between runs (barrier runs then start cold)",
    )
    parser.add_argument("--name", default=NAME)
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    machine = common.machine_info()
    log("importing torch in the driver (both distributors unpickle the tensor here)")
    import torch  # noqa: F401

    log("starting a local[2] SparkSession (pyspark's TorchDistributor needs one in both modes)")
    session = common.start_spark("local[2]")
    common.ship_by_value_for_pyspark(jobs)
    variants = build_variants(session, modes, args.control, args.timeout)
    series = common.alternate(
        variants,
        args.repeats,
        warmup=args.warmup,
        check=check,
        settle_s=args.settle,
        before_each=(lambda _name: common.touch_python_workers(session))
        if args.warm_python_workers
        else None,
    )

    results: dict[str, Any] = {}
    rows = []
    for name, s in series.items():
        summary = s.summary()
        summary["peak_added_rss_mib_median"] = median([e["peak_added_mib"] for e in s.extra])
        results[name] = summary
    for mode in modes:
        ours, theirs = results[f"ours_{mode}"], results[f"pyspark_{mode}"]
        speedup = ratio(theirs["median_s"], ours["median_s"])
        transfer: dict[str, float | None] = {}
        if args.control:
            for who in ("ours", "pyspark"):
                full = results[f"{who}_{mode}"]["median_s"]
                zero = results[f"{who}_{mode}_control"]["median_s"]
                transfer[who] = None if full is None or zero is None else full - zero
        transfer_speedup = ratio(transfer.get("pyspark"), transfer.get("ours"))
        results[f"summary_{mode}"] = {
            "speedup_total": speedup,
            "transfer_s": transfer,
            "speedup_transfer": transfer_speedup,
            "target_speedup": TARGET_SPEEDUP,
        }
        for who, summary in (("ours", ours), ("pyspark", theirs)):
            rows.append(
                [
                    f"{who}_{mode}",
                    summary["median_s"],
                    results.get(f"{who}_{mode}_control", {}).get("median_s"),
                    transfer.get(who),
                    summary["peak_added_rss_mib_median"],
                    f"{summary['runs']} ok"
                    + (f", {len(summary['errors'])} failed" if summary["errors"] else ""),
                ]
            )
        rows.append(
            [
                f"  pyspark/ours ({mode})",
                speedup,
                None,
                transfer_speedup,
                None,
                f"target >= {TARGET_SPEEDUP:g}x",
            ]
        )
    print_table(
        f"Result: rank 0 returns a {MIB} MiB tensor, medians of {args.repeats} (s)",
        ["variant", "with tensor", "control", "transfer", "peak +RSS MiB", "runs"],
        rows,
    )
    for name, s in series.items():
        for error in s.errors[:1]:
            print(f"{name} failed: {error[:400]}")
    common.write_results(
        args.name,
        {
            "repeats": args.repeats,
            "warmup": args.warmup,
            "tensor_mib": MIB,
            "warm_python_workers": args.warm_python_workers,
            "target_speedup": TARGET_SPEEDUP,
            "variants": results,
            "notes": (
                "'transfer' = median with the tensor - median of the control run (same tensor "
                "built, only its size returned). peak +RSS = the driver's peak RSS during the run "
                "minus its RSS before, sampled every 20 ms. Every returned tensor is checked."
            ),
        },
        machine,
    )
    session.stop()
    return 0


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "Result"


def render(doc: dict[str, Any]) -> str:
    """This benchmark\'s section of benchmarks/README.md, from its JSON."""
    rows = []
    speedups = []
    for name, s in doc["variants"].items():
        if name.startswith("summary_"):
            transfer = s.get("transfer_s") or {}
            speedups.append(
                [
                    name.removeprefix("summary_"),
                    pages.num(s.get("speedup_total"), suffix="x"),
                    pages.num(transfer.get("ours")),
                    pages.num(transfer.get("pyspark")),
                    pages.num(s.get("speedup_transfer"), suffix="x"),
                    f">= {s.get('target_speedup')}x",
                ]
            )
            continue
        rows.append(
            [
                f"`{name}`",
                pages.num(s.get("median_s")),
                pages.spread(s),
                pages.num(s.get("peak_added_rss_mib_median"), 0),
                f"{s.get('runs')}{pages.errors(s)}",
            ]
        )
    return (
        f"Rank 0 returns a {doc.get('tensor_mib')} MiB tensor; `_control` builds it and returns "
        f"its size only; median of {doc.get('repeats')}.\n\n"
        + pages.table(
            ["variant", "seconds", "min-max s", "driver peak RSS added, MiB", "runs"], rows
        )
        + "\n\n"
        + pages.table(
            [
                "mode",
                "pyspark / ours (total)",
                "transfer s, ours",
                "transfer s, pyspark",
                "pyspark / ours (transfer)",
                "target",
            ],
            speedups,
        )
        + pages.notes(doc.get("notes"))
    )


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline rows: pyspark's time over ours, per mode."""
    rows = []
    for mode in ("local", "barrier"):
        s = doc["variants"].get(f"summary_{mode}")
        if not s:
            continue
        rows.append(
            [
                f"{doc.get('tensor_mib')} MiB result, {mode} mode",
                "pyspark's time / ours (end to end)",
                pages.num(s.get("speedup_total"), suffix="x"),
                pages.met(s.get("speedup_total"), s.get("target_speedup"), at_most=False),
            ]
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
