"""The Spark JVM's console output, as Python log records at the level Spark gave them.

A JVM that pyspark starts inherits the process's stdout and stderr, so Spark's log4j lines, the
JVM's own warnings and anything a Python worker prints reach the terminal raw. An orchestrator
reads raw stderr as errors: Airflow's task supervisor logs every stderr line of a task at ERROR,
so a successful run showed red lines in the UI. A JVM started by :func:`launch_gateway` instead
writes into pipes; a reader thread per pipe turns each line into a record of the logger the
current run gave (:func:`route_to`), at the level in Spark's log line.

Parsing is pure (:func:`parse_line`); the acting part is the gateway launch and the two pump
threads, which live as long as the JVM.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, Any

#: Where JVM lines go when no run routed them (before the first run, after a session stops).
DEFAULT_LOGGER = logging.getLogger("sparktorch_ops.spark")

# Spark's default log4j2 layout: "%d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex".
_LOG4J_LINE = re.compile(
    r"^\d{2}/\d{2}/\d{2} \d{2}:\d{2}:\d{2} (TRACE|DEBUG|INFO|WARN|ERROR|FATAL) ([^\s:]+): ?(.*)$"
)
_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}
# A stack trace under a log4j record: "\tat ...", "Caused by: ...", "\t... 12 more".
_CONTINUATION = re.compile(r"^(\s+\S|Caused by: |Suppressed: )")


@dataclass(frozen=True)
class JvmLine:
    """One line of JVM output, read.

    Attributes:
        level: the ``logging`` level to log it at.
        source: the log4j logger (short name), or ``jvm`` for a line log4j did not write.
        message: the text.
    """

    level: int
    source: str
    message: str


def parse_line(line: str, previous: JvmLine | None = None) -> JvmLine:
    """Read one line of JVM output.

    A log4j line keeps its level and logger. A stack-trace line continues the record before it
    (same level). The JVM's own ``WARNING:`` lines are warnings. Anything else (Spark's hints
    printed outside log4j, a Python worker's prints) is INFO: it is output, not a failure, and
    a real failure reaches the run as an exception.
    """
    match = _LOG4J_LINE.match(line)
    if match:
        level, source, message = match.groups()
        return JvmLine(_LEVELS[level], source, message)
    if previous is not None and _CONTINUATION.match(line):
        return JvmLine(previous.level, previous.source, line)
    if line.startswith("WARNING:"):
        return JvmLine(logging.WARNING, "jvm", line[len("WARNING:") :].strip())
    return JvmLine(logging.INFO, "jvm", line)


class _Route:
    """The logger JVM lines go to now (one JVM per process, runs come and go)."""

    def __init__(self) -> None:
        self.logger: Any = DEFAULT_LOGGER
        self.lock = threading.Lock()


_ROUTE = _Route()


def route_to(logger: Any | None) -> None:
    """Send JVM lines from now on to ``logger`` (a ``logging.Logger`` or adapter, such as the
    Airflow task's ``self.log`` or Prefect's run logger); None: back to :data:`DEFAULT_LOGGER`."""
    with _ROUTE.lock:
        _ROUTE.logger = logger if logger is not None else DEFAULT_LOGGER


def _pump(stream: IO[bytes]) -> None:
    """Log every line of ``stream`` until the JVM closes it."""
    previous: JvmLine | None = None
    for raw in _lines(stream):
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        # A redrawn console line ("\r[Stage 0:>  (0 + 2) / 2]"): keep its last state.
        text = text.rsplit("\r", 1)[-1]
        if not text.strip():
            continue
        previous = parse_line(text, previous)
        with _ROUTE.lock:
            logger = _ROUTE.logger
        try:
            logger.log(previous.level, "spark %s: %s", previous.source, previous.message)
        except Exception:  # a logger that fails must not stop the pipe (the JVM would block)
            pass


def _lines(stream: IO[bytes]) -> Iterable[bytes]:
    try:
        yield from iter(stream.readline, b"")
    except (OSError, ValueError):  # closed under us at interpreter exit
        return


def launch_gateway(conf_pairs: Iterable[tuple[str, str]]) -> Any:
    """Start pyspark's JVM gateway with its stdout and stderr piped into the log.

    Args:
        conf_pairs: the settings ``SparkSession.builder`` would pass (they reach
            ``spark-submit`` as ``--conf``: driver memory and Java options apply).

    Returns:
        The py4j gateway, for ``SparkContext._ensure_initialized(gateway=...)``.
    """
    from subprocess import PIPE

    from pyspark import SparkConf
    from pyspark.java_gateway import launch_gateway as pyspark_launch_gateway

    conf = SparkConf(loadDefaults=False)
    for key, value in conf_pairs:
        conf.set(key, value)
    gateway = pyspark_launch_gateway(conf, popen_kwargs={"stdout": PIPE, "stderr": PIPE})
    for name, stream in (("stdout", gateway.proc.stdout), ("stderr", gateway.proc.stderr)):
        threading.Thread(
            target=_pump, args=(stream,), name=f"sparktorch-jvm-{name}", daemon=True
        ).start()
    return gateway
