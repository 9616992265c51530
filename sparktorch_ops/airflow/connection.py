"""The Spark master and settings of an Airflow ``spark`` or ``spark_connect`` connection.

Both connection types are the Spark provider's own (``apache-airflow-providers-apache-spark``).
A ``spark`` connection is read the way that provider's ``SparkSubmitHook._resolve_connection``
reads it, so one connection serves both ``SparkSubmitOperator`` and ``TorchDistributorOperator``:

- ``host`` holds the master URL (``spark://host``, ``local[4]``, ``yarn``, ``k8s://https://...``);
  a connection made from a URI (``spark://host:7077``) has the scheme in ``conn_type`` instead.
- ``port``, when set, is appended to the master.
- ``extra``: ``queue`` (YARN queue), ``namespace`` (Kubernetes), ``deploy-mode`` (the driver here
  always runs in the task process, so only ``client`` applies) and, as the provider's PySpark
  operator does, any ``spark.*`` key as a Spark setting.

A ``spark_connect`` connection is read the way ``SparkConnectHook.get_connection_url`` reads it;
the master is that Spark Connect URL (``sc://host:port/;user_id=...;token=...;use_ssl=...``):

- ``host`` is the server's host (``sc://`` is added when it has no scheme), ``port`` is appended
  when set (else pyspark's default, 15002); a path in ``host`` is an error.
- ``login`` becomes ``user_id``, ``password`` becomes ``token`` (URL-quoted; unlike the
  provider, ``/`` too, which pyspark would otherwise refuse) and the extra's ``use_ssl``, when
  present, ``use_ssl``; nothing else of the extra goes into the URL.
- any ``spark.*`` key of the extra is a Spark setting of the session, as for ``spark``.

The token is part of the master URL: log it only through
:func:`sparktorch_ops.spark.session.redact_connect_url`.

Read here rather than through the provider's hooks: the provider is not part of the
``[airflow]`` extra (its dependency ``pyspark-client`` overwrites pyspark's own files), and its
Connect URL keeps a ``/`` of the token unquoted, which pyspark then refuses. The tests check
that both connection types read exactly as the provider reads them, that one ``/`` aside.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlparse, urlunparse

from sparktorch_ops.spark.session import SparkSettings, redact_connect_url

DEFAULT_CONN_ID = "spark_default"
FALLBACK_MASTER = "local[*]"
CONNECT_CONN_TYPE = "spark_connect"


class MissingConnectionError(LookupError):
    """An explicitly named connection does not exist."""


@dataclass(frozen=True)
class SparkConnection:
    """Where the Spark session of a barrier-mode run comes from.

    Attributes:
        master: the master URL for ``SparkSession.builder.master``, or a Spark Connect URL
            (``sc://...``, which may hold a token: its repr hides it).
        conf: Spark settings taken from the connection's extra.
        conn_id: the connection that was read, or None when the default one is absent.
    """

    master: str
    conf: dict[str, str] = field(default_factory=dict)
    conn_id: str | None = None

    def __repr__(self) -> str:
        return (
            f"SparkConnection(master={redact_connect_url(self.master)!r}, conf={self.conf!r}, "
            f"conn_id={self.conn_id!r})"
        )


def _spark_conf(extra: Mapping[str, Any]) -> dict[str, str]:
    """The ``spark.*`` keys of a connection's extra, values as strings."""
    return {
        str(k): str(v) for k, v in extra.items() if str(k).startswith("spark.") and v is not None
    }


def _submit_conf(extra: Mapping[str, Any], log: Any) -> dict[str, str]:
    """Spark settings from a ``spark`` connection's extra (``SparkSubmitHook``'s keys mapped,
    ``spark.*`` kept)."""
    conf = _spark_conf(extra)
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
        ValueError: the connection has no master (no host), or a ``spark_connect`` one's host
            has a path.
    """
    from airflow.providers.common.compat.sdk import AirflowNotFoundException
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        if conn_id != DEFAULT_CONN_ID:
            raise MissingConnectionError(
                f"conn_id: the Airflow connection {conn_id!r} does not exist; create a connection "
                "of type 'spark' whose host is the master URL (spark://host:7077, yarn, "
                "k8s://https://host, local[4]), or of type 'spark_connect' whose host and port "
                "are a Spark Connect server's"
            ) from None
        log.info(
            "sparktorch_ops: no connection %r: the master is spark_conf's spark.master, else %s",
            conn_id,
            FALLBACK_MASTER,
        )
        return SparkConnection(FALLBACK_MASTER)
    if conn.conn_type == CONNECT_CONN_TYPE:
        return _connect_connection(conn_id, conn, log)
    if not conn.host and conn.conn_type == "spark":
        raise ValueError(
            f"conn_id: the connection {conn_id!r} has no host; put the master URL there "
            "(spark://host, yarn, k8s://https://host, local[4])"
        )
    # As SparkSubmitHook: a spark connection's host is the master, else the URI's scheme is.
    if conn.conn_type == "spark" and conn.host and ("://" in conn.host or not conn.port):
        master = conn.host
    else:
        master = f"{conn.conn_type}://{conn.host or ''}"
    master = f"{master}:{conn.port}" if conn.port else master
    return SparkConnection(master, _submit_conf(conn.extra_dejson, log), conn_id)


def _connect_connection(conn_id: str, conn: Any, log: Any) -> SparkConnection:
    """A ``spark_connect`` connection: its Connect URL as the master, its ``spark.*`` extras."""
    if not conn.host:
        raise ValueError(
            f"conn_id: the Spark Connect connection {conn_id!r} has no host; put the Spark "
            "Connect server's host there (and its port, default 15002)"
        )
    extra = conn.extra_dejson or {}
    host = conn.host if "://" in conn.host else f"sc://{conn.host}"
    url = urlparse(f"{host}:{conn.port}" if conn.port else host)
    if url.path:
        raise ValueError(
            f"conn_id: the Spark Connect connection {conn_id!r}: the path {url.path!r} is not "
            "supported in a Spark Connect URL"
        )
    given = {
        "user_id": conn.login or None,
        "token": conn.password or None,
        "use_ssl": extra.get("use_ssl"),
    }
    # quote(safe=""): unlike the provider, a "/" too, which pyspark would take for a path (and
    # refuse the URL, quoting the token in its error).
    params = ";".join(f"{k}={quote(str(v), safe='')}" for k, v in given.items() if v is not None)
    master = urlunparse(("sc", url.netloc, "/", params, "", url.fragment))
    ignored = sorted(key for key in ("token", "user_id") if key in extra)
    if ignored:
        log.warning(
            "sparktorch_ops: the extra's %s of connection %s is ignored: as the Spark provider's "
            "SparkConnectHook does, the token is the connection's password and the user id its "
            "login",
            " and ".join(ignored),
            conn_id,
        )
    return SparkConnection(master, _spark_conf(extra), conn_id)


def session_settings(
    conn_id: str, spark_conf: Mapping[str, Any], *, local_only: bool, app_name: str, log: Any
) -> SparkSettings:
    """The session settings of a task: ``conn_id``'s master and ``spark.*`` extras under the
    task's ``spark_conf``. ``local_only`` (local mode, no input to read): the connection is
    not used (an absent default one is fine).

    Raises:
        MissingConnectionError: ``conn_id`` does not exist (and is not the default).
        ValueError: the connection cannot be read as a Spark master.
        ConfigError: settings that contradict each other (a ``spark.master`` in
            ``spark_conf`` other than the connection's).
    """
    if local_only and conn_id == DEFAULT_CONN_ID:
        # Unused; given, the core warns that local mode does not use it.
        return SparkSettings(master=None, conf=spark_conf, app_name=app_name)
    connection = resolve_connection(conn_id, log)
    if local_only:
        log.info(
            "sparktorch_ops: local_mode=True runs the ranks on this worker without Spark; "
            "connection %r is not used",
            conn_id,
        )
        return SparkSettings(master=None, conf=spark_conf, app_name=app_name)
    if connection.conn_id is not None:
        log.info(
            "sparktorch_ops: Spark master %s from connection %s",
            redact_connect_url(connection.master),
            connection.conn_id,
        )
    conf = {**connection.conf, **spark_conf}
    # Without a connection, a spark.master in spark_conf names the master; a connection's
    # master must not be contradicted (SparkSettings refuses that).
    master = None if connection.conn_id is None and "spark.master" in conf else connection.master
    return SparkSettings(master=master, conf=conf, app_name=app_name)


def mlflow_uri_from_connection(conn_id: str, log: Any) -> str | None:
    """The MLflow tracking URI held by Airflow connection ``conn_id`` (its ``extra``'s
    ``tracking_uri``, else ``schema://host:port`` with ``http`` by default); None when there
    is no such connection (then ``MLFLOW_TRACKING_URI`` or MLflow's default applies)."""
    from airflow.providers.common.compat.sdk import AirflowNotFoundException
    from airflow.sdk import BaseHook

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


def mlflow_tracking_uri(
    uri: str | None, experiment: str | None, conn_id: str, log: Any
) -> str | None:
    """A task's tracking URI: the rendered ``mlflow_tracking_uri``, else (when tracking is on)
    that of connection ``conn_id`` if it exists, else None (``MLFLOW_TRACKING_URI``)."""
    if uri:
        return uri
    if not experiment:
        return None
    return mlflow_uri_from_connection(conn_id, log)
