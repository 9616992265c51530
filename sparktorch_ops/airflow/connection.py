"""The Spark master and settings of an Airflow ``spark`` connection.

The connection type is the Spark provider's own (``apache-airflow-providers-apache-spark``); it
is read the way that provider's ``SparkSubmitHook._resolve_connection`` reads it, so one
connection serves both ``SparkSubmitOperator`` and ``TorchDistributorOperator``:

- ``host`` holds the master URL (``spark://host``, ``local[4]``, ``yarn``, ``k8s://https://...``);
  a connection made from a URI (``spark://host:7077``) has the scheme in ``conn_type`` instead.
- ``port``, when set, is appended to the master.
- ``extra``: ``queue`` (YARN queue), ``namespace`` (Kubernetes), ``deploy-mode`` (the driver here
  always runs in the task process, so only ``client`` applies) and, as the provider's PySpark
  operator does, any ``spark.*`` key as a Spark setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CONN_ID = "spark_default"
FALLBACK_MASTER = "local[*]"


class MissingConnectionError(LookupError):
    """An explicitly named connection does not exist."""


@dataclass(frozen=True)
class SparkConnection:
    """Where the Spark session of a barrier-mode run comes from.

    Attributes:
        master: the master URL for ``SparkSession.builder.master``.
        conf: Spark settings taken from the connection's extra.
        conn_id: the connection that was read, or None when the default one is absent.
    """

    master: str
    conf: dict[str, str] = field(default_factory=dict)
    conn_id: str | None = None


def master_from_connection(conn_type: str | None, host: str | None, port: int | None) -> str:
    """The master URL, exactly as the Spark provider's ``SparkSubmitHook`` builds it."""
    if conn_type == "spark" and host and ("://" in host or not port):
        master = host
    else:
        master = f"{conn_type}://{host or ''}"
    return f"{master}:{port}" if port else master


def conf_from_extra(extra: Mapping[str, Any], log: Any) -> dict[str, str]:
    """Spark settings from the connection's extra (provider keys mapped, ``spark.*`` kept)."""
    conf = {
        str(k): str(v) for k, v in extra.items() if str(k).startswith("spark.") and v is not None
    }
    if extra.get("queue"):
        conf.setdefault("spark.yarn.queue", str(extra["queue"]))
    if extra.get("namespace"):
        conf.setdefault("spark.kubernetes.namespace", str(extra["namespace"]))
    deploy_mode = extra.get("deploy-mode")
    if deploy_mode and str(deploy_mode) != "client":
        log.warning(
            "sparktorch_ops: the connection's deploy-mode=%s is ignored: the Spark driver of a "
            "TorchDistributorOperator is the task process itself (client mode)",
            deploy_mode,
        )
    return conf


def resolve_connection(conn_id: str, log: Any) -> SparkConnection:
    """Read ``conn_id``; the default connection may be absent (then local Spark), others not.

    Raises:
        MissingConnectionError: ``conn_id`` is not the default and does not exist.
        ValueError: the connection has no master (no host).
    """
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        if conn_id != DEFAULT_CONN_ID:
            raise MissingConnectionError(
                f"conn_id: the Airflow connection {conn_id!r} does not exist; create a connection "
                "of type 'spark' whose host is the master URL (spark://host:7077, yarn, "
                "k8s://https://host, local[4])"
            ) from None
        log.info(
            "sparktorch_ops: no connection %r: the master is spark_conf's spark.master, else %s",
            conn_id,
            FALLBACK_MASTER,
        )
        return SparkConnection(FALLBACK_MASTER)
    if not conn.host and conn.conn_type == "spark":
        raise ValueError(
            f"conn_id: the connection {conn_id!r} has no host; put the master URL there "
            "(spark://host, yarn, k8s://https://host, local[4])"
        )
    master = master_from_connection(conn.conn_type, conn.host, conn.port)
    return SparkConnection(master, conf_from_extra(conn.extra_dejson, log), conn_id)


def mlflow_uri_from_connection(conn_id: str, log: Any) -> str | None:
    """The MLflow tracking URI held by Airflow connection ``conn_id`` (its ``extra``'s
    ``tracking_uri``, else ``schema://host:port`` with ``http`` by default); None when there
    is no such connection (then ``MLFLOW_TRACKING_URI`` or MLflow's default applies)."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        return None
    extra = conn.extra_dejson or {}
    uri = extra.get("tracking_uri")
    if not uri and conn.host:
        host = conn.host if "://" in conn.host else f"{conn.schema or 'http'}://{conn.host}"
        uri = f"{host}:{conn.port}" if conn.port else host
    if uri:
        log.info("sparktorch_ops: MLflow tracking URI from connection %s", conn_id)
    return str(uri) if uri else None
