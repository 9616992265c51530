"""The Spark JVM's console output, as Python log records at the level Spark gave them.

A JVM that pyspark starts inherits the process's stdout and stderr, so Spark's log4j lines, the
JVM's own warnings and anything a Python worker prints reach the terminal raw. An orchestrator
reads raw stderr as errors: Airflow's task supervisor logs every stderr line of a task at ERROR,
so a successful run showed red lines in the UI. A JVM started by :func:`launch_gateway` instead
writes into pipes; a reader thread per pipe turns each line into a log record at the level in
Spark's log line.

Several runs may share the JVM at once (runs from threads of one process). A line that names a
stage or a job of a run (its job group is the run id: :func:`attach`) goes to that run's
logger; every other line goes to :data:`DEFAULT_LOGGER`. Which run a stage belongs to is asked
of Spark's status tracker, on a thread of its own: the readers never wait on the JVM they
drain.

Parsing is pure (:func:`parse_line`, :func:`ids_in`); the acting part is the gateway launch,
the two reader threads and the dispatcher, which live as long as the JVM.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, Any

#: Where JVM lines go that belong to no run in progress.
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
# Warnings every JVM of a pip-installed Spark prints as it starts, whatever runs on it: the
# module Spark enables itself, Hadoop's pure-Java fallback. Nothing for the user to act on, so
# they are INFO (source, start of the message).
_START_UP_NOTICES = (
    ("jvm", "Using incubator modules:"),
    ("NativeCodeLoader", "Unable to load native-hadoop library"),
)


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
    a real failure reaches the run as an exception. The start-up notices every Spark JVM prints
    (an incubator module, no native Hadoop library) are INFO.
    """
    match = _LOG4J_LINE.match(line)
    if match:
        level, source, message = match.groups()
        return _demoted(JvmLine(_LEVELS[level], source, message))
    if previous is not None and _CONTINUATION.match(line):
        return JvmLine(previous.level, previous.source, line)
    if line.startswith("WARNING:"):
        return _demoted(JvmLine(logging.WARNING, "jvm", line[len("WARNING:") :].strip()))
    return JvmLine(logging.INFO, "jvm", line)


def _demoted(line: JvmLine) -> JvmLine:
    if line.level == logging.WARNING and any(
        line.source == source and line.message.startswith(start)
        for source, start in _START_UP_NOTICES
    ):
        return JvmLine(logging.INFO, line.source, line.message)
    return line


# "stage 3.0", "Stage 3(Attempt 0)", "ResultStage 3", "ShuffleMapStage 3"; "Job 3", "job 3".
_STAGE = re.compile(r"(?:\b[Ss]tage|ResultStage|ShuffleMapStage) (\d+)")
_JOB = re.compile(r"\b[Jj]ob (\d+)")
_QUEUE_LINES = 10_000  # lines waiting for the dispatcher; beyond, they skip attribution
_ASK_TIMES = 3  # how often Spark is asked whose an unknown id is, _ASK_PAUSE_S apart
_ASK_PAUSE_S = 0.1
_LINGER_S = 3.0  # a run's lines read this long after it ended still go to its logger


def ids_in(message: str) -> tuple[set[int], set[int]]:
    """The stage ids and job ids a Spark log message names."""
    stages = {int(match) for match in _STAGE.findall(message)}
    jobs = {int(match) for match in _JOB.findall(message)}
    return stages, jobs


class _Run:
    def __init__(self, logger: Any, tracker: Any) -> None:
        self.logger = logger
        self.tracker = tracker  # the session's StatusTracker
        self.stages: set[int] = set()
        self.jobs: set[int] = set()
        self.ended: float | None = None  # when the run detached

    def owns(self, read_at: float) -> bool:
        return self.ended is None or read_at <= self.ended + _LINGER_S


class _Router:
    """The runs in progress and the dispatcher thread that logs each line to its owner."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._runs: dict[str, _Run] = {}
        # (stream, line, whether it belongs with the stream's record above, when it was read)
        self._queue: deque[tuple[str, JvmLine, bool, float]] = deque()
        self._last_owner: dict[str, Any] = {}
        self._foreign: set[tuple[str, int]] = set()  # ("stage"|"job", id) of no run
        self._thread: threading.Thread | None = None

    def attach(self, run_id: str, logger: Any, tracker: Any) -> None:
        with self._lock:
            self._runs[run_id] = _Run(logger, tracker)

    def detach(self, run_id: str) -> None:
        with self._lock:
            run = self._runs.get(run_id)
            if run is not None:
                run.ended = time.monotonic()
            now = time.monotonic()
            for key in [k for k, r in self._runs.items() if not r.owns(now - _LINGER_S)]:
                del self._runs[key]  # ended long enough ago that no line of theirs is queued

    def submit(self, stream: str, line: JvmLine, follows: bool) -> None:
        """From a reader thread: never blocks on the JVM or on a logger's lock."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._dispatch, name="sparktorch-jvm-log", daemon=True
                )
                self._thread.start()
            if len(self._queue) < _QUEUE_LINES:
                self._queue.append((stream, line, follows, time.monotonic()))
                self._lock.notify()
                return
        _log(DEFAULT_LOGGER, line)

    def _dispatch(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                stream, line, follows, read_at = self._queue.popleft()
            owner = self._last_owner.get(stream) if follows else None
            if owner is None:
                owner = self._owner(line, read_at)
            self._last_owner[stream] = owner
            _log(owner, line)

    def _owner(self, line: JvmLine, read_at: float) -> Any:
        stages, jobs = ids_in(line.message)
        wanted = {("stage", i) for i in stages} | {("job", i) for i in jobs}
        for attempt in range(_ASK_TIMES + 1):
            with self._lock:
                for run in self._runs.values():
                    if (stages & run.stages or jobs & run.jobs) and run.owns(read_at):
                        return run.logger
                runs = [(key, run) for key, run in self._runs.items() if run.owns(read_at)]
                if not runs or not wanted - self._foreign:
                    return DEFAULT_LOGGER
                if attempt == _ASK_TIMES:  # not a run's, for good: ids are never reused
                    if len(self._foreign) > _QUEUE_LINES:
                        self._foreign.clear()
                    self._foreign |= wanted
                    return DEFAULT_LOGGER
            if attempt:
                time.sleep(_ASK_PAUSE_S)  # Spark's status store lags its scheduler a little
            for run_id, run in runs:
                _learn(run_id, run)
        return DEFAULT_LOGGER


def _learn(run_id: str, run: _Run) -> None:
    """Ask Spark which jobs (and their stages) the run's job group has had so far."""
    try:
        for job in run.tracker.getJobIdsForGroup(run_id):
            run.jobs.add(int(job))
            info = run.tracker.getJobInfo(job)
            if info is not None:
                run.stages.update(int(stage) for stage in info.stageIds)
    except Exception:  # the session may be stopping: the line goes to the default logger
        pass


def _log(logger: Any, line: JvmLine) -> None:
    try:
        logger.log(line.level, "spark %s: %s", line.source, line.message)
    except Exception:  # a logger that fails must not stop the dispatcher
        pass


_ROUTER = _Router()


def attach(run_id: str, logger: Any, tracker: Any) -> None:
    """Send the lines of the jobs in job group ``run_id`` to ``logger`` (a ``logging.Logger``
    or adapter, such as the Airflow task's ``self.log`` or Prefect's run logger) until
    :func:`detach`; ``tracker``: the session's ``statusTracker()``."""
    _ROUTER.attach(run_id, logger, tracker)


def detach(run_id: str) -> None:
    """The run is over: its lines go to :data:`DEFAULT_LOGGER` from now on (those read in
    the next few seconds still go to its logger: Spark logs a job's end after it returned)."""
    _ROUTER.detach(run_id)


def _pump(name: str, stream: IO[bytes]) -> None:
    """Read every line of ``stream`` until the JVM closes it, for the dispatcher."""
    previous: JvmLine | None = None
    for raw in _lines(stream):
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        # A redrawn console line ("\r[Stage 0:>  (0 + 2) / 2]"): keep its last state.
        text = text.rsplit("\r", 1)[-1]
        if not text.strip():
            continue
        # Any line that is not a log4j record of its own belongs with the record above: a Java
        # stack trace, the Python traceback inside a task's exception.
        follows = previous is not None and _LOG4J_LINE.match(text) is None
        previous = parse_line(text, previous)
        _ROUTER.submit(name, previous, follows)


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
            target=_pump, args=(name, stream), name=f"sparktorch-jvm-{name}", daemon=True
        ).start()
    return gateway
