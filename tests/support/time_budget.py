"""A pytest plugin: ``--time-budget=SECONDS`` fails a run whose wall time exceeds it.

``scripts/test.sh`` passes the suite's budget to the integration and e2e run, so the stop that
makes the suite outgrow it fails, naming the tests that take the time (setup, call and
teardown each, as ``--durations`` shows them), instead of the growth showing stops later.

The budget is in seconds of the reference machine (the 2-core VM the suite is planned on).
Machines here differ by up to ~1.8x in speed, so a guard in plain seconds would fail a green
suite on a slower one: with ``--time-yardstick=SECONDS``, this machine's time for a fixed
CPU-bound workload (``python -m tests.support.time_budget`` prints it; ``scripts/test.sh``
measures it before anything else runs), the budget grows by this machine's slowness against
the reference, never shrinks. Every budgeted run prints its seconds, the ratio and the budget.
"""

from __future__ import annotations

import hashlib
import time

import pytest

SLOWEST = 25
#: The yardstick's seconds on the reference machine (``python -m tests.support.time_budget``
#: on an idle 2-core dev VM, the best of several runs).
REFERENCE_YARDSTICK_S = 0.047


def yardstick_seconds(repeats: int = 20) -> float:
    """The best of ``repeats`` timings of a fixed single-core workload: Python bytecode (what
    the suite's drivers, ranks and services mostly run) and hashing."""
    best = float("inf")
    block = bytes(1 << 20)
    for _ in range(repeats):
        started = time.perf_counter()
        total = 0
        for i in range(400_000):
            total += (i * i) % 7
        for _ in range(16):
            block = hashlib.sha256(block).digest() * (1 << 15)
        best = min(best, time.perf_counter() - started)
    return best


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
        "--time-yardstick",
        type=float,
        default=None,
        metavar="SECONDS",
        help="this machine's yardstick time (python -m tests.support.time_budget): a slower "
        "machine than the reference gets a proportionally larger budget",
    )


def pytest_configure(config: pytest.Config) -> None:
    budget = config.getoption("time_budget")
    if budget is not None:
        yardstick = config.getoption("time_yardstick")
        config.pluginmanager.register(TimeBudget(budget, yardstick), "sparktorch-time-budget")


def scaled_budget(budget: float, yardstick: float | None) -> float:
    """``budget`` seconds of the reference machine on a machine whose yardstick took
    ``yardstick`` seconds (pure): larger on a slower machine, never smaller."""
    if yardstick is None:
        return budget
    return budget * max(1.0, yardstick / REFERENCE_YARDSTICK_S)


class TimeBudget:
    """The run's wall time against ``budget`` reference seconds, and every phase's duration."""

    def __init__(self, budget: float, yardstick: float | None = None) -> None:
        self.budget = budget
        self.yardstick = yardstick
        self.allowed = scaled_budget(budget, yardstick)
        self.started = time.monotonic()
        self.took = 0.0
        self.durations: list[tuple[float, str, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations.append((report.duration, report.when, report.nodeid))

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.took = time.monotonic() - self.started
        if self.took > self.allowed:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        speed = (
            ""
            if self.yardstick is None
            else f" (yardstick {self.yardstick:.3f} s here against {REFERENCE_YARDSTICK_S:.3f} s "
            f"on the reference machine: {self.yardstick / REFERENCE_YARDSTICK_S:.2f}x its time)"
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


if __name__ == "__main__":
    print(f"{yardstick_seconds():.4f}")
