"""The Spark cluster a training runs on: master URL and conf, as a Prefect block.

A deployment names a cluster (``SparkCluster.load("gpu-cluster")``, or ``cluster="gpu-cluster"``
on the task) instead of repeating the master and conf in every flow. The same validation serves
the task's own ``master`` and ``conf`` arguments, so a bad master fails before Spark starts.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from prefect.blocks.core import Block
from pydantic import Field, field_validator

from sparktorch_ops.errors import ConfigError

#: The conf key the core reads for a History Server link (besides YARN's own setting).
HISTORY_SERVER_CONF = "spark.sparktorch.historyServer.url"

_MASTER_FORMS = (
    "local, local[N], local[*], local[N,F], local-cluster[N,C,M], spark://HOST:PORT, yarn, "
    "k8s://HOST:PORT, mesos://HOST:PORT"
)
_MASTER = re.compile(
    r"""^(?:
        local(?:\[(?:\*|[1-9]\d*)(?:,\s*[1-9]\d*)?\])?
      | local-cluster\[\s*[1-9]\d*\s*,\s*[1-9]\d*\s*,\s*[1-9]\d*\s*\]
      | spark://[^\s/:,]+(?::\d+)?(?:,[^\s/:,]+(?::\d+)?)*/?
      | yarn
      | k8s://(?:https?://)?[^\s/]+(?:/\S*)?
      | mesos://[^\s/]+(?:/\S*)?
    )$""",
    re.VERBOSE,
)

Logger = logging.Logger | logging.LoggerAdapter[Any]


def validate_master(master: object, argument: str = "master") -> str:
    """Check the form of a Spark master URL (no connection is made).

    Args:
        master: the URL to check.
        argument: the argument name used in the error.

    Returns:
        The URL, stripped of surrounding blanks.

    Raises:
        ConfigError: not a string, or not one of the forms Spark accepts.
    """
    if not isinstance(master, str):
        raise ConfigError(argument, f"must be a Spark master URL (str), got {master!r}")
    value = master.strip()
    if not _MASTER.match(value):
        raise ConfigError(
            argument, f"{master!r} is not a Spark master URL; expected one of: {_MASTER_FORMS}"
        )
    return value


def validate_conf(conf: object, argument: str = "conf") -> dict[str, str]:
    """Check Spark conf: str keys; str, number or bool values (made strings as Spark wants).

    Raises:
        ConfigError: not a mapping, an empty or non-str key, or a value of another type.
    """
    if conf is None:
        return {}
    if not isinstance(conf, Mapping):
        raise ConfigError(argument, f"must be a mapping of Spark settings, got {conf!r}")
    checked: dict[str, str] = {}
    for key, value in conf.items():
        if not isinstance(key, str) or not key.strip():
            raise ConfigError(argument, f"keys must be non-empty strings, got {key!r}")
        if isinstance(value, bool):
            checked[key] = "true" if value else "false"
        elif isinstance(value, (str, int, float)):
            checked[key] = str(value)
        else:
            raise ConfigError(
                argument, f"the value of {key!r} must be a str, number or bool, got {value!r}"
            )
    return checked


class SparkCluster(Block):
    """A Spark cluster for ``run_torch_distributor``: its master URL and Spark conf.

    Save it once (``SparkCluster(master="spark://head:7077", conf={...}).save("prod")``) and
    pass ``cluster="prod"`` (or the block) to the task; it is used when ``local_mode=False``.

    Attributes:
        master: the Spark master URL.
        conf: Spark configuration applied when the session is created.
        history_server_url: the Spark History Server, for the task's Spark UI link (the
            driver's live UI goes away with the session); needs event logging on the cluster.
        app_name: the Spark application name.
    """

    _block_type_name: ClassVar[str] = "Spark Cluster"
    _block_type_slug: ClassVar[str] = "sparktorch-ops-spark-cluster"
    _description: ClassVar[str] = (
        "A Spark cluster for sparktorch_ops distributed training: master URL and Spark conf."
    )

    master: str = Field(
        description=f"Spark master URL, one of: {_MASTER_FORMS}.",
        examples=["spark://spark-master:7077", "local[4]", "yarn"],
    )
    conf: dict[str, str] = Field(
        default_factory=dict,
        description="Spark configuration for the session, e.g. spark.executor.memory.",
    )
    history_server_url: str | None = Field(
        default=None,
        description="Spark History Server base URL, linked from the task's artifacts.",
        examples=["http://spark-history:18080"],
    )
    app_name: str = Field(default="sparktorch-ops", description="Spark application name.")

    @field_validator("master")
    @classmethod
    def _check_master(cls, value: str) -> str:
        return validate_master(value)

    @field_validator("conf", mode="before")
    @classmethod
    def _check_conf(cls, value: object) -> dict[str, str]:
        return validate_conf(value)

    def spark_conf(self) -> dict[str, str]:
        """The conf to start the session with, the History Server link included."""
        conf = dict(self.conf)
        if self.history_server_url:
            conf.setdefault(HISTORY_SERVER_CONF, self.history_server_url)
        return conf

    def get_session(self, logger: Logger | None = None) -> tuple[Any, bool]:
        """Start the session, or reuse the active one (one SparkContext per process).

        Args:
            logger: told when an active session is reused and settings cannot apply.

        Returns:
            ``(session, created)``: created is False when an active session was reused.
        """
        return spark_session(self.master, self.spark_conf(), self.app_name, logger)


def spark_session(
    master: str | None,
    conf: Mapping[str, str],
    app_name: str = "sparktorch-ops",
    logger: Logger | None = None,
) -> tuple[Any, bool]:
    """A classic SparkSession for ``master`` and ``conf``, reusing an active one.

    Returns:
        ``(session, created)``.
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    log = logger or logging.getLogger(__name__)
    active = SparkContext._active_spark_context
    if active is not None:
        session = SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
        active_conf = dict(active.getConf().getAll())
        log.info(
            "reusing the SparkContext already running in this process (master %s, app %s)",
            active.master,
            active.applicationId,
        )
        if master is not None and master != active.master:
            log.warning(
                "master=%r is ignored: a process has one SparkContext, and the running one uses %r",
                master,
                active.master,
            )
        differing = sorted(k for k, v in conf.items() if active_conf.get(k) != v)
        if differing:
            log.warning(
                "Spark settings that cannot apply to the running SparkContext: %s",
                ", ".join(differing),
            )
        return session, False
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    # Spark's console progress bar would go to the flow run's raw stderr, not the task log.
    conf = {"spark.ui.showConsoleProgress": "false", **conf}
    for key, value in conf.items():
        builder = builder.config(key, value)
    try:
        session = builder.getOrCreate()
    except Exception as exc:
        raise ConfigError(
            "spark_master",
            f"could not start a Spark session (master {master!r}): {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
        ) from exc
    log.info(
        "started Spark application %s (master %s)",
        session.sparkContext.applicationId,
        session.sparkContext.master,
    )
    return session, True
