"""Barrier mode's checks: settings and slots before launch; the errors for executors whose
Python cannot run the ranks, which the run's own barrier tasks find.

A barrier stage with too few slots is retried by Spark for minutes: that is found here first.
An executor's Python of another version, or without a working torch, fails the stage's tasks
as they start; both become a typed error naming the setting to change.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sparktorch_ops import events
from sparktorch_ops.driver.planning import (
    barrier_layout,
    check_slots,
    registration_grace,
    replacement_grace,
    tasks_that_fit,
)
from sparktorch_ops.errors import ConfigError, StartTimeoutError
from sparktorch_ops.spark.session import conf_true, conf_value, parse_master, task_gpu_amount
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire.messages import UnusablePython

if TYPE_CHECKING:
    from pyspark import SparkContext

PYTHON_SETTING = "PYSPARK_PYTHON (or spark.pyspark.python)"


#: How long a run that sets no start_timeout waits for lost executors to be replaced: a later
#: attempt from its start, a new run from the loss (a standalone or YARN cluster relaunches
#: one within seconds; a slow or busy machine may take tens of seconds).
REPLACEMENT_WAIT_S = 60.0


def check_barrier(
    sc: SparkContext,
    spec: LaunchSpec,
    cancelled: Callable[[], bool],
    emit: Callable[..., None],
    log: Any,
    *,
    replacing: bool = False,
) -> int:
    """Barrier mode on a classic session: settings, layout and slots (waiting as
    :func:`wait_for_slots` does); the ranks the attempt runs with: ``num_processes``, or as
    many as fit down to ``min_processes``. ``replacing``: a later attempt, which waits for lost
    executors to be replaced. The executors' Python is checked by the run's own barrier tasks
    (:func:`unusable_python`, :func:`other_python_version`)."""
    check_barrier_conf(sc)
    layout = barrier_layout(spec.num_processes, spec.use_gpu, task_gpu_amount(sc))
    per_task = layout.ranks_per_task
    tasks = wait_for_slots(
        sc,
        layout.num_tasks,
        spec.start_timeout,
        cancelled,
        log,
        fewest_tasks=-(-spec.fewest_processes // per_task),
        replacing=replacing,
    )
    if not cancelled():
        emit(events.SLOTS_READY, tasks=tasks)
    return tasks * per_task


def check_connect_client(pyspark_version: str) -> None:
    """Barrier mode over Spark Connect needs a pyspark 4 client (pure).

    Raises:
        ConfigError: naming ``spark``, for an older client.
    """
    leading = re.match(r"\d+", pyspark_version)
    if leading is None or int(leading.group()) < 4:
        raise ConfigError(
            "spark",
            f"barrier mode over Spark Connect needs pyspark 4.0 or later, this client has "
            f"pyspark {pyspark_version} (its Connect client cannot run a barrier stage): use "
            "a classic session (a spark:// or yarn master), or pyspark 4 on the client and "
            "the server",
        )


def check_barrier_over_connect(session: Any, spec: LaunchSpec, emit: Callable[..., None]) -> None:
    """Barrier mode over Spark Connect: the client's version, settings and layout, and the
    slots where the server's master fixes them (a client cannot count a cluster's free slots;
    the start deadline covers the rest)."""
    import pyspark

    check_connect_client(pyspark.__version__)
    check_barrier_conf(session)
    layout = barrier_layout(spec.num_processes, spec.use_gpu, task_gpu_amount(session))
    slots = known_slots(session)
    if slots is not None:
        check_slots(layout.num_tasks, slots, waited=False)
        emit(events.SLOTS_READY, tasks=layout.num_tasks)


def known_slots(session: Any) -> int | None:
    """Barrier slots of the server's application when its master fixes them (``local[N]``,
    ``local-cluster[N,C,M]``), else None (a cluster manager's executors come and go)."""
    master = conf_value(session, "spark.master") or ""
    try:
        parsed = parse_master(master)
    except ConfigError:
        return None
    task_cpus = int(conf_value(session, "spark.task.cpus") or "1")
    inside = parsed.url[parsed.url.find("[") + 1 : -1] if "[" in parsed.url else "1"
    if parsed.kind == "local":
        threads = inside.split(",")[0]
        if threads == "*":
            return None  # the server's core count: not known here
        return int(threads) // task_cpus
    if parsed.kind == "local-cluster":
        workers, cores = (int(part) for part in inside.split(",")[:2])
        return workers * (cores // task_cpus)
    return None


def check_barrier_conf(sc: SparkContext) -> None:
    """Settings that barrier mode cannot run with.

    Raises:
        ConfigError: dynamic allocation on.
    """
    if conf_true(sc, "spark.dynamicAllocation.enabled"):
        raise ConfigError(
            "local_mode",
            "barrier mode (local_mode=False) cannot run with spark.dynamicAllocation.enabled="
            "true (Spark forbids barrier stages then); disable dynamic allocation for this "
            "application or use local_mode=True",
        )


def available_slots(sc: SparkContext) -> int:
    """How many tasks of the default resource profile the cluster can run at once, now."""
    jsc = sc._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def _registration_grace_s(sc: SparkContext) -> float:
    """How long this application may still wait for its executors to register (see planning)."""
    jconf = sc._jsc.sc().conf()
    waiting_ms = int(jconf.getTimeAsMs("spark.scheduler.maxRegisteredResourcesWaitingTime", "30s"))
    app_age_s = max(0.0, time.time() - sc.startTime / 1000)
    return registration_grace(_in_process(sc), app_age_s, waiting_ms / 1000)


def _replacement_grace_s(sc: SparkContext, *, replacing: bool) -> float:
    """How long a run may still wait for executors this application lost recently to be
    replaced (see planning); Spark's status store keeps the removed ones with their reason."""
    if _in_process(sc):
        return REPLACEMENT_WAIT_S if replacing else 0.0
    now_s = time.time()
    lost: list[tuple[float, str]] = []
    added: list[float] = []
    summaries = sc._jsc.sc().statusStore().executorList(False)
    for summary in (summaries.apply(i) for i in range(summaries.size())):
        if summary.id() == "driver":
            continue
        if summary.isActive():
            added.append(now_s - summary.addTime().getTime() / 1000)
        elif summary.removeTime().isDefined():
            reason = summary.removeReason()
            removed_s = now_s - summary.removeTime().get().getTime() / 1000
            lost.append((removed_s, str(reason.get()) if reason.isDefined() else ""))
    return replacement_grace(lost, added, REPLACEMENT_WAIT_S, replacing=replacing)


def _in_process(sc: SparkContext) -> bool:
    try:
        return parse_master(sc.master or "").in_process
    except ConfigError:
        return False


def expected_executors(master: str, executor_instances: str | None) -> int | None:
    """How many executors the application will get, where Spark says it (else None).

    Lets the start-up wait end as soon as they have all registered, so that too few slots on a
    fixed-size cluster still fail within seconds.
    """
    if executor_instances is not None and executor_instances.strip().isdigit():
        return int(executor_instances)
    try:
        return parse_master(master).executors
    except ConfigError:
        return None


def _executor_ids(sc: SparkContext) -> list[str]:
    """The application's executors, never the driver. An in-process master has none, and
    asking its scheduler would log a warning ("Requesting executors is not supported")."""
    if _in_process(sc):
        return []
    ids = sc._jsc.sc().getExecutorIds()
    return [str(ids.apply(i)) for i in range(ids.size())]


def wait_for_slots(
    sc: SparkContext,
    required_tasks: int,
    start_timeout: float | None,
    cancelled: Callable[[], bool],
    log: Any = None,
    *,
    fewest_tasks: int | None = None,
    replacing: bool = False,
) -> int:
    """Wait until the cluster has ``required_tasks`` barrier slots free, or fail before launch;
    the tasks to run (fewer when only down to ``fewest_tasks`` fit).

    First the cluster must have that many slots at all. Without ``start_timeout`` a run waits
    for them only while a just-started application's executors may still be registering
    (Spark's own start-up wait, cut short once every executor Spark expects is there) or while
    executors it lost moments ago are being replaced (up to :data:`REPLACEMENT_WAIT_S` after
    the loss), and a later attempt (``replacing``) up to :data:`REPLACEMENT_WAIT_S` for lost
    ones to be replaced, not at all when its nodes are gone (a worker lost, a decommission);
    with it, up to ``start_timeout``. When the wait ends short of slots, a run that
    may shrink takes as many as there are. Then, while other jobs of the application hold
    slots (another run's barrier stage, say), the run waits for enough of them to free up
    (saying so once at INFO): up to ``start_timeout``, without it until they do.
    ``cancelled`` ends either wait.

    Raises:
        ResourceError: too few slots in the cluster (naming ``min_processes`` when the run
            may shrink) and no start_timeout.
        StartTimeoutError: still too few (or too few free) when start_timeout ran out.
    """
    fewest = required_tasks if fewest_tasks is None else fewest_tasks
    started = time.monotonic()
    expected = expected_executors(sc.master or "", conf_value(sc, "spark.executor.instances"))
    if start_timeout is not None:
        wait_s, expected = start_timeout, None
    elif replacing:
        wait_s = _replacement_grace_s(sc, replacing=True)
    else:
        replacement_s = _replacement_grace_s(sc, replacing=False)
        wait_s = max(_registration_grace_s(sc), replacement_s)
        if replacement_s > 0 and log is not None and available_slots(sc) < required_tasks:
            log.info(
                "sparktorch_ops: an executor of this application was lost moments ago; "
                "waiting up to %.0f s for the cluster to replace it",
                replacement_s,
            )
    deadline = started + wait_s
    while True:
        # Registration first: the slots read after it count every executor it saw.
        everyone_registered = expected is not None and len(_executor_ids(sc)) >= expected
        slots = available_slots(sc)
        if cancelled():
            return required_tasks
        if slots >= required_tasks:
            tasks = required_tasks
            break
        if everyone_registered or time.monotonic() >= deadline:
            if start_timeout is not None and slots < fewest:
                raise StartTimeoutError(
                    "start_timeout",
                    start_timeout,
                    f"the run needs {fewest} barrier task slots but only {slots} registered",
                )
            tasks = tasks_that_fit(
                required_tasks,
                fewest,
                slots,
                waited=replacing,
                wait_s=wait_s if replacing else None,
            )
            break
        time.sleep(_SLOT_POLL_S)
    _wait_for_free_slots(sc, tasks, started, start_timeout, cancelled, log)
    return tasks


_SLOT_POLL_S = 0.25
# Spark's status store lags its scheduler: a stage that just ended may still count as busy for
# a moment, so a wait is announced only once it has lasted this long.
_SAY_WAITING_AFTER_S = 1.0


def busy_slots(sc: SparkContext) -> int:
    """Task slots the application's running tasks hold now (as Spark's status store has it)."""
    tracker = sc.statusTracker()
    infos = (tracker.getStageInfo(stage) for stage in tracker.getActiveStageIds())
    return sum(int(info.numActiveTasks) for info in infos if info is not None)


def _wait_for_free_slots(
    sc: SparkContext,
    required_tasks: int,
    started: float,
    start_timeout: float | None,
    cancelled: Callable[[], bool],
    log: Any,
) -> None:
    said = False
    while not cancelled():
        slots = available_slots(sc)
        busy = busy_slots(sc)
        if slots - busy >= required_tasks:
            return
        waited = time.monotonic() - started
        if start_timeout is not None and waited >= start_timeout:
            raise StartTimeoutError(
                "start_timeout",
                start_timeout,
                f"the run waited for {required_tasks} free barrier task slots, but {busy} of "
                f"the cluster's {slots} stayed busy with other jobs",
            )
        if not said and log is not None and waited >= _SAY_WAITING_AFTER_S:
            log.info(
                "sparktorch_ops: waiting for %d free barrier task slots: %d of the cluster's "
                "%d are busy with other jobs%s",
                required_tasks,
                busy,
                slots,
                f" (start_timeout {start_timeout:g} s)" if start_timeout is not None else "",
            )
            said = True
        time.sleep(_SLOT_POLL_S)


def unusable_python(found: UnusablePython) -> ConfigError:
    """The error for a barrier task whose Python cannot import torch (the task checks it
    first thing: no job of its own before the run's stage)."""
    return ConfigError(
        PYTHON_SETTING,
        f"the executors' Python {found.executable} on {found.host} cannot import: torch "
        f"({found.reason}). Install torch there (sparktorch_ops itself travels with the run), "
        f"or set {PYTHON_SETTING} to an interpreter that has it",
    )


def other_python_version(spark_error: str) -> ConfigError | None:
    """The error for a barrier stage that Spark failed because an executor's Python is not
    the driver's version (its workers check it first thing), else None."""
    if "PYTHON_VERSION_MISMATCH" not in spark_error and "different version" not in spark_error:
        return None
    driver_python = f"{sys.version_info.major}.{sys.version_info.minor}"
    found = re.search(r"worker has different version:? \(?(\d+\.\d+)", spark_error)
    theirs = f" (Python {found.group(1)})" if found else ""
    return ConfigError(
        PYTHON_SETTING,
        f"the executors run another Python version{theirs} than the driver ({driver_python}); "
        f"set {PYTHON_SETTING} to a Python {driver_python} interpreter that has torch",
    )
