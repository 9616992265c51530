"""Prefect blocks: the Spark cluster a training runs on (master URL and conf), and the MLflow
server that tracks it.

A deployment names a cluster (``SparkCluster.load("gpu-cluster")``, or ``cluster="gpu-cluster"``
on the task) instead of repeating the master and conf in every flow. Validation and sessions
are the core's (:mod:`sparktorch_ops.spark`), so a bad master fails before Spark starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from prefect.blocks.core import Block
from pydantic import Field, field_validator, model_validator

from sparktorch_ops.errors import ConfigError
from sparktorch_ops.spark import session as spark_support
from sparktorch_ops.spark.session import SparkSettings, validate_conf


class SparkCluster(Block):
    """A Spark cluster for ``run_torch_distributor``: its master URL and Spark conf.

    Save it once (``SparkCluster(master="spark://head:7077", conf={...}).save("prod")``) and
    pass ``cluster="prod"`` (or the block) to the task; it is used when ``local_mode=False``.
    A Spark Connect URL as master (``sc://spark-connect:15002``) runs the barrier tasks through
    a Spark Connect session to that server.

    Attributes:
        master: the Spark master URL, or a Spark Connect URL (``sc://...``).
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
        description=(
            f"Spark master URL, one of: {spark_support.MASTER_FORMS}. A Spark Connect URL "
            "(sc://host:port, optionally /;token=...;use_ssl=true;user_id=...) opens a Spark "
            "Connect session (no JVM in the flow's process); conf then holds runtime settings."
        ),
        examples=["spark://spark-master:7077", "sc://spark-connect:15002", "local[4]", "yarn"],
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
        return spark_support.validate_master(value)

    @field_validator("conf", mode="before")
    @classmethod
    def _check_conf(cls, value: object) -> dict[str, str]:
        return spark_support.validate_conf(value, "conf")

    @model_validator(mode="after")
    def _one_master(self) -> SparkCluster:
        # A spark.master in conf is either the block's master or a mistake: never ignored.
        self.settings()
        return self

    def settings(self, extra_conf: dict[str, str] | None = None) -> spark_support.SparkSettings:
        """The core's session settings for this cluster (``extra_conf`` over the block's).

        Raises:
            ConfigError: a ``spark.master`` in the conf that contradicts ``master``.
        """
        conf = dict(self.conf)
        if self.history_server_url:
            conf.setdefault(spark_support.HISTORY_SERVER_CONF, self.history_server_url)
        conf.update(extra_conf or {})
        return spark_support.SparkSettings(master=self.master, conf=conf, app_name=self.app_name)

    def get_session(self, logger: Any = None) -> tuple[Any, bool]:
        """Start the session, or reuse the active one (one SparkContext per process).

        Args:
            logger: told when an active session is reused and settings cannot apply.

        Returns:
            ``(session, created)``: created is False when an active session was reused.
        """
        handle = spark_support.get_session(self.settings(), logger)
        return handle.session, handle.created


class MlflowServer(Block):
    """The MLflow tracking server for ``run_torch_distributor(mlflow_experiment=...)``.

    Save it once (``MlflowServer(tracking_uri="http://mlflow:5000").save("prod")``) and pass
    ``mlflow_tracking_uri="prod"`` to the task.

    Attributes:
        tracking_uri: the MLflow tracking URI.
    """

    _block_type_name: ClassVar[str] = "MLflow Server"
    _block_type_slug: ClassVar[str] = "sparktorch-ops-mlflow-server"
    _description: ClassVar[str] = "The MLflow tracking server of sparktorch_ops training runs."

    tracking_uri: str = Field(
        description="MLflow tracking URI.",
        examples=["http://mlflow:5000", "sqlite:////data/mlflow.db"],
    )


def resolve_tracking_uri(value: str | None) -> str | None:
    """A tracking URI as given, or the one of the saved :class:`MlflowServer` block it names
    (a value without ``:``); None stays None (``MLFLOW_TRACKING_URI``).

    Raises:
        ConfigError: a name that is no saved block.
    """
    if not isinstance(value, str) or ":" in value or "/" in value:
        return value  # None, a URI, or something the job's own check refuses by name
    return str(load_block(MlflowServer, value, "mlflow_tracking_uri").tracking_uri)


def load_block(kind: type[Block], name: str, argument: str) -> Any:
    """The saved block of type ``kind`` named ``name``.

    Raises:
        ConfigError: no such block (naming ``argument``).
    """
    try:
        return kind.load(name)
    except ValueError as exc:
        raise ConfigError(argument, f"no {kind.__name__} block named {name!r}: {exc}") from None


def session_settings(
    master: str | None, conf: Mapping[str, Any] | None, cluster: SparkCluster | str | None
) -> SparkSettings:
    """The task's session settings: from ``spark_master``/``spark_conf``, or a cluster block
    (given or saved under a name) with ``spark_conf`` over its conf."""
    if cluster is None:
        return SparkSettings(master=master, conf=conf or {})
    if master is not None:
        raise ConfigError(
            "spark_master", "give either spark_master or cluster (a SparkCluster block), not both"
        )
    if isinstance(cluster, str):
        cluster = load_block(SparkCluster, cluster, "cluster")
    if not isinstance(cluster, SparkCluster):
        raise ConfigError("cluster", f"must be a SparkCluster block or its name, got {cluster!r}")
    # spark.master stays in: the block's settings refuse one that contradicts its master.
    return cluster.settings(validate_conf(conf, "spark_conf"))
