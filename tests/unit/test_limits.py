"""Bounds on what the driver keeps, and the typed errors of the limits (pure, no run)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pendulum
import pytest

from sparktorch_ops.driver.attempts import infrastructure_cause
from sparktorch_ops.driver.collector import RunCollector
from sparktorch_ops.driver.collector.metrics import MAX_METRIC_RECORDS
from sparktorch_ops.driver.collector.output import (
    TAIL_CHARS,
    TAIL_LINE_CHARS,
    TAIL_LINES,
    Tail,
    cut_line,
)
from sparktorch_ops.errors import (
    EXIT_INTERRUPTED,
    ConfigError,
    ResultTooLargeError,
    SparkJobKilledError,
    TrainingCancelledError,
    outcome_of,
)
from sparktorch_ops.launchers.barrier import _cancelled_by_spark, _summarize
from sparktorch_ops.options import DEFAULT_MAX_RESULT_BYTES
from sparktorch_ops.results import OUTPUT_CUT_NOTE, MetricRecord, RunResult
from sparktorch_ops.spec import LOCAL_PROCESSES_PER_CPU, LaunchSpec
from sparktorch_ops.wire import channel, messages
from sparktorch_ops.wire.messages import Hello
from tests.support.blocking import INTEGRATIONS, blocker_source

ROOT = Path(__file__).resolve().parents[2]


def peer(conn_id: int, rank: int, role: str = "supervisor") -> channel.Peer:
    hello = Hello(role=role, rank=rank, host=f"h{rank}", attempt=0)
    return channel.Peer(conn_id=conn_id, hello=hello, address="127.0.0.1:1")


def collector(logger: logging.Logger | None = None, **options: object) -> RunCollector:
    return RunCollector(
        logger or logging.getLogger("test.limits"),
        log_ranks=None,
        on_metrics=options.pop("on_metrics", None),  # type: ignore[arg-type]
        max_restarts=0,
        keep_rank0_stdout=bool(options.pop("script", False)),
        **options,  # type: ignore[arg-type]
    )


# -- output tails ----------------------------------------------------------------------------
def test_a_long_line_keeps_its_head_and_says_how_many_bytes_were_cut() -> None:
    line = "a" * 20 + "é" * 10  # é is 2 bytes in UTF-8
    assert cut_line(line, keep=20) == "a" * 20 + " \u2026[cut 20 bytes]"
    assert cut_line("short", keep=20) == "short"


def test_a_tail_is_bounded_by_lines_and_by_size() -> None:
    tail = Tail(max_lines=5, max_chars=100, line_chars=30)
    tail.extend([str(i) for i in range(10)])
    assert list(tail) == ["5", "6", "7", "8", "9"]
    tail.extend(["x" * 25] * 6)  # 150 characters: only what fits in 100 stays
    assert list(tail) == ["x" * 25] * 4 and sum(map(len, tail)) == 100
    tail.extend(["y" * 1000])  # cut to its head; always the newest line
    (last,) = list(tail)[-1:]
    assert last.startswith("y" * 30 + " \u2026[cut 970 bytes]")
    assert sum(map(len, tail)) <= 100


def test_rank_tails_hold_a_bounded_size_whatever_the_lines() -> None:
    c = collector()
    c.on_hello(peer(1, 0))
    c.on_hello(peer(2, 1))
    huge = "z" * (1 << 20)
    for _ in range(50):  # 50 MiB of 1 MiB lines, and many short ones
        c.on_frame(peer(1, 0), messages.STDOUT, huge.encode())
    c.on_frame(peer(2, 1), messages.STDERR, "\n".join(["short"] * 1000).encode())
    rank0, rank1 = c.ranks.states[0].tail, c.ranks.states[1].tail
    assert sum(map(len, rank0)) <= TAIL_CHARS and len(rank1) == TAIL_LINES
    assert all(len(line) < TAIL_LINE_CHARS + 40 for line in rank0)
    assert "[cut " in c.outputs()[0]
    assert len(c.failures()) == 0


# -- metrics ---------------------------------------------------------------------------------
def test_metrics_keep_the_latest_records_up_to_the_bound_and_warn_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert MAX_METRIC_RECORDS == 100_000
    seen: list[MetricRecord] = []
    c = collector(on_metrics=seen.append, max_metric_records=5)
    c.on_hello(peer(1, 0, role="worker"))
    with caplog.at_level(logging.WARNING, logger="test.limits"):
        for step in range(12):
            report = json.dumps({"step": step, "time": 0.0, "values": {"loss": step}})
            c.on_frame(peer(1, 0, role="worker"), messages.METRIC, report.encode())
    assert [m.step for m in c.metrics.records] == [7, 8, 9, 10, 11]
    assert c.metrics.dropped == 7 and len(seen) == 12  # on_metrics saw every record
    warnings = [r for r in caplog.records if "metric records" in r.getMessage()]
    assert len(warnings) == 1 and "keeps the latest 5" in warnings[0].getMessage()


def test_the_summary_says_when_metrics_were_dropped() -> None:
    now = pendulum.now("UTC")
    result = RunResult(None, {0: 0}, {}, [], now, now, "local", 1, metrics_dropped=3)
    assert result.summary()["metrics_dropped"] == 3
    assert "metrics_dropped" not in RunResult(None, {}, {}, [], now, now, "local", 1).summary()


# -- rank 0's result -------------------------------------------------------------------------
def test_a_result_over_the_limit_is_refused_and_released_as_soon_as_it_passes() -> None:
    c = collector(max_result_bytes=100)
    worker = peer(1, 0, role="worker")
    c.on_hello(worker)
    c.on_frame(worker, messages.RESULT_CHUNK, b"x" * 60)
    assert c.status().refused is None
    c.on_frame(worker, messages.RESULT_CHUNK, b"x" * 60)
    refused = c.status().refused
    assert refused is not None and (refused.size, refused.limit, refused.exact) == (120, 100, False)
    assert c.result._chunks == []  # nothing of it is held any more
    for _ in range(10):  # the rest that is still on its way is not kept
        c.on_frame(worker, messages.RESULT_CHUNK, b"x" * 60)
    assert c.result._chunks == []
    c.on_frame(worker, messages.RESULT_END, b'{"size": 720}')
    refused = c.result.refused
    assert refused is not None and (refused.size, refused.exact) == (720, True)
    assert c.result.value is None
    assert "720 bytes" in str(refused) and "max_result_bytes=100" in str(refused)


def test_a_result_within_the_limit_arrives() -> None:
    c = collector(max_result_bytes=100)
    worker = peer(1, 0, role="worker")
    c.on_hello(worker)
    c.on_frame(worker, messages.RESULT_CHUNK, b"x" * 100)
    c.on_frame(worker, messages.RESULT_END, b'{"size": 100}')
    assert c.result.refused is None and c.result.value is not None
    assert c.result.value.size == 100


def test_result_too_large_names_size_limit_and_option_and_is_not_retryable() -> None:
    error = ResultTooLargeError(5 << 30, 1 << 30)
    text = str(error)
    assert "more than 5,368,709,120 bytes" in text and "max_result_bytes=1,073,741,824" in text
    assert "raise max_result_bytes" in text
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.size, copy.limit, copy.exact, str(copy)) == (error.size, error.limit, False, text)
    outcome = outcome_of(error)
    assert (outcome.status, outcome.retryable) == ("failed", False)


# -- options ---------------------------------------------------------------------------------
def test_max_result_bytes_defaults_to_1_gib_and_is_validated() -> None:
    assert LaunchSpec(use_gpu=False).max_result_bytes == DEFAULT_MAX_RESULT_BYTES == 1 << 30
    for bad in (0, -1, True, "1", 1.5):
        with pytest.raises(ConfigError) as info:
            LaunchSpec(use_gpu=False, max_result_bytes=bad)  # type: ignore[arg-type]
        assert info.value.argument == "max_result_bytes"


def test_local_mode_refuses_more_ranks_than_its_limit_naming_num_processes() -> None:
    from sparktorch_ops.distributor import TorchDistributor

    limit = LOCAL_PROCESSES_PER_CPU * (os.cpu_count() or 1)
    LaunchSpec(num_processes=limit, use_gpu=False)  # up to the limit: fine
    with pytest.raises(ConfigError, match="max_local_processes=") as info:
        TorchDistributor(num_processes=limit + 1, use_gpu=False)
    assert info.value.argument == "num_processes" and f"more than {limit}" in str(info.value)
    # The option raises (or lowers) it; barrier mode is bounded by the cluster's slots instead.
    LaunchSpec(num_processes=limit + 1, use_gpu=False, max_local_processes=limit + 1)
    LaunchSpec(num_processes=limit + 1, local_mode=False, use_gpu=False)
    with pytest.raises(ConfigError, match="max_local_processes=2") as info:
        LaunchSpec(num_processes=3, use_gpu=False, max_local_processes=2)
    assert info.value.argument == "num_processes"
    with pytest.raises(ConfigError) as info:
        LaunchSpec(use_gpu=False, max_local_processes=0)
    assert info.value.argument == "max_local_processes"


# -- truncation notes ------------------------------------------------------------------------
def test_incomplete_output_is_said_in_the_value_and_flagged() -> None:
    c = collector(script=True)
    c.on_hello(peer(1, 0))
    c.on_frame(peer(1, 0), messages.STDOUT, b"one\ntwo")
    assert c.stdout.text() == "one\ntwo\n" and not c.stdout.cut
    c.on_frame(peer(1, 0), messages.STDOUT, f"{OUTPUT_CUT_NOTE}: held open]".encode())
    assert c.stdout.cut
    c.stdout.mark_incomplete("a later reason is not kept")
    text = c.stdout.text()
    assert text.startswith("one\ntwo\n")
    assert text.endswith("[sparktorch_ops: output may be incomplete: rank 0's supervisor "
                         "stopped reading its output early]\n")  # fmt: skip


# -- the Spark side's errors -----------------------------------------------------------------
# What Spark 4.3 says (getMessage of the job's SparkException), as seen on local[2].
TASK_FAILED = """Job aborted due to stage failure: Could not recover from a failed barrier \
ResultStage. Most recent failure reason: Stage failed because barrier task ResultTask(0, 1) \
finished unsuccessfully.
org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] An exception was thrown from \
the Python worker: Traceback (most recent call last):
  File "/x/pyspark/worker.py", line 4327, in invoke_udf
    run_process()
  File "/x/sparktorch_ops/node/task.py", line 140, in _run_agent
    handle.write(source)
OSError: [Errno 28] No space left on device
 SQLSTATE: 38000
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException
\tat scala.Option.foreach(Option.scala:437)
Driver stacktrace:"""

KILLED = [
    "[SPARK_JOB_CANCELLED] Job 0 cancelled killed via the Web UI SQLSTATE: XXKDA",
    "[SPARK_JOB_CANCELLED] Job 1 cancelled because killed via the Web UI SQLSTATE: XXKDA",
    "[SPARK_JOB_CANCELLED] Job 2 cancelled as part of cancellation of all jobs SQLSTATE: XXKDA",
    "[SPARK_JOB_CANCELLED] Job 3 cancelled part of cancelled job group g1 SQLSTATE: XXKDA",
    "Job 4 cancelled part of cancelled job group g1",  # before error classes
]


def test_a_failed_task_is_summarised_with_its_python_exception() -> None:
    head, detail = _summarize(RuntimeError("unused"), TASK_FAILED)
    assert head.startswith("Job aborted due to stage failure: Could not recover")
    assert head.endswith("... OSError: [Errno 28] No space left on device")
    assert "node/task.py" in detail and "\tat " not in detail
    assert not _cancelled_by_spark(TASK_FAILED)


# A barrier task whose executor went away: the reason is on the line after the stage's.
EXECUTOR_LOST = """An error occurred while calling o95.collectToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from a \
failed barrier ResultStage. Most recent failure reason: Stage failed because barrier task \
ResultTask(12, 1) finished unsuccessfully.
ExecutorLostFailure (executor 1 exited caused by one of the running tasks) Reason: Worker lost
\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:3100)
Driver stacktrace:"""


def test_a_barrier_task_lost_with_its_executor_is_summarised_with_why_and_is_curable() -> None:
    head, _ = _summarize(RuntimeError("unused"), EXECUTOR_LOST)
    assert head.startswith("org.apache.spark.SparkException: Job aborted due to stage failure")
    assert head.endswith("finished unsuccessfully. ExecutorLostFailure (executor 1 exited "
                         "caused by one of the running tasks) Reason: Worker lost")  # fmt: skip
    # Only Spark knew: the task's node hung up after reporting its agent's exit.
    assert infrastructure_cause([], {}, {}, head) is not None


def test_spark_cancellations_are_recognised() -> None:
    assert all(_cancelled_by_spark(message) for message in KILLED)


def test_a_spark_job_killed_from_the_ui_is_a_cancellation_not_to_retry() -> None:
    error = SparkJobKilledError("the Spark job was killed: Job 0 cancelled killed via the Web UI")
    assert isinstance(error, TrainingCancelledError)
    outcome = outcome_of(error)
    assert (outcome.status, outcome.retryable, outcome.exit_status) == (
        "cancelled",
        False,
        EXIT_INTERRUPTED,
    )
    assert outcome_of(TrainingCancelledError("on_kill")).retryable  # the orchestrator's call
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is SparkJobKilledError and str(copy) == str(error)


# -- the CLI ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "argument"),
    [
        (["--num-processes", "0"], "num_processes"),
        (["--conf", "novalue"], "--conf"),
        (["--timeout", "-1"], "timeout"),
        (["--max-restarts", "-1"], "max_restarts"),
        (["--master", "bogus://x"], "spark_master"),
        (["--local-mode", "--num-processes", "3", "--max-local-processes", "2"], "num_processes"),
    ],
)
def test_the_cli_checks_its_arguments_before_spark_starts(
    tmp_path: Path, args: list[str], argument: str
) -> None:
    # pyspark cannot even be imported here: a check made after Spark started would crash
    # instead of exiting 2 with the argument's name.
    site = tmp_path / "blocked"
    site.mkdir()
    (site / "sitecustomize.py").write_text(blocker_source(INTEGRATIONS))
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    master = [] if "--master" in args else ["--master", "local[2]"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    probe = subprocess.run(
        [sys.executable, "-c", "import pyspark"], capture_output=True, text=True, env=env
    )
    assert probe.returncode != 0 and "pyspark is blocked" in probe.stderr  # the block holds
    proc = subprocess.run(
        [sys.executable, "-m", "sparktorch_ops.cli", "run", *master, *args, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert argument in proc.stderr and "blocked" not in proc.stderr, proc.stderr


def test_the_cli_refuses_a_missing_script_before_spark_starts(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sparktorch_ops.cli", "run", "--master", "local[2]",
         str(tmp_path / "missing.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2 and "missing.py" in proc.stderr, proc.stderr
