"""Spark: the one session factory, master URLs, settings, job tags, UI URL.

pyspark is imported only here, and only when a session is used. Everything that builds, reuses
or stops a SparkSession for sparktorch_ops (the distributor, the Airflow operator, the Prefect
block, the CLI) goes through :func:`get_session` and :func:`stop_session`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparktorch_ops.errors import ConfigError
from sparktorch_ops.spark import jvm_log

if TYPE_CHECKING:
    from pyspark import SparkContext


#: The conf key read for a History Server link (besides YARN's own setting).
HISTORY_SERVER_CONF = "spark.sparktorch.historyServer.url"
DEFAULT_APP_NAME = "sparktorch-ops"

MASTER_FORMS = (
    "local, local[N], local[*], local[N,F], local-cluster[N,C,M], spark://HOST:PORT, yarn, "
    "k8s://HOST:PORT, mesos://HOST:PORT, sc://HOST:PORT (Spark Connect)"
)
_MASTER_PATTERNS = (
    ("local", re.compile(r"local(?:\[(?:\*|[1-9]\d*)(?:,\s*[1-9]\d*)?\])?")),
    (
        "local-cluster",
        re.compile(r"local-cluster\[\s*([1-9]\d*)\s*,\s*[1-9]\d*\s*,\s*[1-9]\d*\s*\]"),
    ),
    ("standalone", re.compile(r"spark://[^\s/:,]+(?::\d+)?(?:,[^\s/:,]+(?::\d+)?)*/?")),
    ("yarn", re.compile(r"yarn")),
    ("k8s", re.compile(r"k8s://(?:https?://)?[^\s/]+(?:/\S*)?")),
    ("mesos", re.compile(r"mesos://[^\s/]+(?:/\S*)?")),
    # Spark Connect: sc://host[:port][/;param=value;...] (token, use_ssl, user_id, ...)
    ("connect", re.compile(r"sc://[^\s/;]+(?:/?(?:;[^\s;=]+=[^\s;]*)*)")),
)
# Static SQL settings: fixed when the first session starts, like every non-SQL setting (the
# master, the app name, driver/executor/scheduler settings). Other spark.sql.* settings are
# runtime settings that a running session still takes.
_STATIC_SQL_CONF = frozenset(
    {
        "spark.sql.warehouse.dir",
        "spark.sql.catalogImplementation",
        "spark.sql.extensions",
        "spark.sql.hive.metastore.version",
        "spark.sql.hive.metastore.jars",
    }
)


@dataclass(frozen=True)
class Master:
    """A parsed Spark master URL.

    Attributes:
        url: the URL as given (stripped).
        kind: ``local``, ``local-cluster``, ``standalone``, ``yarn``, ``k8s``, ``mesos`` or
            ``connect`` (``sc://``).
        executors: how many executors the master itself fixes (``local-cluster[N,..]``).
    """

    url: str
    kind: str
    executors: int | None = None

    @property
    def in_process(self) -> bool:
        """Whether everything runs in the driver's JVM (``local``, ``local[4]``...)."""
        return self.kind == "local"

    @property
    def is_connect(self) -> bool:
        """Whether this is a Spark Connect URL (``sc://``): a remote session, no JVM here."""
        return self.kind == "connect"


def parse_master(master: object, argument: str = "master") -> Master:
    """Parse a Spark master URL (no connection is made).

    Raises:
        ConfigError: naming ``argument``: not a string, or not a form Spark accepts.
    """
    if not isinstance(master, str):
        raise ConfigError(argument, f"must be a Spark master URL (str), got {master!r}")
    url = master.strip()
    for kind, pattern in _MASTER_PATTERNS:
        match = pattern.fullmatch(url)
        if match:
            executors = int(match.group(1)) if kind == "local-cluster" else None
            return Master(url, kind, executors)
    raise ConfigError(
        argument,
        f"{redact_connect_url(repr(master))} is not a Spark master URL; expected one of: "
        f"{MASTER_FORMS}",
    )


def validate_master(master: object, argument: str = "master") -> str:
    """A master URL, checked and stripped (see :func:`parse_master`)."""
    return parse_master(master, argument).url


def validate_conf(conf: object, argument: str = "spark_conf") -> dict[str, str]:
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


def is_static_conf(key: str) -> bool:
    """Whether a setting is fixed once the SparkContext runs (cannot change on reuse)."""
    return not key.startswith("spark.sql.") or key in _STATIC_SQL_CONF


@dataclass(frozen=True)
class SparkSettings:
    """Where a run's Spark session comes from: a session, or a master URL and conf.

    ``spark.master`` may be given in ``conf`` instead of ``master``; both at once must agree.

    Attributes:
        master: the master URL; None leaves it to the environment (``spark-defaults.conf``,
            ``pyspark --master``), as ``SparkSession.builder`` does.
        conf: Spark settings for a session started here (also checked against a reused one).
        app_name: the application name of a session started here.
        session: an existing session to use as it is.
        stop_created_session: stop (after the run) a session that was started for it.
    """

    master: str | None = None
    conf: Mapping[str, str] = field(default_factory=dict)
    app_name: str = DEFAULT_APP_NAME
    session: Any = None
    stop_created_session: bool = True

    def __post_init__(self) -> None:
        conf = validate_conf(self.conf, "spark_conf")
        master = self.master
        conf_master = conf.pop("spark.master", None)
        if master is not None:
            master = parse_master(master, "spark_master").url
        if conf_master is not None:
            conf_master = parse_master(conf_master, "spark_conf").url
            if master is not None and conf_master != master:
                raise ConfigError(
                    "spark_conf",
                    f"spark.master={redact_connect_url(repr(conf_master))} contradicts the "
                    f"master {redact_connect_url(repr(master))} (from the "
                    "connection, block or spark_master argument); give the master in one place",
                )
            master = conf_master
        if not isinstance(self.app_name, str) or not self.app_name.strip():
            raise ConfigError("app_name", f"must be a non-empty str, got {self.app_name!r}")
        object.__setattr__(self, "master", master)
        object.__setattr__(self, "conf", conf)

    @property
    def configured(self) -> bool:
        """Whether a master or conf was asked for (settings a local-mode run does not use)."""
        return self.master is not None or bool(self.conf)


@dataclass
class SessionHandle:
    """A session in use by a run, and whether it was started for the run.

    Attributes:
        session: the SparkSession.
        created: True when :func:`get_session` started it.
        jvm_started: True when starting it also started this process's JVM.
        keys: the settings it was started with (Java system properties to clear on stop).
        stop_when_done: stop it after the run.
    """

    session: Any
    created: bool
    jvm_started: bool = False
    keys: tuple[str, ...] = ()
    stop_when_done: bool = False


def is_connect_session(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect session (no SparkContext behind it)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def active_session() -> Any:
    """The active (or default) session, without starting one or importing pyspark.

    A classic session wins over a Spark Connect one in the same process, unless pyspark is in
    Connect mode (``SPARK_CONNECT_MODE_ENABLED``, ``SPARK_REMOTE``), as pyspark's own
    ``getActiveSession`` decides. A Connect session is looked up only when the Connect client
    is already imported, and never through a JVM.
    """
    if sys.modules.get("pyspark") is None:
        return None
    from pyspark import SparkContext
    from pyspark.sql import SparkSession
    from pyspark.sql.utils import is_remote

    connect = _active_connect_session()
    if connect is not None and (SparkContext._active_spark_context is None or is_remote()):
        return connect
    if SparkContext._active_spark_context is None:
        return None
    return SparkSession.getActiveSession() or SparkSession._instantiatedSession


def _active_connect_session() -> Any:
    module = sys.modules.get("pyspark.sql.connect.session")
    if module is None:
        return None
    session = module.SparkSession.getActiveSession() or module.SparkSession._default_session
    return None if session is None or session.is_stopped else session


def get_session(settings: SparkSettings, log: Any = None) -> SessionHandle:
    """The session a run uses: the given one, the active one, else a new one from settings.

    A process has one SparkContext: when one is running it is reused, settings that cannot
    apply to it are named in a warning, and runtime SQL settings are applied to it. A session
    started here has Spark's console progress bar off and, on an in-process master, the driver
    on loopback; when it starts the JVM, the JVM's console output (log4j lines, its own
    warnings, Python workers' prints) becomes records of ``log`` at Spark's levels instead of
    raw stderr (:mod:`sparktorch_ops.spark.jvm_log`), and stays routed to the latest run's logger.

    Raises:
        ConfigError: the session could not start.
    """
    log = log or logging.getLogger("sparktorch_ops")
    if settings.session is not None:
        return SessionHandle(settings.session, created=False)
    if settings.master is not None and parse_master(settings.master).is_connect:
        # A client may hold any number of Connect sessions: the one asked for, never another.
        return _connect_session(settings, log)
    with _SESSIONS.lock:  # one run at a time decides whether to start the process's session
        active = active_session()
        if active is not None:
            _reuse(active, settings, log)
            _SESSIONS.join(active)
            return SessionHandle(active, created=False)
        handle = _start_session(settings, log)
        _SESSIONS.join(handle.session)
        return handle


def _start_session(settings: SparkSettings, log: Any) -> SessionHandle:
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    jvm_started = SparkContext._gateway is None
    conf = {"spark.ui.showConsoleProgress": "false", **settings.conf}
    if settings.master is not None and parse_master(settings.master).in_process:
        conf.setdefault("spark.driver.host", "127.0.0.1")
    builder = SparkSession.builder.appName(settings.app_name)
    if settings.master is not None:
        builder = builder.master(settings.master)
    for key, value in conf.items():
        builder = builder.config(key, value)
    log.info(
        "sparktorch_ops: starting a SparkSession (master %s)",
        settings.master or "from the environment",
    )
    try:
        if jvm_started and "PYSPARK_GATEWAY_PORT" not in os.environ:
            # The JVM's console output becomes log records, not raw stderr (which Airflow's
            # task supervisor logs at ERROR); spark-submit gets the same --conf as the builder's.
            gateway = jvm_log.launch_gateway(
                (key, str(value)) for key, value in builder._options.items()
            )
            SparkContext._ensure_initialized(gateway=gateway)
        session = builder.getOrCreate()
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(
            "spark_master",
            f"could not start a Spark session (master {settings.master!r}): "
            f"{type(exc).__name__}: {first}",
        ) from exc
    sc = session.sparkContext
    log.info(
        "sparktorch_ops: started Spark application %s (master %s)", sc.applicationId, sc.master
    )
    return SessionHandle(
        session,
        created=True,
        jvm_started=jvm_started,
        keys=("spark.master", "spark.app.name", *conf),
        stop_when_done=settings.stop_created_session,
    )


def _connect_session(settings: SparkSettings, log: Any) -> SessionHandle:
    """A Spark Connect session to ``settings.master`` (a gRPC client: no JVM here); conf
    goes to the server's session as runtime settings."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    url = str(settings.master)
    log.info("sparktorch_ops: connecting to Spark Connect at %s", redact_connect_url(url))
    channel = _channel(url)
    _check_reachable(_endpoint(channel))
    builder = ConnectSession.builder.remote(url)
    for key, value in settings.conf.items():
        builder = builder.config(key, value)
    try:
        session = builder.create()  # getOrCreate would return a session to any server
        version = session.version  # the first call to the server: fails here if unreachable
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        first = redact_connect_url(first).replace(channel.token or "\0", "***")
        raise ConfigError(
            "spark_master",
            f"could not open a Spark Connect session at {redact_connect_url(url)}: "
            f"{type(exc).__name__}: {first}",
        ) from None  # pyspark's own error may quote the token
    log.info("sparktorch_ops: connected to Spark %s over Spark Connect", version)
    return SessionHandle(session, created=True, stop_when_done=settings.stop_created_session)


_CONNECT_PROBE_S = 10.0


def _channel(url: str) -> Any:
    """pyspark's own reading of a Connect URL (host, port, token, ...).

    Raises:
        ConfigError: naming spark_master, when pyspark refuses the URL (the token hidden).
    """
    from pyspark.sql.connect.client import DefaultChannelBuilder

    try:
        return DefaultChannelBuilder(url)
    except ValueError as exc:
        raise ConfigError("spark_master", redact_connect_url(str(exc))) from None


def _endpoint(channel: Any) -> tuple[str, int]:
    """The host and port of a pyspark channel builder (its port defaults to 15002)."""
    return str(channel.host).strip("[]"), int(str(channel.endpoint).rsplit(":", 1)[1])


def _check_reachable(endpoint: tuple[str, int]) -> None:
    """Fail fast on a Connect server that cannot be reached: pyspark's client retries a
    refused connection with backoff for many minutes before it gives up.

    Raises:
        ConfigError: naming spark_master, when no TCP connection opens within 10 s.
    """
    host, port = endpoint
    try:
        socket.create_connection(endpoint, timeout=_CONNECT_PROBE_S).close()
    except OSError as exc:
        raise ConfigError(
            "spark_master",
            f"cannot reach the Spark Connect server at {host}:{port} ({exc}); check the URL "
            "(sc://HOST:PORT, default port 15002) and that the server runs",
        ) from None


def redact_connect_url(url: str) -> str:
    """A Connect URL (or text holding one) fit for logs: the ``token`` parameter's value
    hidden."""
    return re.sub(r"(;token=)[^;\s'\"]*", r"\1***", url)


def _reuse(session: Any, settings: SparkSettings, log: Any) -> None:
    if is_connect_session(session):
        log.info("sparktorch_ops: using the active Spark Connect session")
        for key, value in settings.conf.items():
            session.conf.set(key, value)
        return
    sc = session.sparkContext
    log.info(
        "sparktorch_ops: reusing the SparkContext already running in this process "
        "(master %s, app %s)",
        sc.master,
        sc.applicationId,
    )
    if settings.master is not None and settings.master != sc.master:
        log.warning(
            "sparktorch_ops: master %r is not used: a process has one SparkContext, and the "
            "running one uses %r",
            redact_connect_url(settings.master),
            sc.master,
        )
    ignored = []
    for key, value in settings.conf.items():
        if conf_value(sc, key) == value:
            continue
        if is_static_conf(key):
            ignored.append(key)
        else:
            session.conf.set(key, value)
    if ignored:
        log.warning(
            "sparktorch_ops: Spark settings that cannot apply to the running SparkContext "
            "(fixed when it started): %s",
            ", ".join(sorted(ignored)),
        )


class _SessionUsers:
    """Which runs use the process's classic session now: the last one to leave stops it if
    a run started it to be stopped (runs in several threads share one SparkContext)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._users: dict[int, int] = {}  # id(session) -> runs using it
        self._to_stop: dict[int, SessionHandle] = {}  # id(session) -> the handle that started it

    def join(self, session: Any) -> None:
        self._users[id(session)] = self._users.get(id(session), 0) + 1

    def leave(self, handle: SessionHandle) -> SessionHandle | None:
        """``handle``'s run is done with its session: the handle to stop it with, if it was
        the last user and a run asked for the stop; else None."""
        key = id(handle.session)
        if handle.created and handle.stop_when_done:
            self._to_stop[key] = handle
        users = self._users.get(key, 1) - 1
        if users > 0:
            self._users[key] = users
            return None
        self._users.pop(key, None)
        return self._to_stop.pop(key, None)


_SESSIONS = _SessionUsers()


def stop_session(handle: SessionHandle) -> None:
    """A run is done with its session: stop it when :func:`get_session` started it for a run
    that asked for the stop and no other run uses it; leave any other alone.

    pyspark starts its JVM with the first session's settings as Java system properties, which
    every later SparkContext of the process would inherit (``airflow dags test`` runs every
    task in one process): a session that started the JVM takes its settings away with it.
    """
    if is_connect_session(handle.session):  # a session of its own per run
        if not (handle.created and handle.stop_when_done):
            return
        if connect_server_reachable(handle.session):
            handle.session.stop()  # releases the server-side session; nothing runs here
        else:  # stop() would retry its release call for minutes
            handle.session.client.close()
        return
    with _SESSIONS.lock:
        starter = _SESSIONS.leave(handle)
        if starter is None:
            return
        sc = starter.session.sparkContext
        jvm = sc._jvm
        starter.session.stop()
        if starter.jvm_started and jvm is not None:
            for key in starter.keys:
                try:
                    jvm.java.lang.System.clearProperty(key)
                except Exception:  # the JVM may be going away too
                    pass


@contextlib.contextmanager
def jobs_of_run(session: Any, run_id: str, log: Any) -> Iterator[None]:
    """While the block runs, the Spark jobs this thread submits are run ``run_id``'s (its job
    group) and the JVM's lines about them go to ``log``. A Connect session's JVM is on the
    server: nothing to route."""
    if is_connect_session(session):
        yield
        return
    sc = session.sparkContext
    sc.setJobGroup(run_id, f"sparktorch_ops {run_id}")
    jvm_log.attach(run_id, log, sc.statusTracker())
    try:
        yield
    finally:
        jvm_log.detach(run_id)


def sql_functions(dataframe: Any) -> Any:
    """``pyspark.sql.functions`` for a DataFrame: the Connect client's own module for a Spark
    Connect DataFrame (the generic module builds JVM columns in a process that is not in
    Connect mode, e.g. one that also runs a classic session)."""
    if type(dataframe).__module__.startswith("pyspark.sql.connect"):
        from pyspark.sql.connect import functions as connect_functions

        return connect_functions
    from pyspark.sql import functions

    return functions


def conf_source(session: Any) -> Any:
    """What conf readers here take: a classic session's SparkContext, or a Spark Connect
    session itself (it has none)."""
    return session if is_connect_session(session) else session.sparkContext


def conf_value(sc: SparkContext | Any, key: str) -> str | None:
    """A Spark conf value, or None; ``sc`` may also be a Spark Connect session (the server's
    session conf, which holds the application's conf too)."""
    if is_connect_session(sc):
        connect: Any = sc
        value = connect.conf.get(key, None)
        return None if value is None else str(value)
    # The context's own conf: sc.getConf() would copy every setting over py4j, each call.
    value = sc._conf.get(key)
    return None if value is None else str(value)


def conf_true(sc: SparkContext, key: str) -> bool:
    """Whether a boolean Spark conf is on."""
    return (conf_value(sc, key) or "false").strip().lower() == "true"


def driver_gpus(spark: Any) -> list[str] | None:
    """The driver's GPU addresses from ``spark.driver.resource.gpu``, if the session has any."""
    if spark is None or is_connect_session(spark):  # a Connect client holds no Spark GPUs
        return None
    gpu = spark.sparkContext.resources.get("gpu")
    return None if gpu is None else list(gpu.addresses)


def task_resources(conf_value: Callable[[str], str | None]) -> tuple[int, float | None]:
    """``spark.task.cpus`` (default 1) and ``spark.task.resource.gpu.amount`` (None when
    unset) from a conf lookup: a session's conf, or the settings a session would start with.

    Raises:
        ConfigError: a value that is not a number, naming its key.
    """
    cpus = conf_value("spark.task.cpus")
    gpus = conf_value("spark.task.resource.gpu.amount")
    try:
        task_cpus = int(cpus) if cpus is not None else 1
    except ValueError:
        raise ConfigError("spark.task.cpus", f"is not an integer: {cpus!r}") from None
    try:
        gpu_amount = float(gpus) if gpus is not None else None
    except ValueError:
        raise ConfigError("spark.task.resource.gpu.amount", f"is not a number: {gpus!r}") from None
    return task_cpus, gpu_amount


def task_gpu_amount(sc: SparkContext) -> float | None:
    """``spark.task.resource.gpu.amount`` as a number, or None when unset."""
    return task_resources(lambda key: conf_value(sc, key))[1]


ENCRYPTION_CONF = ("spark.ssl.enabled", "spark.network.crypto.enabled")


def encryption_enabled(sc: SparkContext) -> tuple[str, ...]:
    """Which of Spark's encryption settings are on (the channel then uses TLS)."""
    return tuple(key for key in ENCRYPTION_CONF if conf_true(sc, key))


def ui_url(sc: SparkContext | Any) -> str | None:
    """The History Server page of this application when one is configured, else the live UI
    (unknown to a Spark Connect client: None)."""
    if is_connect_session(sc):
        return None
    history = conf_value(sc, "spark.yarn.historyServer.address") or conf_value(
        sc, HISTORY_SERVER_CONF
    )
    if history:
        base = history if "://" in history else f"http://{history}"
        return f"{base.rstrip('/')}/history/{sc.applicationId}/jobs/"
    url: str | None = sc.uiWebUrl
    return url


def app_id(sc: SparkContext | Any) -> str | None:
    """The Spark application's id (a Connect session reads it from the server's conf)."""
    if is_connect_session(sc):
        return conf_value(sc, "spark.app.id")
    return str(sc.applicationId)


def master_of(sc: SparkContext | Any) -> str | None:
    """The master URL the application runs on (for a Connect session: the server's own)."""
    if is_connect_session(sc):
        return conf_value(sc, "spark.master")
    return str(sc.master)


def connect_endpoint(session: Any) -> tuple[str, int]:
    """The host and port a Spark Connect session talks to (pyspark keeps a session's channel
    builder private, and a session the caller made comes without its URL)."""
    return _endpoint(session.client._builder)


def connect_server_reachable(session: Any, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the session's Connect server opens (a liveness check:
    pyspark's client retries for many minutes when its server is gone)."""
    try:
        socket.create_connection(connect_endpoint(session), timeout=timeout).close()
        return True
    except OSError:
        return False


def client_address_toward_server(session: Any) -> str:
    """Spark Connect: this machine's address on the route to the Connect server (the
    executors are taken to be near it). No packet is sent: a UDP socket's ``connect`` only
    picks the route. Loopback when the server is on this machine."""
    host, port = connect_endpoint(session)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def driver_host(sc: SparkContext) -> str:
    """The address executors reach the driver at (``spark.driver.host``)."""
    return conf_value(sc, "spark.driver.host") or "127.0.0.1"
