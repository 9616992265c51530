"""Spark: the session, preflight checks before a barrier launch, job tags, UI URL.

pyspark is imported only here, and only when a session is used.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sparktorch_ops.errors import ConfigError, StartTimeoutError
from sparktorch_ops.planning import check_slots, expected_executors, registration_grace

if TYPE_CHECKING:
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

_PYTHON_SETTING = "PYSPARK_PYTHON (or spark.pyspark.python)"
# Executors that passed the probe, by (application id, executor ids): a new executor is probed.
_PROBED: dict[tuple[str, str], list[dict[str, Any]]] = {}


def is_connect_session(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect session (no SparkContext behind it)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def refuse_connect(spark: Any) -> None:
    """Raise ConfigError for a Spark Connect session."""
    if is_connect_session(spark):
        raise ConfigError(
            "spark",
            "Spark Connect sessions are not supported yet: barrier tasks need a classic "
            "SparkSession with a SparkContext (start one with SparkSession.builder.master(...))",
        )


def active_session() -> SparkSession | None:
    """The active (or default) classic session, without starting one or importing pyspark."""
    if sys.modules.get("pyspark") is None:
        return None
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if SparkContext._active_spark_context is None:
        return None
    return SparkSession.getActiveSession() or SparkSession._instantiatedSession


def session_for_barrier(spark: Any) -> SparkSession:
    """The given session, else the active one, else a new one from the environment's config."""
    if spark is not None:
        refuse_connect(spark)
        return spark
    session = active_session()
    if session is not None:
        return session
    from pyspark.sql import SparkSession

    return SparkSession.builder.getOrCreate()


def conf_value(sc: SparkContext, key: str) -> str | None:
    """A Spark conf value, or None."""
    # The context's own conf: sc.getConf() would copy every setting over py4j, each call.
    value = sc._conf.get(key)
    return None if value is None else str(value)


def conf_true(sc: SparkContext, key: str) -> bool:
    """Whether a boolean Spark conf is on."""
    return (conf_value(sc, key) or "false").strip().lower() == "true"


def driver_gpus(spark: Any) -> list[str] | None:
    """The driver's GPU addresses from ``spark.driver.resource.gpu``, if the session has any."""
    if spark is None:
        return None
    gpu = spark.sparkContext.resources.get("gpu")
    return None if gpu is None else list(gpu.addresses)


def task_gpu_amount(sc: SparkContext) -> float | None:
    """``spark.task.resource.gpu.amount`` as a number, or None when unset."""
    value = conf_value(sc, "spark.task.resource.gpu.amount")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ConfigError("spark.task.resource.gpu.amount", f"is not a number: {value!r}") from None


def task_cpus(sc: SparkContext) -> int:
    """``spark.task.cpus`` (default 1)."""
    return int(conf_value(sc, "spark.task.cpus") or "1")


def check_barrier_conf(sc: SparkContext, *, allow_unencrypted_channel: bool) -> None:
    """Settings that barrier mode cannot run with.

    Raises:
        ConfigError: dynamic allocation on; Spark encryption on without the explicit opt-out.
    """
    if conf_true(sc, "spark.dynamicAllocation.enabled"):
        raise ConfigError(
            "local_mode",
            "barrier mode (local_mode=False) cannot run with spark.dynamicAllocation.enabled="
            "true (Spark forbids barrier stages then); disable dynamic allocation for this "
            "application or use local_mode=True",
        )
    encrypted = [
        k for k in ("spark.ssl.enabled", "spark.network.crypto.enabled") if conf_true(sc, k)
    ]
    if encrypted and not allow_unencrypted_channel:
        raise ConfigError(
            "allow_unencrypted_channel",
            f"{', '.join(encrypted)} is on but the rank -> driver channel is not encrypted "
            "(it is authenticated by a per-run token); pass allow_unencrypted_channel=True "
            "to accept that",
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
    return registration_grace(sc.master or "", app_age_s, waiting_ms / 1000)


def _executor_count(sc: SparkContext) -> int:
    # getExecutorIds lists executors only, never the driver.
    return int(sc._jsc.sc().getExecutorIds().size())


def wait_for_slots(
    sc: SparkContext,
    required_tasks: int,
    start_timeout: float | None,
    cancelled: Callable[[], bool],
) -> None:
    """Wait until the cluster has ``required_tasks`` barrier slots, or fail before launch.

    Without ``start_timeout`` a run waits only while a just-started application's executors
    may still be registering (Spark's own start-up wait, cut short once every executor Spark
    expects is there); with it, up to ``start_timeout``.

    Raises:
        ResourceError: too few slots and no start_timeout.
        StartTimeoutError: still too few when start_timeout ran out.
    """
    if start_timeout is None:
        wait_s = _registration_grace_s(sc)
        expected = expected_executors(sc.master or "", conf_value(sc, "spark.executor.instances"))
    else:
        wait_s, expected = start_timeout, None
    deadline = time.monotonic() + wait_s
    while True:
        # Registration first: the slots read after it count every executor it saw.
        everyone_registered = expected is not None and _executor_count(sc) >= expected
        slots = available_slots(sc)
        if slots >= required_tasks or cancelled():
            return
        if everyone_registered or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    if start_timeout is not None:
        raise StartTimeoutError(
            "start_timeout",
            start_timeout,
            f"the run needs {required_tasks} barrier task slots but only {slots} registered",
        )
    check_slots(required_tasks, slots, waited=False)


def probe_executors(sc: SparkContext, num_tasks: int) -> list[dict[str, Any]]:
    """Run a small non-barrier job that checks the executors' Python and imports.

    Done once per set of executors of an application (a replaced executor is probed again).

    Raises:
        ConfigError: naming PYSPARK_PYTHON, for another Python version or missing packages.
    """
    from pyspark import cloudpickle as spark_cloudpickle

    from sparktorch_ops import _probe

    executors = (sc.applicationId, str(sc._jsc.sc().getExecutorIds().toString()))
    if executors in _PROBED:
        return _PROBED[executors]
    driver_python = f"{sys.version_info.major}.{sys.version_info.minor}"
    spark_cloudpickle.register_pickle_by_value(_probe)
    try:
        rdd = sc.parallelize(range(num_tasks), num_tasks).mapPartitions(_probe.probe_executor)
        sc.setLocalProperty("spark.job.description", "sparktorch_ops: executor check")
        try:
            found: list[dict[str, Any]] = rdd.collect()
        finally:
            sc.setLocalProperty("spark.job.description", None)  # type: ignore[arg-type]
    except Exception as exc:
        text = str(exc)
        if "PYTHON_VERSION_MISMATCH" in text or "different version" in text:
            raise ConfigError(
                _PYTHON_SETTING,
                f"the executors run another Python version than the driver ({driver_python}); "
                f"set {_PYTHON_SETTING} to a Python {driver_python} interpreter that has torch "
                "and sparktorch_ops",
            ) from None
        raise
    finally:
        spark_cloudpickle.unregister_pickle_by_value(_probe)
    for executor in found:
        if executor["python"] != driver_python:
            raise ConfigError(
                _PYTHON_SETTING,
                f"executor {executor['host']} runs Python {executor['python']} "
                f"({executor['executable']}) but the driver runs {driver_python}; set "
                f"{_PYTHON_SETTING} to a Python {driver_python} interpreter",
            )
        if executor["missing"]:
            missing = "; ".join(f"{k} ({v})" for k, v in executor["missing"].items())
            raise ConfigError(
                _PYTHON_SETTING,
                f"the executors' Python {executor['executable']} on {executor['host']} cannot "
                f"import: {missing}. Install sparktorch-ops (with torch) there, or set "
                f"{_PYTHON_SETTING} to an interpreter that has them",
            )
    _PROBED[executors] = found
    return found


def ui_url(sc: SparkContext) -> str | None:
    """The History Server page of this application when one is configured, else the live UI."""
    history = conf_value(sc, "spark.yarn.historyServer.address") or conf_value(
        sc, "spark.sparktorch.historyServer.url"
    )
    if history:
        base = history if "://" in history else f"http://{history}"
        return f"{base.rstrip('/')}/history/{sc.applicationId}/jobs/"
    url: str | None = sc.uiWebUrl
    return url


def driver_host(sc: SparkContext) -> str:
    """The address executors reach the driver at (``spark.driver.host``)."""
    return conf_value(sc, "spark.driver.host") or "127.0.0.1"
