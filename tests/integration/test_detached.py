"""Detached runs in local mode: the training outlives the process that submitted it (SIGKILLed
mid-run), and another process reattaches through the run directory with the CLI (wait, logs,
status) or a RunHandle; a second submit reattaches instead of training twice; a cancel written
into the directory stops the run with nothing left. (On a standalone cluster:
tests/integration/test_cluster.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.procs import wait_until_gone
from sparktorch_ops import TorchDistributor
from sparktorch_ops.detached import RunHandle

SCRIPT = """\
import os, sys, time
from pathlib import Path
rank = os.environ["RANK"]
marks = Path(sys.argv[1])
(marks / f"started.rank{rank}.{os.getpid()}").write_text("")
for step in range(int(sys.argv[2])):
    print(f"rank {rank} step {step}", flush=True)
    time.sleep(0.5)
print(f"rank {rank} done", flush=True)
"""


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparktorch_ops.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def wait_for(check: object, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.1)


def test_a_detached_run_outlives_its_submitter_and_another_process_waits_for_it(
    tmp_path: Path,
) -> None:
    script, marks, run_dir = tmp_path / "train.py", tmp_path / "marks", tmp_path / "run"
    script.write_text(SCRIPT)
    marks.mkdir()
    # ``run --detached`` submits, then waits on the run directory: SIGKILL it while it waits.
    submitter = subprocess.Popen(
        [sys.executable, "-m", "sparktorch_ops.cli", "run", "--detached", "--run-dir",
         str(run_dir), "--num-processes", "2", str(script), "--", str(marks), "8"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    wait_for(lambda: len(list(marks.glob("started.*"))) == 2, "the ranks' start")
    os.kill(submitter.pid, signal.SIGKILL)
    submitter.wait(30)
    assert not RunHandle(run_dir).status().done  # it trains on

    waited = cli("wait", str(run_dir))
    assert waited.returncode == 0, (waited.stdout, waited.stderr)
    assert "2 ranks finished in" in waited.stdout
    result = RunHandle(run_dir).result()
    assert "rank 0 done" in result.value and result.num_processes == 2
    logs = cli("logs", str(run_dir)).stdout
    assert "[rank 1|" in logs and "rank 1 step 7" in logs
    status = json.loads(cli("status", str(run_dir)).stdout)
    assert status["state"] == "succeeded" and status["run_dir"] == str(run_dir)
    # The same directory again: reattached, not trained twice.
    again = TorchDistributor(num_processes=2, use_gpu=False, detached=True, run_dir=run_dir)
    assert again.submit(str(script), str(marks), "8").status().state == "succeeded"
    assert len(list(marks.glob("started.*"))) == 2
    listed = cli("list", "--root", str(tmp_path)).stdout
    assert f"{status['training_id']}\tsucceeded\t{run_dir}" in listed


def sleep_on_every_rank(seconds: float) -> None:
    time.sleep(seconds)


def test_a_cancel_written_into_the_run_directory_stops_the_run(tmp_path: Path) -> None:
    handle = TorchDistributor(
        num_processes=2, use_gpu=False, detached=True, run_dir=tmp_path / "run"
    ).submit(sleep_on_every_rank, 300)
    wait_for(lambda: handle.status().state == "running", "the run's start")
    run_id = handle.events()[0]["run_id"]
    cancelled = cli("cancel", handle.run_dir)
    assert cancelled.returncode == 0, cancelled.stderr
    waited = cli("wait", handle.run_dir)
    assert waited.returncode == 130, (waited.stdout, waited.stderr)  # as run's exit on a cancel
    assert "cancel requested through the run directory" in waited.stderr
    assert handle.status().state == "cancelled"
    assert wait_until_gone(run_id, timeout=30) == []
    bad = cli("wait", str(tmp_path / "nowhere"))
    assert bad.returncode == 2 and "run_dir:" in bad.stderr and "does not exist" in bad.stderr
