"""Limits and no silent loss, each fault triggered for real: a result over its limit, output
that outlives its rank, a supervisor's backlog, a failing write, a Spark task that raised and a
Spark job killed from outside (local mode, and barrier mode on the shared local[2] session)."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from harness.procs import wait_until_gone
from sparktorch_ops import (
    ResultTooLargeError,
    SparkJobKilledError,
    TorchDistributor,
    TrainingFailedError,
)
from sparktorch_ops.driver import supervise
from sparktorch_ops.driver.collector.output import TAIL_CHARS
from sparktorch_ops.results import OUTPUT_CUT_NOTE
from sparktorch_ops.wire.env import RUN_ID_ENV
from tests.faults.training import long_training
from tests.support.driver import run_driver
from tests.support.records import Collect, collecting_logger


@pytest.fixture
def collected() -> Iterator[tuple[logging.Logger, Collect]]:
    logger, handler = collecting_logger("test.limits")
    yield logger, handler
    logger.removeHandler(handler)


class PeakRss:
    """This process's peak resident memory while the block runs, sampled every 10 ms."""

    def __init__(self) -> None:
        self.before = self.peak = psutil.Process().memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, me.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def added(self) -> int:
        return self.peak - self.before


# -- rank 0's result -------------------------------------------------------------------------
def one_gib_result() -> bytes:
    return b"\x01" * (1 << 30)


def test_a_result_over_max_result_bytes_fails_fast_and_is_not_held(
    collected: tuple[logging.Logger, Collect],
) -> None:
    logger, _ = collected
    limit = 64 << 20
    started = time.monotonic()
    with PeakRss() as rss, pytest.raises(ResultTooLargeError) as info:
        TorchDistributor(num_processes=1, use_gpu=False, logger=logger, max_result_bytes=limit).run(
            one_gib_result
        )
    seconds = time.monotonic() - started
    error = info.value
    assert error.limit == limit and error.size > limit and error.setting == "max_result_bytes"
    assert "max_result_bytes=67,108,864" in str(error)
    # The driver refused it after at most one more 16 MiB chunk, never holding the gigabyte.
    assert error.exact or error.size <= limit + (16 << 20)
    assert rss.added < 400 << 20, f"the driver grew by {rss.added >> 20} MiB"
    assert seconds < 60
    print(f"refused {error.size} bytes > {limit} in {seconds:.1f} s, driver +{rss.added >> 20} MiB")


# -- output tails ----------------------------------------------------------------------------
def long_lines() -> int:
    print("y" * (4 << 20), flush=True)
    for i in range(300):
        print(f"short {i}", flush=True)
    print("z" * (1 << 20), flush=True)
    return 0


def test_output_tails_are_bounded_in_bytes_while_the_logger_gets_every_line(
    collected: tuple[logging.Logger, Collect],
) -> None:
    logger, handler = collected
    result = TorchDistributor(num_processes=1, use_gpu=False, logger=logger).launch(long_lines)
    tail = result.outputs[0]
    assert len(tail) <= TAIL_CHARS + 1000
    assert tail.endswith(" \u2026[cut 1032192 bytes]")  # 1 MiB - 16 KiB of z
    assert "short 299" in tail
    bodies = [m.split("] ", 1)[1] for m in handler.messages() if m.startswith("[rank 0|")]
    assert "y" * (4 << 20) in bodies and "z" * (1 << 20) in bodies  # the log is not cut


# -- output that outlives its rank, a slow driver ---------------------------------------------
LEAVE_A_CHILD = """\
import subprocess, sys
print("before the child", flush=True)
# A background process that inherits the rank's stdout and stderr and outlives the rank.
subprocess.Popen(["sleep", "60"])
print("the rank is done", flush=True)
"""


def test_a_child_that_holds_the_rank_s_pipes_is_said_not_waited_for_or_hidden(
    tmp_path: Path, collected: tuple[logging.Logger, Collect]
) -> None:
    logger, _ = collected
    script = tmp_path / "leave.py"
    script.write_text(LEAVE_A_CHILD)
    started = time.monotonic()
    result = TorchDistributor(num_processes=1, use_gpu=False, logger=logger).launch(str(script))
    seconds = time.monotonic() - started
    value = result.value
    assert value.startswith("before the child\nthe rank is done\n")
    # The supervisor gave up on the held pipe after its grace period, and said so...
    assert (
        f"{OUTPUT_CUT_NOTE}: the rank exited but a process it started still held its stdout"
        in value
    )
    # ...and the value and the result say they are incomplete.
    assert value.endswith("stopped reading its output early]\n")
    assert result.output_truncated and result.summary()["output_truncated"] is True
    assert seconds < 45
    assert not wait_until_gone(result.run_id, timeout=30)  # the sleep is gone too


HOLD_THE_DRIVER = """\
print("first", flush=True)
print("HOLD", flush=True)
print("after the hold", flush=True)
"""


class HoldOnLine(Collect):
    """Holds the driver's channel thread on one line for longer than the run's drain."""

    def __init__(self, line: str, seconds: float) -> None:
        super().__init__()
        self.line, self.seconds = line, seconds

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().endswith(f"] {self.line}"):
            time.sleep(self.seconds)
        super().emit(record)


def test_a_drain_that_times_out_marks_the_value_and_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervise, "DRAIN_S", 2.0)
    logger = logging.getLogger(f"test.limits.hold.{id(object())}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    handler = HoldOnLine("HOLD", 6.0)
    logger.addHandler(handler)
    script = tmp_path / "hold.py"
    script.write_text(HOLD_THE_DRIVER)
    try:
        result = TorchDistributor(num_processes=1, use_gpu=False, logger=logger).launch(str(script))
    finally:
        logger.removeHandler(handler)
    value = result.value
    assert value.startswith("first\nHOLD\n"), value
    assert value.endswith(
        "[sparktorch_ops: output may be incomplete: not every rank had hung up 2 s after the "
        "run ended; output sent later was not read]\n"
    ), value
    assert result.output_truncated
    warnings = [r for r in handler.records if r.levelno == logging.WARNING]
    assert any("not every rank hung up within 2 s" in r.getMessage() for r in warnings)


def fill_the_pipe_then_exit(marker: str) -> int:
    """Write numbered lines without blocking until every buffer between here and the driver
    is full, then exit at once: what is left in the pipe must still reach the driver."""
    import fcntl

    fd = 1
    fcntl.fcntl(fd, 1031, 1 << 20)  # F_SETPIPE_SZ: a 1 MiB pipe, 16 reads for the supervisor
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    count = 0
    while count < 2_000_000:
        try:
            os.write(fd, f"line {count:07d} {'x' * 86}\n".encode())  # atomic: < PIPE_BUF
        except BlockingIOError:
            break
        count += 1
    fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    Path(marker).write_text(str(count))
    return count


class SlowUntilMarker(Collect):
    """A driver busy elsewhere: its channel thread waits on the first rank line until the rank
    has filled every buffer and exited, and 7 s longer (the supervisor used to wait 5 s)."""

    def __init__(self, marker: Path) -> None:
        super().__init__()
        self.marker = marker
        self.held = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.held and "] line " in record.getMessage():
            self.held = True
            deadline = time.monotonic() + 60
            while not self.marker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(7)
        super().emit(record)


def test_a_supervisor_forwards_all_its_rank_wrote_before_reporting_the_exit(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "written"
    logger = logging.getLogger(f"test.limits.slow.{id(object())}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    handler = SlowUntilMarker(marker)
    logger.addHandler(handler)
    try:
        count = TorchDistributor(num_processes=1, use_gpu=False, logger=logger).run(
            fill_the_pipe_then_exit, str(marker)
        )
    finally:
        logger.removeHandler(handler)
    numbers = [int(m.split("line ", 1)[1][:7]) for m in handler.messages() if "] line " in m]
    assert handler.held and count > 10_000  # the pipe alone holds 1 MiB
    assert numbers == list(range(count)), f"{count - len(numbers)} of {count} lines lost"


# -- temp dirs -------------------------------------------------------------------------------
FAILING_WRITE = """
import os, resource, signal, tempfile
# Files of this process may not grow past 64 KiB: writing the 1 MiB payload fails for real
# (EFBIG, as a full disk fails with ENOSPC).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
from sparktorch_ops import TorchDistributor

def train(blob):
    return len(blob)

try:
    TorchDistributor(num_processes=1, use_gpu=False).run(train, b"x" * (1 << 20))
    emit({"error": None})
except Exception as exc:
    emit({"error": type(exc).__name__, "message": str(exc),
          "left": os.listdir(tempfile.gettempdir())})
"""


def test_a_failing_payload_write_leaves_no_work_directory(tmp_path: Path) -> None:
    workdirs = tmp_path / "tmp"
    workdirs.mkdir()
    outcome, output = run_driver(
        tmp_path, FAILING_WRITE, timeout=120, env={"TMPDIR": str(workdirs)}
    )
    assert outcome["error"] == "OSError" and "File too large" in outcome["message"], output
    assert outcome["left"] == [] and list(workdirs.iterdir()) == []


# -- the Spark side --------------------------------------------------------------------------
FILE_SIZE_LIMIT = """
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
"""


def blob_length(blob: bytes) -> int:
    return len(blob)


def test_a_barrier_task_that_raised_fails_the_run_with_spark_s_reason(
    spark: Any, tmp_path: Path, collected: tuple[logging.Logger, Collect]
) -> None:
    # The executors' Python (a fresh pyspark daemon, for this environment) may write no file
    # over 4 KiB: writing the rank payload in the barrier task fails for real.
    logger, handler = collected
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FILE_SIZE_LIMIT)
    sc = spark.sparkContext
    sc.environment["PYTHONPATH"] = str(site)
    try:
        with pytest.raises(TrainingFailedError) as info:
            TorchDistributor(
                num_processes=2, local_mode=False, use_gpu=False, spark=spark, logger=logger
            ).run(blob_length, b"x" * (64 << 10))
    finally:
        del sc.environment["PYTHONPATH"]
    text = str(info.value)
    assert "OSError: [Errno 27] File too large" in text, text
    first = info.value.first_failure
    assert first is not None and "failed in Spark" in first.reason
    assert "executor died?" not in text
    logged = [m for m in handler.messages() if "the Spark job failed" in m]
    assert logged and "File too large" in logged[0] and "node/task.py" in logged[0]


def kill_from_the_ui(sc: Any) -> None:
    # What the Spark UI's kill link does: SparkContext.cancelJob(id, "killed via the Web UI").
    (job,) = sc.statusTracker().getActiveJobsIds()
    sc._jsc.sc().cancelJob(job, "killed via the Web UI")


@pytest.mark.parametrize(
    "kill", [kill_from_the_ui, lambda sc: sc.cancelAllJobs()], ids=["ui_kill", "cancel_all"]
)
def test_a_spark_job_killed_from_outside_is_a_cancellation(
    spark: Any, tmp_path: Path, kill: Any
) -> None:
    outcome: dict[str, Any] = {}

    def go() -> None:
        try:
            TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark).run(
                long_training, str(tmp_path)
            )
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"rank{r}.pid").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.1)
    pid = int((tmp_path / "rank0.pid").read_text())
    run_id = psutil.Process(pid).environ()[RUN_ID_ENV]
    started = time.monotonic()
    kill(spark.sparkContext)
    thread.join(120)
    assert not thread.is_alive()
    error = outcome.get("error")
    assert isinstance(error, SparkJobKilledError), repr(error)
    # Spark's own reason, not only our prefix: the job was cancelled on Spark's side.
    assert "killed outside sparktorch_ops" in str(error)
    assert re.search(r"\[SPARK_JOB_CANCELLED\]|\bJob \d+ cancelled\b", str(error)), str(error)
    assert time.monotonic() - started < 60
    assert not wait_until_gone(run_id, timeout=30)
