"""Reading the Spark JVM's console lines into log levels (sparktorch_ops.spark.jvm_log.parse_line)."""

from __future__ import annotations

import logging
import time
import types
from typing import Any

import pytest

from sparktorch_ops.spark import jvm_log
from sparktorch_ops.spark.jvm_log import JvmLine, ids_in, parse_line
from tests.support.records import Collect, collecting_logger

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            "26/12/01 14:32:39 WARN Utils: Service 'SparkUI' could not bind on port 4040.",
            JvmLine(logging.WARNING, "Utils", "Service 'SparkUI' could not bind on port 4040."),
        ),
        (
            "26/12/01 14:32:40 INFO DAGScheduler: Job 0 finished: count",
            JvmLine(logging.INFO, "DAGScheduler", "Job 0 finished: count"),
        ),
        (
            "26/12/01 14:32:41 ERROR Executor: Exception in task 0.0",
            JvmLine(logging.ERROR, "Executor", "Exception in task 0.0"),
        ),
        (
            "26/12/01 14:32:41 FATAL SparkContext: gone",
            JvmLine(logging.CRITICAL, "SparkContext", "gone"),
        ),
        ("26/12/01 14:32:41 DEBUG Utils: x", JvmLine(logging.DEBUG, "Utils", "x")),
        (
            "WARNING: package sun.misc not in java.base",
            JvmLine(logging.WARNING, "jvm", "package sun.misc not in java.base"),
        ),
        # What every Spark JVM warns of as it starts, whatever it runs: INFO.
        (
            "WARNING: Using incubator modules: jdk.incubator.vector",
            JvmLine(logging.INFO, "jvm", "Using incubator modules: jdk.incubator.vector"),
        ),
        (
            "26/12/01 14:32:39 WARN NativeCodeLoader: Unable to load native-hadoop library",
            JvmLine(logging.INFO, "NativeCodeLoader", "Unable to load native-hadoop library"),
        ),
        (
            'Setting default log level to "WARN".',
            JvmLine(logging.INFO, "jvm", 'Setting default log level to "WARN".'),
        ),
        ("[Stage 0:>   (0 + 2) / 2]", JvmLine(logging.INFO, "jvm", "[Stage 0:>   (0 + 2) / 2]")),
    ],
)
def test_a_line_keeps_the_level_spark_gave_it_but_start_up_notices(line: str, expected: JvmLine) -> None:
    assert parse_line(line) == expected


def test_a_stack_trace_continues_the_record_above_it() -> None:
    error = parse_line("26/12/01 14:32:41 ERROR Executor: Exception in task 0.0")
    for line in ("\tat org.apache.spark.Foo(Foo.scala:1)", "Caused by: java.io.IOException: x"):
        assert parse_line(line, error) == JvmLine(logging.ERROR, "Executor", line)
    # Without a record above, an indented line is plain output.
    assert parse_line("\tat x").level == logging.INFO
    # A new unindented line does not continue anything.
    assert parse_line("hello", error) == JvmLine(logging.INFO, "jvm", "hello")


def test_the_stage_and_job_ids_a_spark_line_names() -> None:
    assert ids_in("Lost task 0.0 in stage 3.0 (TID 5) (127.0.0.1 executor driver)") == ({3}, set())
    assert ids_in("Job 7 finished: collect at x.py:1, took 0.2 s") == (set(), {7})
    assert ids_in("Got job 4 (collect) with 2 output partitions") == (set(), {4})
    assert ids_in("Final stage: ResultStage 9 (collect at x.py:1)") == ({9}, set())
    assert ids_in("Task 6 from Stage 11(Attempt 0) has entered the global sync") == ({11}, set())
    assert ids_in("Using incubator modules: jdk.incubator.vector") == (set(), set())


class FakeTracker:
    """What the router asks of Spark's status tracker: a run's jobs and their stages."""

    def __init__(self, jobs: dict[str, dict[int, list[int]]]) -> None:
        self.jobs = jobs

    def getJobIdsForGroup(self, group: str) -> list[int]:
        return list(self.jobs.get(group, {}))

    def getJobInfo(self, job: int) -> Any:
        for jobs in self.jobs.values():
            if job in jobs:
                return types.SimpleNamespace(stageIds=jobs[job])
        return None


def test_a_line_goes_to_the_run_whose_stage_it_names_and_the_rest_to_the_default() -> None:
    router = jvm_log._Router()
    tracker = FakeTracker({"run-a": {1: [10, 11]}, "run-b": {2: [20]}})
    collected: dict[str, Collect] = {}
    for name in ("run-a", "run-b"):
        logger, collected[name] = collecting_logger(f"tests.jvm_log.{name}")
        router.attach(name, logger, tracker)
    default = Collect()
    jvm_log.DEFAULT_LOGGER.addHandler(default)
    try:
        lines = [
            (
                "stderr",
                "26/12/01 14:32:41 WARN TaskSetManager: Lost task 0.0 in stage 11.0 (TID 3)",
            ),
            ("stderr", "org.apache.spark.api.python.PythonException: Traceback:"),
            ("stderr", "ValueError: boom"),
            (
                "stderr",
                "26/12/01 14:32:41 WARN TaskSetManager: Lost task 0.0 in stage 20.0 (TID 4)",
            ),
            (
                "stderr",
                "26/12/01 14:32:41 WARN TaskSetManager: Lost task 0.0 in stage 30.0 (TID 5)",
            ),
            ("stderr", "26/12/01 14:32:41 WARN Utils: no ids here"),
        ]
        previous = None
        for stream, text in lines:
            follows = previous is not None and jvm_log._LOG4J_LINE.match(text) is None
            previous = parse_line(text, previous)
            router.submit(stream, previous, follows)
        deadline = time.monotonic() + 10
        while len(default.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        jvm_log.DEFAULT_LOGGER.removeHandler(default)
    assert [m.split(": ", 1)[1] for m in collected["run-a"].messages()] == [
        "Lost task 0.0 in stage 11.0 (TID 3)",
        "org.apache.spark.api.python.PythonException: Traceback:",
        "ValueError: boom",
    ]
    assert collected["run-b"].messages() == [
        "spark TaskSetManager: Lost task 0.0 in stage 20.0 (TID 4)"
    ]
    # Stage 30 is no run's (the router asked Spark, in vain); a line without ids is no run's.
    assert [m.split(": ", 1)[1] for m in default.messages()] == [
        "Lost task 0.0 in stage 30.0 (TID 5)",
        "no ids here",
    ]
