"""Submitting a detached run: its directory, then its driver in a process of its own.

:func:`submit_job` writes the job into the run directory and starts
``python -m sparktorch_ops.detached.main RUN_DIR`` in a new session, so the training goes on
when the submitting process ends (a worker slot freed, a notebook closed, a task process
killed). A run directory that already holds the same training is reattached to instead: a
live or finished run is not trained twice; a lost or failed one gets a new driver, which
resumes from the training's checkpoints, and so does one being stopped (a cleared task's),
once it has ended.

Where Spark runs Python drivers on the cluster (YARN and Kubernetes, ``--deploy-mode
cluster``), :func:`cluster_command` gives the ``spark-submit`` command that runs the same
driver there (``sparktorch-ops submit --deploy-mode cluster --dry-run`` prints it; Spark has no
cluster mode for Python applications on a standalone master).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sparktorch_ops.detached.handle import RunHandle
from sparktorch_ops.detached.main import DetachedJob
from sparktorch_ops.detached.rundir import FINAL_STATES, RunDirectory, RunDirectoryError
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.events import RunState
from sparktorch_ops.job import TrainingJob
from sparktorch_ops.results import MetricRecord
from sparktorch_ops.spark.dataframe import DataInput
from sparktorch_ops.spark.session import SparkSettings
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire.channel import backoff
from sparktorch_ops.wire.env import RUNS_ENV

#: Seconds a submit waits for a run asked to stop (a cleared task's) to end before starting
#: its training over.
STOPPING_WAIT_S = 120.0
_CALLBACKS = ("logger", "on_metrics", "on_event")
# A session's settings that belong to that application alone, not to a new one like it.
_APPLICATION_CONF = (
    "spark.app.id",
    "spark.app.name",
    "spark.app.startTime",
    "spark.app.submitTime",
    "spark.driver.port",
    "spark.executor.id",
    "spark.driver.appUIAddress",
    "spark.ui.proxyBase",
    "spark.sql.warehouse.dir",
    "spark.submit.pyFiles",
    "spark.files",
    "spark.repl.local.jars",
)


def runs_root() -> Path:
    """The directory that holds detached runs by default: ``$SPARKTORCH_RUNS``, else
    ``~/.local/state/sparktorch_ops/runs``."""
    configured = os.environ.get(RUNS_ENV, "").strip()
    if configured:
        return Path(configured)
    return Path.home() / ".local" / "state" / "sparktorch_ops" / "runs"


def new_training_id() -> str:
    """A fresh training id."""
    return f"training-{uuid.uuid4().hex[:16]}"


def settings_of(session: Any) -> SparkSettings:
    """The settings that make another application like ``session``'s (its master and the
    settings it was given), for a detached driver of its own."""
    from sparktorch_ops.spark.session import connect_endpoint, is_connect_session

    if is_connect_session(session):
        host, port = connect_endpoint(session)
        return SparkSettings(master=f"sc://{host}:{port}")
    sc = session.sparkContext
    conf = {k: v for k, v in sc.getConf().getAll() if k not in _APPLICATION_CONF}
    conf.pop("spark.master", None)
    return SparkSettings(master=sc.master, conf=conf)


def detached_job(job: TrainingJob, spark: SparkSettings | None, input_at: str) -> DetachedJob:
    """``job`` as ``job.pkl`` holds it. A DataFrame input is read by the detached driver's own
    session from ``input_at``, where :func:`write_input` puts it."""
    options = {
        f: getattr(job.options, f) for f in LaunchSpec.__dataclass_fields__ if f not in _CALLBACKS
    }
    options["detached"] = False  # its driver runs it in place
    if job.options.training is not None:
        # The callback saves into the orchestrator's store, which only the submitting process
        # reaches; the run's MLflow run id comes back in its result instead.
        options["training"] = dataclasses.replace(job.options.training, on_mlflow_run=None)
    data = job.data
    if data is not None and data.dataframe is not None:
        data = DataInput(path=input_at)
    settings = None
    if spark is not None and not job.options.local_mode:
        settings = {"master": spark.master, "conf": dict(spark.conf), "app_name": spark.app_name}
    return DetachedJob(job.payload, options, settings, data)


def write_input(job: TrainingJob, directory: RunDirectory) -> None:
    """Write ``job``'s DataFrame input (if any) into the new run's directory, as Parquet; a
    failure removes the directory (the run never started) and is raised."""
    if job.data is None or job.data.dataframe is None:
        return
    try:
        job.data.dataframe.write.mode("overwrite").parquet(directory.child("input"))
    except BaseException:
        directory.remove()
        raise


def submit_job(
    job: TrainingJob,
    spark: SparkSettings | None,
    *,
    run_dir: str | None = None,
    training_id: str | None = None,
    log: Any = None,
) -> RunHandle:
    """Start ``job`` detached (or reattach to the run of its training); its handle at once.

    Args:
        job: the job, as a run would take it.
        spark: the settings of the detached driver's own session (barrier mode).
        run_dir: the run's directory (default: ``runs_root()/<training id>``).
        training_id: the training (default: a new one; the run directory's, when it holds
            one).
        log: where the line saying what happened goes.

    Raises:
        RunDirectoryError: ``run_dir`` holds another training, or is not usable.
    """
    log = log or logging.getLogger("sparktorch_ops")
    location = run_dir or str(runs_root() / (training_id or new_training_id()))
    directory = RunDirectory(location)
    if _holds_run(directory):
        identity = directory.identity()
        if training_id is not None and identity["training_id"] != training_id:
            raise RunDirectoryError(
                directory.location,
                f"holds the training {identity['training_id']}, not {training_id}: give each "
                "training a directory of its own",
            )
        handle = RunHandle(directory.location)
        state = _state_once_stopped(handle, directory)
        if state == RunState.SUCCEEDED.value or state not in FINAL_STATES:
            log.info(
                "sparktorch_ops: the training %s is already %s in %s: reattached, not "
                "submitted again",
                handle.training_id,
                state,
                directory.location,
            )
            return handle
        _start_over(directory)
    else:
        stored = detached_job(job, spark, directory.child("input"))
        identity = {"training_id": training_id or new_training_id(), "mode": job.options.mode}
        directory.create(identity, pickle.dumps(stored))
        write_input(job, directory)
    _start_driver(directory)
    handle = RunHandle(directory.location)
    log.info(
        "sparktorch_ops: submitted the training %s, detached: %s",
        handle.training_id,
        directory.location,
    )
    return handle


def _state_once_stopped(handle: RunHandle, directory: RunDirectory) -> str:
    """The run's state; a run asked to stop (a cleared task's) is waited for first, so that
    its training starts over instead of being reattached to as it ends."""
    state = handle.status().state
    deadline = time.monotonic() + STOPPING_WAIT_S
    while state not in FINAL_STATES and directory.cancel_requested() is not None:
        if time.monotonic() >= deadline:
            raise RunDirectoryError(
                directory.location,
                f"holds a run asked to stop that is still {state} after "
                f"{STOPPING_WAIT_S:.0f} s: see `sparktorch-ops status {directory.location}`",
            )
        time.sleep(0.2)
        state = handle.status().state
    return state


def _holds_run(directory: RunDirectory) -> bool:
    try:
        directory.identity()
    except RunDirectoryError as exc:
        if "does not exist" in exc.problem or "no run.json" in exc.problem:
            return False
        raise
    return True


def _start_over(directory: RunDirectory) -> None:
    """A lost or failed run of this training: its end and any cancel request go, its
    streams stay (the new driver's chunks follow them)."""
    if directory.is_url:
        raise ConfigError(
            "run_dir",
            f"{directory.location} holds an ended run; restarting one on an object store "
            "is not supported: give a new run_dir (the checkpoints carry the training on)",
        )
    for name in ("result.json", "value.pkl", "error.pkl", "cancel", "status.json"):
        Path(directory.location, name).unlink(missing_ok=True)


def driver_argv(run_dir: str) -> list[str]:
    """The detached driver's command line."""
    return [sys.executable, "-m", "sparktorch_ops.detached.main", run_dir]


def _start_driver(directory: RunDirectory) -> None:
    """The detached driver, in a new session (no signal of this process's group reaches it),
    importing this process's sparktorch_ops."""
    package_root = str(Path(__file__).resolve().parents[2])  # the folder holding sparktorch_ops/
    paths = [package_root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    with contextlib.ExitStack() as stack:
        out: Any = subprocess.DEVNULL
        if not directory.is_url:
            out = stack.enter_context(Path(directory.location, "driver.out").open("ab"))
        process = subprocess.Popen(
            driver_argv(directory.location),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    # Reaped when it ends, while this process lives (no zombie); it outlives this process.
    threading.Thread(target=process.wait, name="sparktorch-detached-reaper", daemon=True).start()


def cluster_submit_argv(
    run_dir: str, master: str, conf: Mapping[str, str], package_zip: str
) -> list[str]:
    """``spark-submit --deploy-mode cluster`` running a run's detached driver on the cluster
    (YARN or Kubernetes: Spark runs Python drivers in cluster mode only there).

    The run directory must be on storage the cluster reaches (HDFS, an object store): the
    driver reads its job there and writes everything back there; ``package_zip`` is this
    sparktorch_ops, shipped with ``--py-files``.

    Raises:
        ConfigError: a master where Spark has no Python cluster mode (local, standalone).
    """
    _check_cluster_mode(run_dir, master)
    argv = ["spark-submit", "--master", master, "--deploy-mode", "cluster"]
    for key, value in sorted(conf.items()):
        argv += ["--conf", f"{key}={value}"]
    driver = str(Path(__file__).with_name("main.py"))
    return [*argv, "--py-files", package_zip, driver, run_dir]


def cluster_command(job: TrainingJob) -> list[str]:
    """The ``spark-submit`` command that runs ``job``'s detached driver on the cluster, from
    the job's master, Spark conf and ``run_dir``, with this sparktorch_ops zipped for it into
    a new directory that stays for that command.

    Raises:
        ConfigError: no YARN or Kubernetes master, or a run directory the cluster cannot
            reach (checked before anything is written).
    """
    from sparktorch_ops.spark.shipping import build_zip

    run_dir, master = str(job.options.run_dir or runs_root()), job.spark.master or "no master"
    _check_cluster_mode(run_dir, master)
    package = build_zip(
        str(Path(__file__).resolve().parents[1]), tempfile.mkdtemp(prefix="sparktorch_ops-")
    )
    return cluster_submit_argv(run_dir, master, job.spark.conf, package)


def _check_cluster_mode(run_dir: str, master: str) -> None:
    if not master.startswith(("yarn", "k8s://")):
        raise ConfigError(
            "spark_master",
            f"{master}: Spark runs Python drivers in cluster deploy mode on YARN and "
            "Kubernetes only; on this master the detached driver runs on this machine",
        )
    if "://" not in run_dir:
        raise ConfigError(
            "run_dir",
            f"{run_dir} is a local path: a driver on the cluster needs the run directory on "
            "storage it reaches (hdfs://, s3a://, gs://, ...)",
        )


def spark_settings(job: TrainingJob) -> SparkSettings | None:
    """The settings of a detached driver's own session: those of the job's session (or the
    active one), else the job's master and conf; None in local mode."""
    from sparktorch_ops.spark.session import active_session

    if job.options.local_mode:
        return None
    session = job.spark.session
    if session is None and not job.spark.configured:
        session = active_session()
    return settings_of(session) if session is not None else job.spark


def submit(job: TrainingJob) -> RunHandle:
    """Submit ``job`` detached, in its ``run_dir`` (see :func:`submit_job`)."""
    training = job.options.training
    return submit_job(
        job,
        spark_settings(job),
        run_dir=job.options.run_dir,
        training_id=training.training_id if training is not None else None,
        log=job.options.logger,
    )


def launch_detached(job: TrainingJob) -> Any:
    """Submit ``job`` detached and wait for it, forwarding its lines to the job's logger and
    its records to ``on_metrics`` as they come; a cancel of the job cancels the run.

    Returns:
        Its RunResult. Raises what the run raised.
    """
    handle = submit(job)
    try:
        return _follow(job, handle)
    except BaseException:
        # The caller stopped waiting (Ctrl-C, an orchestrator's timeout or cancel): the run
        # stops too, as an attached one would. Only a caller that dies outright (SIGKILL, a
        # lost machine) leaves it running, for a retry or a rerun to reattach to.
        handle.cancel("the caller that waited for it was interrupted")
        raise


def _follow(job: TrainingJob, handle: RunHandle) -> Any:
    """Wait for ``handle``'s run, forwarding its lines and records to ``job``'s callbacks."""
    log = job.options.logger or logging.getLogger("sparktorch_ops")
    logs = metrics = 0
    pauses = backoff(0.1, 1.0)
    cancelled = False
    while True:
        done = handle.status().done
        logs = handle.forward_logs(log, logs)
        if job.options.on_metrics is not None:
            for chunk, record in handle.directory.read("metrics", metrics):
                metrics = max(metrics, chunk)
                job.options.on_metrics(MetricRecord(**record))
        if done:
            return handle.result()
        if job.cancel_token.cancelled and not cancelled:
            handle.cancel(job.cancel_token.reason or "cancelled")
            cancelled = True
        time.sleep(next(pauses))
