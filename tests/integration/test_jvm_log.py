"""A session this library starts logs its JVM's console output at Spark's levels, not as raw
stderr (which Airflow's task supervisor records at ERROR). In a subprocess: it must start its
own JVM, and a test process has one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import logging, sys

    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(levelname)s|%(name)s|%(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    from sparktorch_ops.spark import jvm_log
    from sparktorch_ops.spark.session import SparkSettings, get_session, stop_session

    handle = get_session(SparkSettings(master="local[2]"), logging.getLogger("the-run"))
    sc = handle.session.sparkContext
    probe = sc._jvm.org.apache.logging.log4j.LogManager.getLogger("sto.probe")
    probe.error("an error line")
    probe.warn("a warning line")

    def shout(rows):
        print("a python worker line", file=sys.stderr, flush=True)
        return rows

    sc.parallelize(range(4), 2).mapPartitions(shout).count()
    stop_session(handle)
    print("route after stop:", jvm_log._ROUTE.logger.name, flush=True)
    """
)


def test_jvm_output_becomes_records_of_the_runs_logger_at_sparks_levels() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    records = [line.split("|", 2) for line in proc.stdout.splitlines() if line.count("|") >= 2]
    jvm = [(level, message) for level, name, message in records if name == "the-run"]
    assert ("ERROR", "spark probe: an error line") in jvm
    assert ("WARNING", "spark probe: a warning line") in jvm
    assert ("INFO", "spark jvm: a python worker line") in jvm
    # Nothing of the JVM reached raw stderr: no log4j line, no console progress bar.
    assert "WARN" not in proc.stderr and "INFO" not in proc.stderr, proc.stderr
    assert "[Stage" not in proc.stderr + proc.stdout
    assert "route after stop: sparktorch_ops.spark" in proc.stdout
