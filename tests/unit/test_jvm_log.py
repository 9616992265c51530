"""Reading the Spark JVM's console lines into log levels (sparktorch_ops.spark.jvm_log.parse_line)."""

from __future__ import annotations

import logging

import pytest

from sparktorch_ops.spark.jvm_log import JvmLine, parse_line

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            "26/12/01 14:32:39 WARN NativeCodeLoader: Unable to load native-hadoop library",
            JvmLine(logging.WARNING, "NativeCodeLoader", "Unable to load native-hadoop library"),
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
            "WARNING: Using incubator modules: jdk.incubator.vector",
            JvmLine(logging.WARNING, "jvm", "Using incubator modules: jdk.incubator.vector"),
        ),
        (
            'Setting default log level to "WARN".',
            JvmLine(logging.INFO, "jvm", 'Setting default log level to "WARN".'),
        ),
        ("[Stage 0:>   (0 + 2) / 2]", JvmLine(logging.INFO, "jvm", "[Stage 0:>   (0 + 2) / 2]")),
    ],
)
def test_a_line_keeps_the_level_spark_gave_it(line: str, expected: JvmLine) -> None:
    assert parse_line(line) == expected


def test_a_stack_trace_continues_the_record_above_it() -> None:
    error = parse_line("26/12/01 14:32:41 ERROR Executor: Exception in task 0.0")
    for line in ("\tat org.apache.spark.Foo(Foo.scala:1)", "Caused by: java.io.IOException: x"):
        assert parse_line(line, error) == JvmLine(logging.ERROR, "Executor", line)
    # Without a record above, an indented line is plain output.
    assert parse_line("\tat x").level == logging.INFO
    # A new unindented line does not continue anything.
    assert parse_line("hello", error) == JvmLine(logging.INFO, "jvm", "hello")
