"""The ``sparktorch-ops`` command: output, exit status, interruption."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.procs import wait_until_gone

SCRIPT = """\
import os, sys, time
rank = int(os.environ["RANK"])
print(f"hello from {rank} with {sys.argv[1:]}", flush=True)
if os.environ.get("MODE") == "fail" and rank == 1:
    sys.exit(4)
if os.environ.get("MODE") == "hang":
    open(os.path.join(os.environ["READY_DIR"], f"rank{rank}"), "w").write(os.environ["SPARKTORCH_OPS_RUN_ID"])
    time.sleep(600)
"""


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sparktorch_ops.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_cli_prints_rank_output_and_exits_with_the_run_status(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ok = cli("run", "--num-processes", "2", str(script), "--", "--lr=0.1")
    out, err = ok.communicate(timeout=300)
    assert ok.returncode == 0, err
    assert "[rank 0|" in out and "hello from 0 with ['--lr=0.1']" in out
    assert "hello from 1 with ['--lr=0.1']" in out

    failing = cli("run", "--num-processes", "2", str(script), env={"MODE": "fail"})
    out, err = failing.communicate(timeout=300)
    assert failing.returncode == 4, (out, err)
    assert "rank 1 failed first" in err

    stalled = cli(
        "run", "--num-processes", "2", "--stall-timeout", "3", str(script),
        env={"MODE": "hang", "READY_DIR": str(tmp_path)},
    )  # fmt: skip
    out, err = stalled.communicate(timeout=300)
    assert stalled.returncode == 1, (out, err)
    assert "training stalled" in err and "in <module> (train.py:8) <- time.sleep(600)" in err

    bad = cli("run", "--num-processes", "0", str(script))
    out, err = bad.communicate(timeout=60)
    assert bad.returncode == 2 and "num_processes" in err


def test_cli_sigint_cancels_and_leaves_nothing(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = cli(
        "run", "--num-processes", "2", str(script),
        env={"MODE": "hang", "READY_DIR": str(tmp_path)},
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not ((tmp_path / "rank0").exists() and (tmp_path / "rank1").exists()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    run_id = (tmp_path / "rank0").read_text()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "cancelled" in err
    assert "rank 1 in <module> (train.py:8) <- time.sleep(600)" in err  # taken before teardown
    assert not wait_until_gone(run_id, timeout=30)
