"""Run every benchmark in turn, then print the results as markdown tables for the README.

    python benchmarks/run_all.py --repeats 5          # all benchmarks, then the tables
    python benchmarks/run_all.py --only launch,logs   # some of them
    python benchmarks/run_all.py --markdown           # only render benchmarks/results/*.json

Each benchmark is its own process (only one SparkContext per process, and a fresh driver for
the memory figures); run them on a quiet machine: the figures are wall-clock times.
Individual benchmarks take their own options (``python benchmarks/launch.py --help``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
ORDER = ("launch", "logs", "result", "memory", "throughput")


def commands(repeats: int, memory_runs: int) -> dict[str, list[str]]:
    """The command line of each benchmark."""
    py = sys.executable
    return {
        "launch": [py, str(BENCH_DIR / "launch.py"), f"--repeats={repeats}"],
        "logs": [py, str(BENCH_DIR / "logs.py"), f"--repeats={repeats}"],
        "result": [py, str(BENCH_DIR / "result.py"), f"--repeats={repeats}"],
        "memory": [py, str(BENCH_DIR / "memory.py"), f"--runs={memory_runs}"],
        "throughput": [py, str(BENCH_DIR / "throughput.py"), f"--repeats={repeats}"],
    }


# -- markdown --------------------------------------------------------------------------------
def _num(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _machine_line(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    gpus = f", GPUs: {', '.join(m['gpus'])}" if m.get("gpus") else ""
    return (
        f"*{m.get('cores')} cores ({m.get('cpu_model')}), {m.get('memory_gib')} GiB{gpus}; "
        f"torch {m.get('torch')}, pyspark {m.get('pyspark')}; {m.get('date')}, "
        f"commit {m.get('git_commit')}; load at start {m.get('load_average')}*"
    )


def _errors(summary: dict[str, Any]) -> str:
    errors = summary.get("errors") or []
    return f" ({len(errors)} failed: {errors[0][:80]}...)" if errors else ""


def render_launch(doc: dict[str, Any]) -> str:
    rows = []
    for name, s in doc["variants"].items():
        target = s.get("target_ratio")
        rows.append(
            [
                f"`{name}`",
                _num(s.get("median_s")),
                _num(s.get("ratio_vs_torchrun"), suffix="x"),
                _num(target, suffix="x") if target else "",
                f"{s.get('runs')}{_errors(s)}",
            ]
        )
    out = [
        f"**Launch** (trivial 2-rank all-reduce, median of {doc.get('repeats')}):",
        _table(["variant", "seconds", "vs torchrun", "target", "runs"], rows),
    ]
    for name, b in doc.get("breakdown", {}).items():
        if name.startswith("_") or "phases" not in b:
            continue
        phase_rows = [[p["phase"], _num(p["seconds"]), p["how"]] for p in b["phases"]]
        out.append(f"<details><summary>Where the time goes: <code>{name}</code></summary>\n")
        out.append(_table(["phase", "seconds", "how"], phase_rows))
        out.append("\n</details>")
    return "\n\n".join(out)


def render_logs(doc: dict[str, Any]) -> str:
    rows = [
        [
            f"`{name}`",
            _num(s.get("median_s")),
            _num(s.get("ratio_vs_torchrun"), suffix="x"),
            _num(s.get("driver_cpu_median_s")),
            _num(s.get("tree_cpu_median_s")),
            f"{s.get('verified_runs', '-')}/{s.get('runs')}" if name.startswith("ours") else "-",
            _errors(s),
        ]
        for name, s in doc["variants"].items()
    ]
    cost = doc.get("lines_cost_s") or {}
    tail = (
        "\n\nWhat the lines add over a 0-line run: torchrun "
        f"{_num(cost.get('torchrun_wall_s'))} s wall / {_num(cost.get('torchrun_cpu_s'))} s CPU, "
        f"ours {_num(cost.get('ours_local_script_wall_s'))} s wall / "
        f"{_num(cost.get('ours_local_script_cpu_s'))} s CPU."
        if cost
        else ""
    )
    return (
        f"**Logs** (2 ranks x {doc.get('lines_per_rank')} lines, target <= "
        f"{doc.get('target_ratio')}x, median of {doc.get('repeats')}):\n\n"
        + _table(
            [
                "variant",
                "seconds",
                "vs torchrun",
                "driver CPU s",
                "all CPU s",
                "verified",
                "errors",
            ],
            rows,
        )
        + tail
    )


def render_result(doc: dict[str, Any]) -> str:
    rows = []
    speedups = []
    for name, s in doc["variants"].items():
        if name.startswith("summary_"):
            transfer = s.get("transfer_s") or {}
            speedups.append(
                [
                    name.removeprefix("summary_"),
                    _num(s.get("speedup_total"), suffix="x"),
                    _num(transfer.get("ours")),
                    _num(transfer.get("pyspark")),
                    _num(s.get("speedup_transfer"), suffix="x"),
                    f">= {s.get('target_speedup')}x",
                ]
            )
            continue
        rows.append(
            [
                f"`{name}`",
                _num(s.get("median_s")),
                _num(s.get("peak_added_rss_mib_median"), 0),
                f"{s.get('runs')}{_errors(s)}",
            ]
        )
    return (
        f"**Result** (rank 0 returns a {doc.get('tensor_mib')} MiB tensor; `_control` builds it "
        f"and returns its size only; median of {doc.get('repeats')}):\n\n"
        + _table(["variant", "seconds", "driver peak RSS added, MiB", "runs"], rows)
        + "\n\n"
        + _table(
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
    )


def render_memory(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    rows = [[k.replace("_", " "), _num(v)] for k, v in s.items()]
    return (
        f"**Memory** (driver RSS, {doc.get('mode')} mode, job {doc.get('job')}, "
        f"{doc.get('runs')} runs in a row, MiB):\n\n" + _table(["figure", "MiB"], rows)
    )


def render_throughput(doc: dict[str, Any]) -> str:
    rows = [
        [
            f"`{name}`",
            _num(s.get("samples_per_s_median"), 0),
            _num(s.get("rate_ratio_vs_torchrun"), suffix="x"),
            _num(s.get("median_s")),
            f"{s.get('runs')}{_errors(s)}",
        ]
        for name, s in doc["variants"].items()
    ]
    return (
        f"**Throughput** (CNN, DDP on 2 ranks, {doc.get('steps')} steps x batch "
        f"{doc.get('batch_size')}, OMP_NUM_THREADS={doc.get('omp_num_threads')}, median of "
        f"{doc.get('repeats')}):\n\n"
        + _table(["variant", "samples/s", "vs torchrun", "wall s", "runs"], rows)
    )


RENDERERS = {
    "launch": render_launch,
    "logs": render_logs,
    "result": render_result,
    "memory": render_memory,
    "throughput": render_throughput,
}


def render_markdown(
    results_dir: Path = RESULTS_DIR, names: tuple[str, ...] = ORDER, prefix: str = ""
) -> str:
    """The results found in ``results_dir`` as markdown (one section per benchmark).

    Args:
        results_dir: where the JSON files are.
        names: which benchmarks, in this order (missing files are skipped).
        prefix: file name prefix (``smoke_`` for ``smoke_launch.json`` and so on).
    """
    sections = []
    for name in names:
        path = results_dir / f"{prefix}{name}.json"
        if not path.exists():
            continue
        doc = json.loads(path.read_text())
        sections.append(RENDERERS[name](doc) + "\n\n" + _machine_line(doc))
    return "\n\n".join(sections) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-runs", type=int, default=20)
    parser.add_argument("--only", default=",".join(ORDER), help="comma-separated benchmark names")
    parser.add_argument("--markdown", action="store_true", help="only render the existing results")
    parser.add_argument("--prefix", default="", help="render <prefix><name>.json (with --markdown)")
    args = parser.parse_args(argv)
    selected = tuple(n.strip() for n in args.only.split(",") if n.strip())
    unknown = set(selected) - set(ORDER)
    if unknown:
        parser.error(f"unknown benchmarks: {', '.join(sorted(unknown))}")
    failed = []
    if not args.markdown:
        for name, argv_ in commands(args.repeats, args.memory_runs).items():
            if name not in selected:
                continue
            print(f"\n===== {name}: {' '.join(argv_[1:])}", flush=True)
            if subprocess.run(argv_, check=False).returncode != 0:
                failed.append(name)
    print("\n" + render_markdown(names=selected, prefix=args.prefix if args.markdown else ""))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
