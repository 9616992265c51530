"""``--time-budget`` (tests/support/time_budget.py), in a pytest of its own on a tiny suite:
over the budget the run fails and names its slowest phases; within it, nothing changes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import time_budget

ROOT = Path(__file__).resolve().parents[2]
SUITE = """
import time

def test_slow():
    time.sleep(0.6)

def test_fast():
    pass
"""


def run_budgeted(tmp_path: Path, budget: str, *options: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(SUITE)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.support.time_budget",
            "-p",
            "no:cacheprovider",
            f"--time-budget={budget}",
            *options,
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_sample.py"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_a_run_over_its_budget_fails_naming_its_slowest_tests(tmp_path: Path) -> None:
    proc = run_budgeted(tmp_path, "0.3")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout
    assert "test-time budget exceeded" in proc.stdout
    assert "of its budget of 0 s" in proc.stdout
    listed = [line for line in proc.stdout.splitlines() if "test_sample.py::" in line]
    assert listed[0].split()[1:] == ["call", "test_sample.py::test_slow"], listed
    assert float(listed[0].split()[0].rstrip("s")) >= 0.6


def test_a_run_within_its_budget_passes_and_says_nothing(tmp_path: Path) -> None:
    proc = run_budgeted(tmp_path, "600")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exceeded" not in proc.stdout
    budget_line = [line for line in proc.stdout.splitlines() if "test-time budget" in line]
    assert len(budget_line) == 1 and "of its budget of 600 s" in budget_line[0], proc.stdout


def test_a_slower_machine_gets_a_proportionally_larger_budget(tmp_path: Path) -> None:
    # The unit tier beside the run took ten times the reference machine's seconds.
    yardstick = tmp_path / "unit-tier-seconds"
    yardstick.write_text(f"{time_budget.REFERENCE_YARDSTICK_S * 10}\n")
    proc = run_budgeted(tmp_path, "0.3", f"--time-yardstick-file={yardstick}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "of its budget of 3 s (0 s on the reference machine" in proc.stdout
    assert "10.00x its time" in proc.stdout


def test_a_faster_machine_or_no_yardstick_keeps_the_whole_budget(tmp_path: Path) -> None:
    half = time_budget.REFERENCE_YARDSTICK_S / 2
    assert time_budget.scaled_budget(1100, half) == 1100
    assert time_budget.scaled_budget(1100, None) == 1100
    slower = time_budget.scaled_budget(1100, time_budget.REFERENCE_YARDSTICK_S * 1.5)
    assert slower == pytest.approx(1650)
    assert time_budget.read_yardstick(None) is None
    assert time_budget.read_yardstick(str(tmp_path / "missing")) is None
    (tmp_path / "empty").write_text("")  # the unit tier has not ended
    assert time_budget.read_yardstick(str(tmp_path / "empty")) is None
    (tmp_path / "seconds").write_text("83\n")
    assert time_budget.read_yardstick(str(tmp_path / "seconds")) == 83
