"""DataFrame input: rows/s delivered to the ranks and peak RSS per rank, ours vs pyspark's.

A cached DataFrame of N rows x 32 float32 columns (``spark.range`` with 2 partitions, one per
rank, as pyspark's ``_train_on_dataframe`` requires) is trained on by 2 ranks in barrier mode
on one ``local[2]`` session. Every rank runs the same function: it builds a loader, iterates
one epoch, and times it from the loader's creation (the first batch request) to the last
batch; it reports the rows it got, those seconds, its process's peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``, and of its reaped children: pyspark's DataLoader
worker), and the RSS growth over the iteration (sampled every 10 ms with psutil). The ranks'
figures are gathered with ``all_gather_object`` over gloo and rank 0 returns them.

Variants, alternated per round (sizes are separate rounds of the same run):

- ``ours_partition_loader``: our ``TorchDistributor.train_on_dataframe`` with
  ``sparktorch_ops.data.partition_loader(batch_size=1024)`` (one whole epoch);
- ``ours_pyspark_api``: the same, with our ``get_spark_partition_data_loader(rows_per_rank,
  1024)`` (pyspark's API and batches; default ``num_workers=1``);
- ``pyspark_default`` / ``pyspark_nw0``: pyspark's ``TorchDistributor._train_on_dataframe``
  with its ``_get_spark_partition_data_loader(num_samples, 1024)`` (default ``num_workers=1``,
  and 0). pyspark's loader converts row by row, so its ``num_samples`` is capped with
  ``--pyspark-samples`` (rows/s are computed from the rows it delivered; the table says so).

Rows/s is per rank and counts data-loading time only (inside the rank); "wall" is the whole
call on the driver (Spark job, shards written, ranks started, epoch, result back).

    python benchmarks/dataframe_input.py --sizes 2000000,4000000 --repeats 1
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import common
import pages
from common import log, median, print_table, ratio

common.prepare_environment()

NAME = "dataframe_input"
FEATURES = 32
BATCH = 1024
TARGET_SPEEDUP = 3.0


def rank_epoch(kind: str, num_samples: int, batch_size: int, num_workers: int) -> Any:
    """Run on every rank: one epoch of the loader ``kind``; all ranks' figures (on rank 0)."""
    import os
    import resource
    import threading
    import time

    import psutil
    import torch
    import torch.distributed as dist

    proc = psutil.Process()
    rss_start = proc.memory_info().rss
    peak = [rss_start]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rows = 0
    batches = 0
    started = time.perf_counter()
    if kind == "ours_partition_loader":
        from sparktorch_ops.data import partition_loader

        loader = partition_loader(batch_size=batch_size)
        for batch in loader:
            rows += next(iter(batch.values())).shape[0]
            batches += 1
    elif kind == "ours_pyspark_api":
        from sparktorch_ops.data import get_spark_partition_data_loader

        loader = get_spark_partition_data_loader(num_samples, batch_size, num_workers=num_workers)
        for batch in loader:
            rows += batch[0].shape[0]
            batches += 1
    else:
        from pyspark.ml.torch.distributor import _get_spark_partition_data_loader

        loader = _get_spark_partition_data_loader(num_samples, batch_size, num_workers=num_workers)
        for batch in loader:
            rows += batch[0].shape[0]
            batches += 1
    seconds = time.perf_counter() - started
    del loader
    stop.set()
    sampler.join()
    peak[0] = max(peak[0], proc.memory_info().rss)
    mine = {
        "rank": int(os.environ.get("RANK", "0")),
        "rows": rows,
        "batches": batches,
        "seconds": seconds,
        "rows_per_s": rows / seconds if seconds > 0 else None,
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "ru_maxrss_children_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "rss_start_mib": rss_start / 2**20,
        "rss_growth_mib": (peak[0] - rss_start) / 2**20,
        "torch": torch.__version__,
    }
    dist.init_process_group("gloo")
    try:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    finally:
        dist.destroy_process_group()
    return gathered


def make_dataframe(session: Any, rows: int) -> Any:
    """``rows`` x 32 float32 columns in 2 partitions, cached and materialized."""
    from pyspark.sql import functions as F

    df = session.range(0, rows, 1, numPartitions=2).select(
        *[(F.rand(seed=i) * 2 - 1).cast("float").alias(f"f{i}") for i in range(FEATURES)]
    )
    df = df.cache()
    df.count()
    return df


def build_variants(
    session: Any,
    df: Any,
    rows: int,
    pyspark_samples: int,
    pyspark_variants: list[str],
    timeout: float,
) -> dict[str, Any]:
    from sparktorch_ops import TorchDistributor

    per_rank = rows // 2

    def ours(kind: str) -> Any:
        dist = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=session)
        return dist.train_on_dataframe(rank_epoch, df, kind, per_rank, BATCH, 1)

    def pyspark(num_workers: int) -> Any:
        dist = common.pyspark_distributor(local_mode=False)
        samples = min(per_rank, pyspark_samples)

        def cancel() -> None:
            session.sparkContext.cancelAllJobs()
            common.kill_descendants("torch.distributed.run")

        return common.run_with_timeout(
            lambda: dist._train_on_dataframe(
                rank_epoch, df, "pyspark", samples, BATCH, num_workers
            ),
            timeout,
            cancel,
        )

    variants: dict[str, Any] = {
        "ours_partition_loader": functools.partial(ours, "ours_partition_loader"),
        "ours_pyspark_api": functools.partial(ours, "ours_pyspark_api"),
    }
    if "default" in pyspark_variants:
        variants["pyspark_default"] = functools.partial(pyspark, 1)
    if "nw0" in pyspark_variants:
        variants["pyspark_nw0"] = functools.partial(pyspark, 0)
    return variants


def check(name: str, value: Any) -> dict[str, Any]:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, dict) for v in value)
    ):
        raise AssertionError(f"{name} returned {value!r:.200}, not two ranks' figures")
    return {"ranks": value}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="2000000,4000000", help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument(
        "--pyspark-samples",
        type=int,
        default=100_000,
        help="cap on pyspark's num_samples per rank (its loader converts row by row)",
    )
    parser.add_argument("--pyspark-variants", default="default,nw0")
    parser.add_argument("--timeout", type=float, default=600, help="per pyspark run, seconds")
    parser.add_argument(
        "--warm-size", type=int, default=20_000, help="rows of a discarded warm-up round (0: none)"
    )
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument("--name", default=NAME)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    pyspark_variants = [v.strip() for v in args.pyspark_variants.split(",") if v.strip()]

    machine = common.machine_info()
    log("starting a local[2] SparkSession")
    session = common.start_spark("local[2]")

    if args.warm_size:
        log(f"warm-up on {args.warm_size:,} rows (discarded): Spark's Python workers, imports")
        small = make_dataframe(session, args.warm_size)
        common.alternate(
            build_variants(session, small, args.warm_size, 1000, ["default"], args.timeout),
            1,
            warmup=0,
            check=check,
            settle_s=args.settle,
        )
        small.unpersist()

    results: dict[str, Any] = {}
    rows_out = []
    for size in sizes:
        log(f"building and caching {size:,} x {FEATURES} float32")
        df = make_dataframe(session, size)
        variants = build_variants(
            session, df, size, args.pyspark_samples, pyspark_variants, args.timeout
        )
        series = common.alternate(
            variants,
            args.repeats,
            warmup=args.warmup,
            check=check,
            settle_s=args.settle,
            before_each=lambda: common.touch_python_workers(session),
        )
        df.unpersist()
        per_size: dict[str, Any] = {}
        for name, s in series.items():
            summary = s.summary()
            ranks = [r for e in s.extra for r in e["ranks"]]
            summary.update(
                {
                    "rows_per_rank": median([r["rows"] for r in ranks]),
                    "load_s_per_rank_median": median([r["seconds"] for r in ranks]),
                    "rows_per_s_per_rank_median": median([r["rows_per_s"] for r in ranks]),
                    "ru_maxrss_mib_max": max((r["ru_maxrss_mib"] for r in ranks), default=None),
                    "ru_maxrss_children_mib_max": max(
                        (r["ru_maxrss_children_mib"] for r in ranks), default=None
                    ),
                    "rss_growth_mib_max": max((r["rss_growth_mib"] for r in ranks), default=None),
                    "capped": name.startswith("pyspark") and size // 2 > args.pyspark_samples,
                    "rank_figures": [e["ranks"] for e in s.extra],
                }
            )
            per_size[name] = summary
        base = per_size.get("pyspark_default", {}).get("rows_per_s_per_rank_median")
        for name, summary in per_size.items():
            summary["rows_per_s_vs_pyspark_default"] = ratio(
                summary["rows_per_s_per_rank_median"], base
            )
            rows_out.append(
                [
                    f"{size:,}",
                    name,
                    f"{summary['rows_per_rank']:,.0f}" if summary["rows_per_rank"] else "-",
                    summary["rows_per_s_per_rank_median"],
                    summary["rows_per_s_vs_pyspark_default"],
                    summary["load_s_per_rank_median"],
                    summary["median_s"],
                    summary["ru_maxrss_mib_max"],
                    summary["ru_maxrss_children_mib_max"],
                    summary["rss_growth_mib_max"],
                    ("capped; " if summary["capped"] else "")
                    + f"{summary['runs']} ok"
                    + (f", {len(summary['errors'])} failed" if summary["errors"] else ""),
                ]
            )
        results[str(size)] = per_size
        for name, s in series.items():
            for error in s.errors[:1]:
                print(f"{size} {name} failed: {error[:600]}")

    print_table(
        f"DataFrame input: 2 ranks, barrier mode, local[2], {FEATURES} float32 columns, "
        f"batch {BATCH}; medians of {args.repeats} run(s); pyspark's num_samples capped at "
        f"{args.pyspark_samples:,} per rank where marked",
        [
            "rows",
            "variant",
            "rows/rank",
            "rows/s/rank",
            "vs pyspark",
            "load s",
            "wall s",
            "maxrss MiB",
            "child maxrss",
            "RSS growth MiB",
            "runs",
        ],
        rows_out,
    )
    common.write_results(
        args.name,
        {
            "sizes": sizes,
            "features": FEATURES,
            "batch_size": BATCH,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "pyspark_samples_cap": args.pyspark_samples,
            "target_speedup": TARGET_SPEEDUP,
            "results": results,
            "notes": (
                "rows/s per rank over the rank's own loading time (loader creation to last "
                "batch); wall is the whole train_on_dataframe call on the driver. maxrss is "
                "getrusage(RUSAGE_SELF) of the rank process (includes torch import); child "
                "maxrss is RUSAGE_CHILDREN (DataLoader workers reaped by the rank); RSS growth "
                "is the rank's peak RSS during the epoch minus its RSS before it (psutil, 10 ms)."
                " pyspark's loader delivers only num_samples rows (capped) per rank."
            ),
        },
        machine,
    )
    session.stop()
    return 0


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "DataFrame input"


def render(doc: dict[str, Any]) -> str:
    """This benchmark\'s section of benchmarks/README.md, from its JSON."""
    rows = []
    for size, variants in doc["results"].items():
        for name, s in variants.items():
            rows.append(
                [
                    f"{int(size):,}",
                    f"`{name}`",
                    (f"{int(s['rows_per_rank']):,}" if s.get("rows_per_rank") else "-")
                    + (" (capped)" if s.get("capped") else ""),
                    pages.num(s.get("rows_per_s_per_rank_median"), 0),
                    pages.num(s.get("rows_per_s_vs_pyspark_default"), 1, "x"),
                    pages.num(s.get("median_s")),
                    pages.num(s.get("ru_maxrss_mib_max"), 0),
                    pages.num(s.get("rss_growth_mib_max"), 0),
                    f"{s.get('runs')}{pages.errors(s)}",
                ]
            )
    return (
        f"A cached DataFrame of N rows x {doc.get('features')} float32 columns in 2 partitions, "
        f"2 ranks in barrier mode on `local[2]`, batch {doc.get('batch_size')}, one epoch per "
        f"rank, median of {doc.get('repeats')}; pyspark's `num_samples` capped at "
        f"{doc.get('pyspark_samples_cap'):,} rows per rank (its loader converts row by row). "
        f"Target: ours >= {doc.get('target_speedup'):g}x pyspark's rows/s.\n\n"
        + pages.table(
            [
                "rows",
                "variant",
                "rows per rank",
                "rows/s per rank",
                "vs pyspark",
                "wall s",
                "rank maxrss MiB",
                "RSS growth MiB",
                "runs",
            ],
            rows,
        )
        + pages.notes(doc.get("notes"))
    )


if __name__ == "__main__":
    sys.exit(main())
