"""A session this library starts logs its JVM's console output at Spark's levels, not as raw
stderr (which Airflow's task supervisor records at ERROR); a line about a run's job goes to that
run's logger, every other line to ``sparktorch_ops.spark``. In a subprocess: it must start its
own JVM, and a test process has one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import logging, sys, threading, time

    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(levelname)s|%(name)s|%(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    from sparktorch_ops.spark.session import SparkSettings, get_session, jobs_of_run, stop_session

    handle = get_session(SparkSettings(master="local[2]"), logging.getLogger("the-app"))
    sc = handle.session.sparkContext
    probe = sc._jvm.org.apache.logging.log4j.LogManager.getLogger("sto.probe")
    probe.error("an error line")
    probe.warn("a warning line")

    def shout(rows):
        print("a python worker line", file=sys.stderr, flush=True)
        return rows

    sc.parallelize(range(4), 2).mapPartitions(shout).count()

    def fail(rows):
        raise ValueError("this task fails")

    both = threading.Barrier(2)

    def run(name):
        with jobs_of_run(handle.session, name, logging.getLogger(name)):
            both.wait()
            try:
                sc.parallelize([1], 1).mapPartitions(fail).count()
            except Exception:
                pass
            tracker = sc.statusTracker()
            stages = sorted(s for j in tracker.getJobIdsForGroup(name) for s in tracker.getJobInfo(j).stageIds)
            # Through logging: one write per line (a print's newline is a write of its own,
            # and the other thread's records land between).
            logging.getLogger("stages").info("%s %s", name, ",".join(map(str, stages)))

    threads = [threading.Thread(target=run, args=(name,)) for name in ("run-a", "run-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # A job of no run: its lines go to sparktorch_ops.spark.
    try:
        sc.parallelize([1], 1).mapPartitions(fail).count()
    except Exception:
        pass
    time.sleep(1)  # let the last JVM lines arrive before the JVM goes
    stop_session(handle)
    """
)


def test_jvm_output_goes_to_the_logger_of_the_run_whose_job_it_is() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    records = [line.split("|", 2) for line in proc.stdout.splitlines() if line.count("|") >= 2]
    default = [
        (level, message) for level, name, message in records if name == "sparktorch_ops.spark"
    ]
    # Lines of no run's job, at Spark's levels.
    assert ("ERROR", "spark probe: an error line") in default
    assert ("WARNING", "spark probe: a warning line") in default
    assert ("INFO", "spark jvm: a python worker line") in default
    stages = {
        message.split()[0]: message.split()[1].split(",")
        for _, name, message in records
        if name == "stages"
    }
    assert set(stages) == {"run-a", "run-b"} and all(stages.values()), stages
    for run, other in (("run-a", "run-b"), ("run-b", "run-a")):
        lines = [message for level, name, message in records if name == run]
        # The failed task's story (its error, then the lost task) reached this run's logger...
        assert any("this task fails" in line for line in lines), lines
        assert any(f"stage {stages[run][0]}." in line for line in lines), lines
        # ...and no line about the other run's stages.
        assert not any(f"stage {s}." in line for line in lines for s in stages[other]), lines
    # The job of no run was logged to the default logger, not to a run's.
    assert sum("this task fails" in message for _, message in default) >= 1, default
    # Nothing of the JVM reached raw stderr: no log4j line, no console progress bar.
    assert "WARN" not in proc.stderr and "INFO" not in proc.stderr, proc.stderr
    assert "[Stage" not in proc.stderr + proc.stdout
