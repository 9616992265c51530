"""The first part of a run: a Spark session where the run needs one, its checks, the input.

:func:`prepare` yields what the launch needs (the session's conf source, the driver's GPUs,
the checked DataFrame input) and stops a session it started once the run is over, whatever
its outcome.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sparktorch_ops import events
from sparktorch_ops.driver.planning import select_local_gpus
from sparktorch_ops.events import RunStateMachine
from sparktorch_ops.job import TrainingJob
from sparktorch_ops.spark import preflight
from sparktorch_ops.spark import session as spark_support
from sparktorch_ops.spark.dataframe import PreparedInput, prepare_input


@dataclass(frozen=True)
class Prepared:
    """What a launch starts from.

    Attributes:
        sc: barrier mode: the SparkContext, or the Connect session standing in for one;
            None in local mode.
        local_gpus: local mode with ``use_gpu``: the GPUs the ranks get, one each.
        data: the job's DataFrame input, resolved and checked (None without one).
        num_processes: the ranks the first attempt runs with (``num_processes``, or fewer
            down to ``min_processes`` where the cluster lacks the slots).
    """

    sc: Any
    local_gpus: tuple[str, ...] | None
    data: PreparedInput | None
    num_processes: int


def _machine_gpu_count() -> int:
    """GPUs this machine has; torch is imported only when a GPU driver is present."""
    if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")):
        return 0
    import torch

    return int(torch.cuda.device_count())


def _local_gpus(job: TrainingJob) -> tuple[str, ...] | None:
    spec = job.options
    if not spec.use_gpu:
        return None
    # Only the session's driver GPUs matter here; no session is started for them.
    session = job.spark.session or spark_support.active_session()
    return tuple(
        select_local_gpus(
            spec.num_processes,
            spark_driver_gpus=spark_support.driver_gpus(session),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            device_count=_machine_gpu_count(),
        )
    )


@contextlib.contextmanager
def _session(
    job: TrainingJob, run_id: str, log: logging.Logger
) -> Iterator[spark_support.SessionHandle]:
    handle = spark_support.get_session(job.spark, log)
    try:
        with spark_support.jobs_of_run(handle.session, run_id, log):
            yield handle
    finally:
        try:
            spark_support.stop_session(handle)
        except Exception:  # must not hide the run's own outcome
            log.warning("sparktorch_ops: could not stop Spark", exc_info=True)


@contextlib.contextmanager
def prepare(
    job: TrainingJob,
    run_id: str,
    machine: RunStateMachine,
    log: logging.Logger,
    check_cancelled: Callable[[], None],
) -> Iterator[Prepared]:
    """Get the run ready to launch: a session and barrier mode's checks, or local mode's GPUs;
    the DataFrame input checked (one Spark job). Raises what the checks find."""
    spec = job.options

    def checked_input(session: Any) -> PreparedInput | None:
        if job.data is None:
            return None
        prepared = prepare_input(job.data, session)
        machine.emit(events.INPUT_CHECKED, **prepared.facts.summary())
        check_cancelled()
        return prepared

    if spec.local_mode:
        if job.data is None and job.spark.configured:
            log.warning(
                "sparktorch_ops: the Spark master and settings are not used with "
                "local_mode=True (the ranks run on this machine); pass local_mode=False "
                "to train on the Spark cluster"
            )
        with contextlib.ExitStack() as stack:
            data = None
            if job.data is not None and job.data.dataframe is not None:
                # The DataFrame's own session streams it to the driver.
                session = job.data.dataframe.sparkSession
                stack.enter_context(spark_support.jobs_of_run(session, run_id, log))
                data = checked_input(session)
            elif job.data is not None:
                # SQL, a table or a path: a session from the job's settings reads it.
                data = checked_input(stack.enter_context(_session(job, run_id, log)).session)
            yield Prepared(None, _local_gpus(job), data, spec.num_processes)
        return
    with _session(job, run_id, log) as handle:
        session = handle.session
        sc = spark_support.conf_source(session)  # a Connect session stands in for a context
        connect = spark_support.is_connect_session(session)
        machine.emit(
            events.SESSION_READY,
            app_id=spark_support.app_id(sc),
            ui_url=spark_support.ui_url(sc),
            master=spark_support.master_of(sc),
            created=handle.created,
            connect=connect,
        )
        check_cancelled()
        processes = spec.num_processes
        if connect:
            preflight.check_barrier_over_connect(session, spec, machine.emit)
        else:
            processes = preflight.check_barrier(
                sc, spec, lambda: job.cancel_token.cancelled, machine.emit, log
            )
            check_cancelled()
        yield Prepared(sc, None, checked_input(session), processes)


def next_attempt_processes(
    job: TrainingJob, prepared: Prepared, machine: RunStateMachine, log: logging.Logger
) -> int:
    """The ranks the next attempt runs with: on a classic session, once the cluster has the
    slots again (lost executors replaced, waiting as ``start_timeout`` says) or, where it has
    fewer, as many as fit down to ``min_processes``; elsewhere ``num_processes`` (local mode;
    over Spark Connect, whose client cannot count the cluster's slots, the start deadline
    covers the wait)."""
    spec = job.options
    if prepared.sc is None or spark_support.is_connect_session(prepared.sc):
        return spec.num_processes
    return preflight.check_barrier(
        prepared.sc,
        spec,
        lambda: job.cancel_token.cancelled,
        machine.emit,
        log,
        replacing=True,
    )
