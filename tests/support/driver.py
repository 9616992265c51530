"""Running a driver program in its own process (one SparkContext per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from tests.support.cluster import cluster_env

ROOT = Path(__file__).resolve().parents[2]
RESULT_PREFIX = "RESULT_JSON:"


def run_driver(
    tmp_path: Path, code: str, *, timeout: float = 300, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], str]:
    """Run ``code`` as a script; it reports by calling ``emit(obj)``. Returns (obj, output)."""
    script = tmp_path / "driver_program.py"
    script.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "def emit(obj):\n"
        f"    print({RESULT_PREFIX!r} + json.dumps(obj), flush=True)\n" + textwrap.dedent(code)
    )
    full_env = cluster_env()
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    output = proc.stdout + proc.stderr
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :]), output
    # The driver's Python traceback first: JVM logs after it would push it out of the tail.
    start = output.find("Traceback (most recent call last)")
    traceback = output[start : start + 4000] + "\n...\n" if start >= 0 else ""
    raise AssertionError(
        f"driver program exited {proc.returncode} without a result:\n{traceback}{output[-4000:]}"
    )


def pythonpath_env() -> dict[str, str]:
    """PYTHONPATH that lets a subprocess import the tests package."""
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
