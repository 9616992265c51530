"""A pytest plugin: ``--time-budget=SECONDS`` fails a run whose wall time exceeds it.

``scripts/test.sh`` passes the suite's budget to the integration and e2e run, so the stop that
makes the suite outgrow it fails, naming the tests that take the time (setup, call and
teardown each, as ``--durations`` shows them), instead of the growth showing stops later.
"""

from __future__ import annotations

import time

import pytest

SLOWEST = 25


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"fail the run when it takes longer than SECONDS, listing its {SLOWEST} slowest "
        "setups, calls and teardowns",
    )


def pytest_configure(config: pytest.Config) -> None:
    budget = config.getoption("time_budget")
    if budget is not None:
        config.pluginmanager.register(TimeBudget(budget), "sparktorch-time-budget")


class TimeBudget:
    """The run's wall time against ``budget`` seconds, and every phase's duration."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.started = time.monotonic()
        self.took: float | None = None
        self.durations: list[tuple[float, str, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations.append((report.duration, report.when, report.nodeid))

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        took = time.monotonic() - self.started
        if took > self.budget:
            self.took = took
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.took is None:
            return
        terminalreporter.section("test-time budget exceeded", red=True)
        terminalreporter.write_line(
            f"this run took {self.took:.0f} s, over its budget of {self.budget:.0f} s: make "
            "room (share a running service, fold a scenario into a run that already happens) "
            f"before adding more. Its {SLOWEST} slowest:"
        )
        for seconds, when, nodeid in sorted(self.durations, reverse=True)[:SLOWEST]:
            terminalreporter.write_line(f"{seconds:8.2f}s {when:<8} {nodeid}")
