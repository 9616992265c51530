"""A pytest plugin: ``--time-budget=SECONDS`` fails a run whose wall time exceeds it.

``scripts/test.sh`` passes the suite's budget to the integration and e2e run, so the stop that
makes the suite outgrow it fails, naming the tests that take the time (setup, call and
teardown each, as ``--durations`` shows them), instead of the growth showing stops later.

The budget is in seconds of the reference machine (the 2-core dev VM the suite is planned on).
Machines here differ by up to ~1.8x in speed, so a guard in plain seconds would fail a green
suite on a slower one. The yardstick is the unit tier (integrations blocked) that
``scripts/test.sh`` runs beside this one, on the same machine, under the same load: with
``--time-yardstick-file=PATH`` (where that step writes its seconds), the budget grows by its
time against the reference machine's, never shrinks. Every budgeted run prints its seconds,
the ratio and the budget.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

SLOWEST = 25
#: The unit tier's seconds beside the integration and e2e tiers on the reference machine
#: (424 tests, where those two tiers took 1,050 s).
REFERENCE_YARDSTICK_S = 37.3


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"fail the run when it takes longer than SECONDS (of the reference machine), "
        f"listing its {SLOWEST} slowest setups, calls and teardowns",
    )
    parser.addoption(
        "--time-yardstick-file",
        default=None,
        metavar="PATH",
        help="where the unit tier beside this run writes its seconds, read when the run ends: "
        "a slower machine than the reference gets a proportionally larger budget",
    )


def pytest_configure(config: pytest.Config) -> None:
    budget = config.getoption("time_budget")
    if budget is not None:
        yardstick_file = config.getoption("time_yardstick_file")
        config.pluginmanager.register(TimeBudget(budget, yardstick_file), "sparktorch-time-budget")


def scaled_budget(budget: float, yardstick: float | None) -> float:
    """``budget`` seconds of the reference machine on a machine whose yardstick took
    ``yardstick`` seconds (pure): larger on a slower machine, never smaller."""
    if yardstick is None:
        return budget
    return budget * max(1.0, yardstick / REFERENCE_YARDSTICK_S)


def read_yardstick(path: str | None) -> float | None:
    """The seconds the yardstick step wrote to ``path``; None without a path or a number."""
    if path is None:
        return None
    try:
        return float(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


class TimeBudget:
    """The run's wall time against ``budget`` reference seconds, and every phase's duration."""

    def __init__(self, budget: float, yardstick_file: str | None = None) -> None:
        self.budget = budget
        self.yardstick_file = yardstick_file
        self.yardstick: float | None = None
        self.allowed = budget
        self.started = time.monotonic()
        self.took = 0.0
        self.durations: list[tuple[float, str, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations.append((report.duration, report.when, report.nodeid))

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.took = time.monotonic() - self.started
        # The unit tier beside this run ended long before it (it takes a minute or two).
        self.yardstick = read_yardstick(self.yardstick_file)
        self.allowed = scaled_budget(self.budget, self.yardstick)
        if self.took > self.allowed:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        speed = (
            ""
            if self.yardstick is None
            else f" (yardstick: the unit tier took {self.yardstick:.0f} s here against "
            f"{REFERENCE_YARDSTICK_S:.1f} s on the reference machine: "
            f"{self.yardstick / REFERENCE_YARDSTICK_S:.2f}x its time)"
        )
        summary = (
            f"this run took {self.took:.0f} s, {self.took / self.allowed:.2f} of its budget of "
            f"{self.allowed:.0f} s ({self.budget:.0f} s on the reference machine{speed})"
        )
        if self.took <= self.allowed:
            terminalreporter.write_line(f"test-time budget: {summary}")
            return
        terminalreporter.section("test-time budget exceeded", red=True)
        terminalreporter.write_line(
            f"{summary}: make room (share a running service, fold a scenario into a run that "
            f"already happens) before adding more. Its {SLOWEST} slowest:"
        )
        for seconds, when, nodeid in sorted(self.durations, reverse=True)[:SLOWEST]:
            terminalreporter.write_line(f"{seconds:8.2f}s {when:<8} {nodeid}")
