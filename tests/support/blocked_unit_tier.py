"""Run the unit tier with pyspark, py4j, Airflow, Prefect and MLflow impossible to import.

``python -m tests.support.blocked_unit_tier [PYTEST ARGS]`` (a step of scripts/test.sh) writes a
``sitecustomize`` that blocks those packages into a directory put first on ``PYTHONPATH``, so
the pytest process and every Python it starts have them blocked. It fails when a package is
not really blocked, when the tier fails, and when any unit test is skipped: a skip would hide
a test that silently needs a blocked package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.blocking import INTEGRATIONS, blocker_source

ROOT = Path(__file__).resolve().parents[2]


def blocked_env(site: Path) -> dict[str, str]:
    """The environment with ``site/sitecustomize.py`` blocking every integration package."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(blocker_source(INTEGRATIONS))
    pythonpath = [str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in pythonpath if p))


def unblocked_packages(env: dict[str, str]) -> list[str]:
    """The integration packages that a Python started with ``env`` can still import."""
    leaks = []
    for name in INTEGRATIONS:
        probe = subprocess.run(
            [sys.executable, "-c", f"import {name}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        if probe.returncode == 0 or f"{name} is blocked" not in probe.stderr:
            leaks.append(name)
    return leaks


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="sparktorch-blocked-") as scratch:
        env = blocked_env(Path(scratch) / "site")
        leaks = unblocked_packages(env)
        if leaks:
            print(f"blocked unit tier: {leaks} can still be imported", file=sys.stderr)
            return 1
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "tests/unit", "-m", "unit", "-rs", *argv],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=600,
        )
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    seconds = time.monotonic() - started
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(f"blocked unit tier ({', '.join(INTEGRATIONS)} blocked): {seconds:.1f} s")
    if proc.returncode != 0:
        return proc.returncode
    if " passed" not in summary or "skipped" in summary:
        print(f"blocked unit tier: every test must run and pass, got: {summary}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
