"""``--time-budget`` (tests/support/time_budget.py), in a pytest of its own on a tiny suite:
over the budget the run fails and names its slowest phases; within it, nothing changes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = """
import time

def test_slow():
    time.sleep(0.6)

def test_fast():
    pass
"""


def run_budgeted(tmp_path: Path, budget: str) -> subprocess.CompletedProcess[str]:
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
    assert "over its budget of 0 s" in proc.stdout
    listed = [line for line in proc.stdout.splitlines() if "test_sample.py::" in line]
    assert listed[0].split()[1:] == ["call", "test_sample.py::test_slow"], listed
    assert float(listed[0].split()[0].rstrip("s")) >= 0.6


def test_a_run_within_its_budget_passes_and_says_nothing(tmp_path: Path) -> None:
    proc = run_budgeted(tmp_path, "600")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "budget" not in proc.stdout
