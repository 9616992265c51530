"""DataFrame input: train_on_dataframe next to one Spark pass over the same rows (the floor)
and pyspark's ``_train_on_dataframe``; rows/s and peak RSS per rank; where our time goes.

A cached DataFrame of N rows x 32 float32 columns (``spark.range`` with 2 partitions, one per
rank, as pyspark's ``_train_on_dataframe`` requires) is trained on by 2 ranks in barrier mode
on one ``local[2]`` session. Variants, alternated per round (sizes are separate rounds of the
same run, one session):

- ``floor``: one Spark pass over the DataFrame as Arrow: ``mapInArrow`` (not barrier) whose
  function only counts the rows of its record batches; Spark must read every row once, so no
  DataFrame input can be faster;
- ``ours_read``: our ``TorchDistributor.train_on_dataframe`` whose ranks read one whole epoch
  with ``sparktorch_ops.data.partition_loader(batch_size=1024)``;
- ``ours_noread``: the same, whose ranks read nothing (what getting the rows to the ranks
  costs: the check, the layout, the shards, the ranks' start);
- ``pyspark_default``: pyspark's ``TorchDistributor._train_on_dataframe`` with its
  ``_get_spark_partition_data_loader(num_samples, 1024)``; its loader converts row by row, so
  its ``num_samples`` is capped with ``--pyspark-samples`` (the table says so).

Each rank times its epoch from the loader's creation to the last batch and reports its rows,
those seconds, its peak RSS (``getrusage``) and RSS growth over the epoch (psutil, 10 ms);
rank 0 returns every rank's figures (``all_gather_object`` over gloo). "wall" is the whole call
on the driver; the ratio is wall / the floor's wall of the same round. Our runs' phases come
from the run's phase events (``on_event``). Before every run (untimed) a trivial training on a
small DataFrame runs, so that no run starts Spark's Python workers or the warm agent because of
what ran before it (the launch benchmark measures cold starts; see :func:`warm_agents`).

    python benchmarks/dataframe_input.py --sizes 2000000,8000000 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import common
import pages
from common import log, median

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()

NAME = "dataframe_input"
FEATURES = 32
BATCH = 1024
TARGET_RATIO = 1.5  # ours_read wall / the floor's


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
    loader: Any = None
    if kind == "ours_noread":
        pass
    elif kind == "ours_read":
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


#: Our runs' phases, from the run's phase events: (name, from event, to event); "start" is
#: the call's start and "end" its return. Summed, they are the whole call.
PHASES = (
    ("check", "start", "input_checked"),
    ("stage start", "input_checked", "node_connected"),
    ("shards", "node_connected", "data_ready"),
    ("ranks start", "data_ready", "running"),
    ("epoch + finish", "running", "end"),
)


def count_rows(batches: Any) -> Any:
    """The floor's function: count the rows of the partition's record batches, nothing else."""
    import pyarrow as pa

    rows = 0
    for batch in batches:
        rows += batch.num_rows
    yield pa.record_batch([pa.array([rows], pa.int64())], ["rows"])


def warm_ranks() -> int:
    """A trivial training run before each timed run (see :func:`warm_agents`)."""
    return 0


def phases_of(marks: dict[str, float], total: float) -> dict[str, float | None]:
    """Seconds per phase of one of our runs, from the first time of each event."""
    marks = {"start": 0.0, **marks, "end": total}
    return {
        name: (marks[b] - marks[a]) if a in marks and b in marks else None for name, a, b in PHASES
    }


def build_variants(
    session: Any, df: Any, rows: int, pyspark_samples: int, timeout: float
) -> dict[str, Any]:
    import time

    per_rank = rows // 2

    def floor() -> Any:
        counted = sum(r["rows"] for r in df.mapInArrow(count_rows, "rows long").collect())
        if counted != rows:
            raise AssertionError(f"the floor counted {counted} rows, not {rows}")
        return {"ranks": [], "phases": {}}

    def ours(kind: str) -> Any:
        marks: dict[str, float] = {}
        started = time.perf_counter()

        def on_event(event: Any) -> None:
            marks.setdefault(event.name, time.perf_counter() - started)

        dist = common.ours(local_mode=False, spark=session, on_event=on_event)
        ranks = dist.train_on_dataframe(rank_epoch, df, kind, per_rank, BATCH, 1)
        return {"ranks": ranks, "phases": phases_of(marks, time.perf_counter() - started)}

    def pyspark() -> Any:
        dist = common.pyspark_distributor(local_mode=False)
        samples = min(per_rank, pyspark_samples)

        ranks = common.pyspark_run(
            session,
            lambda: dist._train_on_dataframe(rank_epoch, df, "pyspark", samples, BATCH, 1),
            timeout,
        )
        return {"ranks": ranks, "phases": {}}

    variants: dict[str, Any] = {
        "floor": floor,
        "ours_read": functools.partial(ours, "ours_read"),
        "ours_noread": functools.partial(ours, "ours_noread"),
    }
    if pyspark_samples > 0:
        variants["pyspark_default"] = pyspark
    return variants


def check(name: str, value: Any) -> dict[str, Any]:
    ranks = value.get("ranks") if isinstance(value, dict) else None
    if name != "floor" and (
        not isinstance(ranks, list)
        or len(ranks) != 2
        or not all(isinstance(r, dict) for r in ranks)
    ):
        raise AssertionError(f"{name} returned {value!r:.200}, not two ranks' figures")
    return value


def _spread(values: list[float]) -> tuple[float | None, float | None, float | None]:
    return (median(values), min(values), max(values)) if values else (None, None, None)


def summarize(series: dict[str, Any], size: int, pyspark_samples: int) -> dict[str, Any]:
    """Per variant: seconds, ratios to the same round's floor, phases, the ranks' figures."""
    floor = series["floor"].seconds
    per_size: dict[str, Any] = {}
    for name, s in series.items():
        summary = s.summary()
        # Round i of every variant ran in the same round as floor run i (alternate()).
        ratios = [a / b for a, b in zip(s.seconds, floor, strict=False)] if name != "floor" else []
        summary["ratio_vs_floor"], summary["ratio_min"], summary["ratio_max"] = _spread(ratios)
        summary["ratios_vs_floor"] = [round(r, 3) for r in ratios]
        phases = [e["phases"] for e in s.extra if e.get("phases")]
        summary["phases_median_s"] = (
            {
                phase: median([p[phase] for p in phases if p.get(phase) is not None])
                for phase, _, _ in PHASES
            }
            if phases
            else {}
        )
        ranks = [r for e in s.extra for r in e.get("ranks", [])]
        summary.update(
            {
                "rows_per_rank": median([r["rows"] for r in ranks]) if ranks else None,
                "load_s_per_rank_median": median([r["seconds"] for r in ranks]),
                "rows_per_s_per_rank_median": median(
                    [r["rows_per_s"] for r in ranks if r["rows_per_s"]]
                ),
                "ru_maxrss_mib_max": max((r["ru_maxrss_mib"] for r in ranks), default=None),
                "rss_growth_mib_max": max((r["rss_growth_mib"] for r in ranks), default=None),
                "capped": name.startswith("pyspark") and size // 2 > pyspark_samples,
            }
        )
        per_size[name] = summary
    return per_size


def warm_agents(session: Any, small: Any) -> None:
    """Untimed, before every run: Spark's Python workers kept alive, and a trivial training on
    the small DataFrame ``small``, so that a run does not start Spark's Python workers or the
    warm agent because a variant before it did not use them. It is a ``mapInArrow`` barrier
    stage like the timed runs' (an RDD stage may get other Python workers, whose task 0 then
    pays ``import torch`` for the rendezvous store)."""

    common.touch_python_workers(session)
    common.ours(local_mode=False, spark=session).train_on_dataframe(warm_ranks, small)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]

    log("starting a local[2] SparkSession")
    session = common.start_spark("local[2]")

    # Also what warm_agents() trains on before every timed run.
    small = make_dataframe(session, args.warm_size or 2_000)
    if args.warm_size:
        log(f"warm-up on {args.warm_size:,} rows (discarded): Spark's Python workers, imports")
        common.alternate(
            build_variants(session, small, args.warm_size, min(1000, args.pyspark_samples), 600),
            1,
            warmup=0,
            check=check,
            settle_s=args.settle,
        )

    results: dict[str, Any] = {}
    for size in sizes:
        log(f"building and caching {size:,} x {FEATURES} float32")
        df = make_dataframe(session, size)
        series = common.alternate(
            build_variants(session, df, size, args.pyspark_samples, args.timeout),
            args.repeats,
            warmup=args.warmup,
            check=check,
            settle_s=args.settle,
            before_each=lambda _name: warm_agents(session, small),
        )
        df.unpersist()
        per_size = summarize(series, size, args.pyspark_samples)
        results[str(size)] = per_size
    small.unpersist()
    session.stop()
    return {
        "label": args.label,
        "sizes": sizes,
        "features": FEATURES,
        "batch_size": BATCH,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "pyspark_samples_cap": args.pyspark_samples,
        "target_ratio": TARGET_RATIO,
        "phases": [list(p) for p in PHASES],
        "results": results,
        "notes": (
            "Before every run (untimed) a trivial 2-rank training on a small DataFrame warms "
            "the agents. "
            "wall is the whole call on the driver; '/ floor' is a run's wall over the "
            "floor's wall in the same round (median, min-max of the rounds). The phases "
            "of our runs are the medians of the times between the run's phase events. "
            "rows/s per rank is over the rank's own loading time (loader creation to last "
            "batch); maxrss is getrusage(RUSAGE_SELF) of the rank process (torch import "
            "included). pyspark's loader delivers only num_samples rows (capped) per rank. "
            "pyspark's runs between ours share our Spark Python workers and leave their "
            "torch group's variables (RANK, MASTER_PORT, CUDA_VISIBLE_DEVICES...) there; "
            "our runs neither pass them on nor start a new warm agent for them (before "
            "ac87b58 they did: a fresh torch import in the 'shards' phase). "
            "--pyspark-samples 0 runs ours alone."
        ),
    }


def _ratio_spread(s: dict[str, Any]) -> str:
    low, high = s.get("ratio_min"), s.get("ratio_max")
    return "-" if low is None or high is None else f"{low:.2f}-{high:.2f}"


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "DataFrame input"


def render(doc: dict[str, Any]) -> str:
    """This benchmark's section of benchmarks/README.md, from its JSON."""
    rows = []
    for size, variants in doc["results"].items():
        for name, s in variants.items():
            rows.append(
                [
                    f"{int(size):,}",
                    f"`{name}`",
                    pages.num(s.get("median_s")),
                    pages.spread(s),
                    pages.num(s.get("ratio_vs_floor"), 2, "x") if name != "floor" else "1x",
                    _ratio_spread(s),
                    (f"{int(s['rows_per_rank']):,}" if s.get("rows_per_rank") else "-")
                    + (" (capped)" if s.get("capped") else ""),
                    pages.num(s.get("rows_per_s_per_rank_median"), 0),
                    pages.num(s.get("ru_maxrss_mib_max"), 0),
                    f"{s.get('runs')}{pages.errors(s)}",
                ]
            )
    phase_names = [p[0] for p in doc.get("phases", [])]
    phase_rows = []
    for size, variants in doc["results"].items():
        for name, s in variants.items():
            phases = s.get("phases_median_s") or {}
            if phases:
                phase_rows.append(
                    [f"{int(size):,}", f"`{name}`"]
                    + [pages.num(phases.get(p)) for p in phase_names]
                )
    return (
        f"A cached DataFrame of N rows x {doc.get('features')} float32 columns in 2 partitions, "
        f"2 ranks in barrier mode on `local[2]`, batch {doc.get('batch_size')}, median of "
        f"{doc.get('repeats')} rounds (min-max after it). `floor` is one Spark pass over the "
        "rows as Arrow (`mapInArrow` counting rows): no DataFrame input can beat it. "
        f"Target: `ours_read` within {doc.get('target_ratio'):g}x of the floor. pyspark's "
        f"`num_samples` is capped at {doc.get('pyspark_samples_cap'):,} rows per rank (its "
        "loader converts row by row).\n\n"
        + pages.table(
            [
                "rows",
                "variant",
                "wall s",
                "min-max",
                "/ floor",
                "min-max",
                "rows per rank",
                "rows/s per rank",
                "rank maxrss MiB",
                "runs",
            ],
            rows,
        )
        + "\n\nWhere our time goes (seconds, medians; from the run's phase events):\n\n"
        + pages.table(["rows", "variant", *phase_names], phase_rows)
        + _render_before(doc, phase_names)
        + pages.notes(doc.get("notes"))
    )


def _render_before(doc: dict[str, Any], phase_names: list[str]) -> str:
    """Before and after a change, when the JSON holds the earlier code's run of this same
    benchmark (``before``: its label, code, a note on when it ran, and its results)."""
    before = doc.get("before")
    if not before:
        return ""
    rows = []
    for size, variants in doc["results"].items():
        earlier = before["results"].get(size, {})
        for name, s in variants.items():
            if name == "floor" or name not in earlier:
                continue
            b = earlier[name]
            rows.append(
                [
                    f"{int(size):,}",
                    f"`{name}`",
                    f"{pages.num(b.get('ratio_vs_floor'), 2, 'x')} ({_ratio_spread(b)})",
                    f"{pages.num(s.get('ratio_vs_floor'), 2, 'x')} ({_ratio_spread(s)})",
                    " / ".join(
                        pages.num((b.get("phases_median_s") or {}).get(p)) for p in phase_names
                    ),
                ]
            )
    return (
        f"\n\nBefore ({before.get('code')}) and after ({doc.get('code')}): the same benchmark "
        f"on this machine ({before.get('note', '')}); each ratio is to the floor of its own "
        "rounds, median (min-max).\n\n"
        + pages.table(
            [
                "rows",
                "variant",
                "before / floor",
                "after / floor",
                "before: " + ", ".join(phase_names),
            ],
            rows,
        )
    )


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline row: our DataFrame input (reading every batch) over the floor."""
    results = doc.get("results", {})
    cells = []
    for size, variants in results.items():
        s = variants.get("ours_read", {})
        if s.get("ratio_vs_floor") is not None:
            earlier = (doc.get("before") or {}).get("results", {}).get(size, {}).get("ours_read")
            was = (
                f", was {earlier['ratio_vs_floor']:.2f}x"
                if earlier and earlier.get("ratio_vs_floor")
                else ""
            )
            cells.append(
                f"{int(size) / 1e6:g}M rows: {s['ratio_vs_floor']:.2f}x ({_ratio_spread(s)}{was})"
            )
    if not cells:
        return []
    # The slowest size decides whether the target is met.
    worst = max(
        (variants.get("ours_read") or {}).get("ratio_vs_floor") or float("inf")
        for variants in results.values()
    )
    return [
        [
            "DataFrame input",
            f"train_on_dataframe (ranks read every batch) / one Spark pass over the rows, "
            f"medians of {doc.get('repeats')} (min-max)",
            "; ".join(cells),
            pages.met(worst, doc.get("target_ratio"), at_most=True),
        ]
    ]


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="2000000,8000000", help="comma-separated row counts")
    parser.add_argument(
        "--pyspark-samples",
        type=int,
        default=100_000,
        help="cap on pyspark's num_samples per rank (its loader converts row by row); 0: skip it",
    )
    parser.add_argument(
        "--warm-size", type=int, default=20_000, help="rows of a discarded warm-up round (0: none)"
    )
    parser.add_argument("--label", default="", help="what code this run measured (in the JSON)")


BENCH = pages.Benchmark(
    name=NAME,
    title=TITLE,
    measure=measure,
    render=render,
    summary=summary_rows,
    options=options,
    defaults={"repeats": 3, "warmup": 0, "settle": 1.0},
    quick=("--sizes=20000", "--repeats=1", "--warm-size=2000", "--pyspark-samples=1000"),
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
