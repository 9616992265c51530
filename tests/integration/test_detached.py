"""Detached runs: on the standalone cluster, a barrier training outlives the process that
submitted it (SIGKILLed mid-run), and other processes reattach through the run directory with
the CLI (wait, logs, status, list) or a RunHandle; a second submit reattaches instead of
training twice. In local mode, a cancel written into the directory stops the run with nothing
left; a DataFrame submitted detached is read by the detached driver's own application."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from harness.procs import wait_until_gone
from sparktorch_ops import TorchDistributor
from sparktorch_ops.detached import RunHandle
from sparktorch_ops.errors import TrainingCancelledError
from tests.support.cluster import Cluster

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


def submitted_then_killed(tmp_path: Path, steps: int, *options: str) -> tuple[Path, Path]:
    """``run --detached`` of SCRIPT (2 ranks, ``steps`` half-second steps) with ``options``,
    SIGKILLed while it waits on the run directory, once both ranks have started; the run
    directory and the folder of the ranks' marks."""
    script, marks, run_dir = tmp_path / "train.py", tmp_path / "marks", tmp_path / "run"
    script.write_text(SCRIPT)
    marks.mkdir()
    submitter = subprocess.Popen(
        [sys.executable, "-m", "sparktorch_ops.cli", "run", "--detached", "--run-dir",
         str(run_dir), "--num-processes", "2", *options, str(script), "--", str(marks),
         str(steps)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for(lambda: len(list(marks.glob("started.*"))) == 2, "the ranks' start", timeout=180)
    os.kill(submitter.pid, signal.SIGKILL)
    submitter.wait(30)
    return run_dir, marks


def sleep_on_every_rank(seconds: float) -> None:
    time.sleep(seconds)


def _run_keeping_error(distributor: TorchDistributor, raised: list[BaseException]) -> None:
    try:
        distributor.run(sleep_on_every_rank, 300)
    except BaseException as exc:
        raised.append(exc)


def test_a_cancel_written_into_the_run_directory_stops_the_run(tmp_path: Path) -> None:
    """A cancel stops the run with nothing left; a submit of the same training while it stops
    (a cleared Airflow task's next try) waits for its end and starts the training over; a
    run() waiting on a detached run stops it when cancelled."""
    distributor = TorchDistributor(
        num_processes=2, use_gpu=False, detached=True, run_dir=tmp_path / "run"
    )
    handle = distributor.submit(sleep_on_every_rank, 300)
    wait_for(lambda: handle.status().state == "running", "the run's start")
    first_run = handle.events()[0]["run_id"]
    assert cli("cancel", handle.run_dir).returncode == 0
    assert not handle.status().done  # still stopping
    assert distributor.submit(sleep_on_every_rank, 300).run_dir == handle.run_dir
    assert wait_until_gone(first_run, timeout=30) == []
    wait_for(lambda: handle.status().state == "running", "the training's start over")
    runs = {e["run_id"] for e in handle.events() if e.get("run_id")}
    assert len(runs) == 2, runs

    # A run() waiting on it (reattached) that is cancelled stops it too.
    raised: list[BaseException] = []
    waiter = threading.Thread(target=_run_keeping_error, args=(distributor, raised))
    waiter.start()
    while waiter.is_alive():  # cancel() is a no-op until run() is waiting
        distributor.cancel()
        waiter.join(0.2)
    assert [type(e) for e in raised] == [TrainingCancelledError], raised
    waited = cli("wait", handle.run_dir)
    assert waited.returncode == 130, (waited.stdout, waited.stderr)  # as run's exit on a cancel
    assert "cancel requested through the run directory" in waited.stderr
    assert handle.status().state == "cancelled"
    assert wait_until_gone((runs - {first_run}).pop(), timeout=30) == []
    bad = cli("wait", str(tmp_path / "nowhere"))
    assert bad.returncode == 2 and "run_dir:" in bad.stderr and "does not exist" in bad.stderr


def test_a_detached_barrier_training_on_the_standalone_cluster_outlives_its_submitter(
    tmp_path: Path, standalone_cluster: Cluster
) -> None:
    """``run --detached`` SIGKILLed once its ranks train: the training goes on, and the CLI
    waits for it, shows its logs and status and lists it from other processes; a submit of
    the same training reattaches instead of training again."""
    run_dir, marks = submitted_then_killed(tmp_path, 8, "--master", standalone_cluster.master_url)
    assert not RunHandle(run_dir).status().done  # it trains on

    waited = cli("wait", str(run_dir))
    assert waited.returncode == 0, (waited.stdout, waited.stderr)
    assert "2 ranks finished in" in waited.stdout
    result = RunHandle(run_dir).result()
    assert result.mode == "barrier" and result.app_id.startswith("app-")  # the cluster's
    assert "rank 0 done" in result.value and result.num_processes == 2
    assert wait_until_gone(result.run_id, timeout=30) == []
    logs = cli("logs", str(run_dir)).stdout
    assert "[rank 1|" in logs and "rank 1 step 7" in logs
    status = json.loads(cli("status", str(run_dir)).stdout)
    assert status["state"] == "succeeded" and status["run_dir"] == str(run_dir)
    # The same directory again: reattached, not trained twice.
    again = TorchDistributor(num_processes=2, use_gpu=False, detached=True, run_dir=run_dir)
    assert again.submit(str(tmp_path / "train.py"), str(marks), "8").status().state == "succeeded"
    assert len(list(marks.glob("started.*"))) == 2
    listed = cli("list", "--root", str(tmp_path)).stdout
    assert f"{status['training_id']}\tsucceeded\t{run_dir}" in listed


def rows_of_this_rank(batch_size: int) -> int:
    from sparktorch_ops.data import partition_loader

    return sum(len(batch["x"]) for batch in partition_loader(batch_size))


def test_a_dataframe_submitted_detached_is_read_in_an_application_of_its_own(
    spark: Any, tmp_path: Path
) -> None:
    """submit_on_dataframe from a classic session: the DataFrame is written into the run
    directory, and the detached driver trains on it in an application like the caller's."""
    frame = spark.range(10).selectExpr("cast(id as float) as x")
    handle = TorchDistributor(
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        detached=True,
        run_dir=tmp_path / "run",
        spark=spark,
    ).submit_on_dataframe(rows_of_this_rank, frame, 4)
    result = handle.wait(timeout=300)
    assert (result.value, result.input["rows"], result.mode) == (5, 10, "barrier")
    assert result.app_id != spark.sparkContext.applicationId  # the driver's own application
    assert sorted(p.suffix for p in (tmp_path / "run" / "input").glob("*.parquet")) != []
