"""The one renderer of the benchmarks, and what each benchmark declares (standard library only).

Every benchmark module declares one :class:`Benchmark`: its name, title, its options, how it measures (``measure(args)`` returns the
figures to write) and how its JSON reads (``render(doc)``: its section of
``benchmarks/README.md``, printed as is on the console after a run; ``summary(doc)``: its
rows of the headline table). ``common.main`` runs one, ``run_all.py`` collects them all.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Doc = dict[str, Any]


@dataclass(frozen=True)
class Benchmark:
    """One benchmark, declared once.

    Attributes:
        name: its results file, ``benchmarks/results/<folder>/<name>.json``.
        title: its section's heading (what it measures is its module docstring's first
            paragraph, the page's index shows it).
        measure: runs it; returns the figures (the JSON's settings, ``variants``, ``notes``).
        render: its section of the page, from its JSON.
        summary: its rows of the headline table (label, measure, ours, target).
        options: adds its own options to the common ones (``common.main``).
        defaults: its defaults of the common options (``repeats``, ``warmup``, ``timeout``...).
        quick: the options of its smallest run that still measures every part (``--quick``).
        headline: its summary rows also go in the top-level README.
        folder: a folder of ``benchmarks/results`` for its JSON.
    """

    name: str
    title: str
    measure: Callable[[argparse.Namespace], Doc]
    render: Callable[[Doc], str]
    summary: Callable[[Doc], list[list[str]]] | None = None
    options: Callable[[argparse.ArgumentParser], None] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    quick: tuple[str, ...] = ("--repeats=1", "--warmup=0")
    headline: bool = False
    folder: str = ""


def section(bench: Benchmark, doc: Doc) -> str:
    """A benchmark's section: its heading, its tables, the machine it ran on."""
    return f"## {bench.title}\n\n{bench.render(doc)}\n\n{machine_line(doc)}"


def num(value: Any, digits: int = 2, suffix: str = "") -> str:
    """A number for a table cell (``-`` for None)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


Column = tuple[str, Callable[[str, Doc], str]]


def columns(cols: list[Column], items: Mapping[str, Doc]) -> str:
    """A table with one row per item (a variant): each column its header and its cell."""
    return table([h for h, _ in cols], [[cell(n, s) for _, cell in cols] for n, s in items.items()])


def measured(labels: Mapping[str, str], variants: Mapping[str, Doc]) -> str:
    """A table of variants with what each measured: seconds, min-max, runs."""
    cols: list[Column] = [
        ("variant", name),
        ("measured", lambda n, _s: labels[n]),
        ("seconds", seconds),
        ("min-max s", min_max),
        ("runs", lambda _n, s: f"{s.get('runs')}{errors(s)}"),
    ]
    return columns(cols, variants)


def spread(s: Doc, what: str = "") -> str:
    """A variant's min-max seconds (or of one figure: ``save`` reads ``save_min_s``...)."""
    low, high = (
        s.get(f"{what}_min_s" if what else "min_s"),
        s.get(f"{what}_max_s" if what else "max_s"),
    )
    return "-" if low is None or high is None else f"{low:.2f}-{high:.2f}"


def name(n: str, _s: Doc) -> str:
    """The variant column."""
    return f"`{n}`"


def seconds(_n: str, s: Doc) -> str:
    """The median seconds column (``failed`` and the first error when no run worked)."""
    errors = s.get("errors") or []
    if not s.get("runs") and errors:
        return f"failed: {errors[0].splitlines()[0][:80]}"
    return num(s.get("median_s"))


def min_max(_n: str, s: Doc) -> str:
    """The min-max seconds column."""
    return spread(s)


def runs(_n: str, s: Doc) -> str:
    """The runs column, with how many failed."""
    return f"{s.get('runs')}{errors(s) if s.get('runs') else ''}"


def field_(key: str, digits: int = 2, suffix: str = "") -> Callable[[str, Doc], str]:
    """A column of one figure of the variant."""
    return lambda _n, s: num(s.get(key), digits, suffix)


def machine_line(doc: Doc) -> str:
    """The line that ends a section: the machine, the run's date, commit and load (what the
    file records of them)."""
    m = {**doc.get("machine", {}), **doc.get("environment", {})}
    cpu = f"{m.get('cores')} cores" + (f" ({m['cpu_model']})" if m.get("cpu_model") else "")
    memory = f", {m['memory_gib']} GiB" if m.get("memory_gib") else ""
    gpus = f", GPUs: {', '.join(m['gpus'])}" if m.get("gpus") else ""
    versions = ", ".join(
        f"{label} {m[key]}"
        for key, label in (
            ("torch", "torch"),
            ("pyspark", "pyspark"),
            ("cuda", "CUDA"),
            ("nccl", "NCCL"),
        )
        if m.get(key)
    )
    when = ", ".join(
        [str(m.get("date"))] + ([f"commit {m['git_commit']}"] if m.get("git_commit") else [])
    )
    load = f"; load at start {m['load_average']}" if m.get("load_average") else ""
    return f"*{cpu}{memory}{gpus}; {versions}; {when}{load}*"


def notes(text: Any) -> str:
    """A benchmark's own notes, as a paragraph."""
    return f"\n\nHow it is measured: {text}" if text else ""


def errors(summary: Doc) -> str:
    """How many runs of a variant failed, with the first error."""
    errors = summary.get("errors") or []
    return f" ({len(errors)} failed: {errors[0][:80]}...)" if errors else ""


def met(value: float | None, target: float | None, at_most: bool) -> str:
    """Whether a target was met, in words."""
    if value is None or target is None:
        return "-"
    met = value <= target if at_most else value >= target
    return f"{'<=' if at_most else '>='} {target:g}x ({'met' if met else 'not met'})"


def ci(c: Doc | None, digits: int = 3) -> str:
    """A paired ratio with its CI: ``0.975x (0.961-0.990)``."""
    if not c or c.get("geomean") is None:
        return "-"
    if c.get("ci_low") is None:
        return f"{c['geomean']:.{digits}f}x"
    return f"{c['geomean']:.{digits}f}x ({c['ci_low']:.{digits}f}-{c['ci_high']:.{digits}f})"


def ms(seconds: Any) -> str:
    """Seconds as milliseconds."""
    return num(seconds * 1000, 1) if isinstance(seconds, (int, float)) else "-"


def ratio_of(value: Any, reference: Any) -> float | None:
    """``value / reference``, None when either is missing."""
    return value / reference if value and reference else None
