"""Markdown pieces the benchmarks render their sections with (standard library only)."""

from __future__ import annotations

from typing import Any


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


def spread(s: dict[str, Any]) -> str:
    """A variant's min-max seconds."""
    if s.get("min_s") is None or s.get("max_s") is None:
        return "-"
    return f"{s['min_s']:.2f}-{s['max_s']:.2f}"


def machine_line(doc: dict[str, Any]) -> str:
    """The line that ends a section: the run's date, commit and load."""
    m = doc.get("machine", {})
    gpus = f", GPUs: {', '.join(m['gpus'])}" if m.get("gpus") else ""
    return (
        f"*{m.get('cores')} cores ({m.get('cpu_model')}), {m.get('memory_gib')} GiB{gpus}; "
        f"torch {m.get('torch')}, pyspark {m.get('pyspark')}; {m.get('date')}, "
        f"commit {m.get('git_commit')}; load at start {m.get('load_average')}*"
    )


def notes(text: Any) -> str:
    """A benchmark's own notes, as a paragraph."""
    return f"\n\nHow it is measured: {text}" if text else ""


def errors(summary: dict[str, Any]) -> str:
    """How many runs of a variant failed, with the first error."""
    errors = summary.get("errors") or []
    return f" ({len(errors)} failed: {errors[0][:80]}...)" if errors else ""


def met(value: float | None, target: float | None, at_most: bool) -> str:
    """Whether a target was met, in words."""
    if value is None or target is None:
        return "-"
    met = value <= target if at_most else value >= target
    return f"{'<=' if at_most else '>='} {target:g}x ({'met' if met else 'not met'})"


def ci(c: dict[str, Any] | None, digits: int = 3) -> str:
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


def min_max(s: dict[str, Any], what: str) -> str:
    """A variant's min-max of one figure."""
    low, high = s.get(f"{what}_min_s"), s.get(f"{what}_max_s")
    return "-" if low is None or high is None else f"{low:.2f}-{high:.2f}"


def variant_rows(doc: dict[str, Any], labels: dict[str, str]) -> list[list[str]]:
    """One row per variant: label, what was measured, its seconds and runs."""
    rows = []
    for name, label in labels.items():
        s = doc["variants"].get(name)
        if s is None:
            continue
        seconds = num(s.get("median_s")) if s.get("runs") else "failed"
        rows.append([f"`{name}`", label, seconds, spread(s), f"{s.get('runs')}{errors(s)}"])
    return rows
