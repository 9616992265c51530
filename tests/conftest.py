"""Shared fixtures (one local[2] SparkSession per test session, a Spark standalone cluster, a
Spark Connect server) and the tiers: every test gets exactly one of the ``unit``,
``integration`` and ``e2e`` markers, from its directory and the fixtures it uses (see
tests/README.md), and the summary prints each tier's wall time.

Nothing here imports pyspark, Airflow or Prefect at import time: the unit tier
(``tests/unit``) runs without them. The fixtures import what they need when first used.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.support.cluster import Cluster
    from tests.support.connect_server import ConnectServer

pytest_plugins = ["tests.support.time_budget"]  # --time-budget, which scripts/test.sh passes

ROOT = Path(__file__).resolve().parents[1]
UNIT_DIR = ROOT / "tests" / "unit"
TIERS = ("unit", "integration", "e2e")
# A test that uses one of these fixtures, directly or through another fixture, is e2e: each
# starts real services of its own (clusters, servers, schedulers) or a whole pipeline run.
E2E_FIXTURES = frozenset(
    {
        "standalone_cluster",  # a Spark standalone master and workers
        "two_hosts",  # a standalone cluster across network namespaces
        "connect_server",  # a Spark Connect server
        "doomed_connect_server",  # the Connect server, for a test that kills it
        "doomed_standalone_cluster",  # the standalone cluster, for a test that kills a worker
        "airflow_services",  # Airflow's scheduler, DAG processor and API server
        "prefect_runner",  # a Prefect runner serving deployments (flow.serve)
        "mlflow_server",  # an MLflow tracking server
        "example_dag_runs",  # the example DAG run end to end (the flow's: a served run)
    }
)
# Marks that say a test is e2e where no fixture can: it starts a cluster in a driver process of
# its own (one SparkContext per process), or moves data at the benchmarks' size.
E2E_MARKERS = frozenset({"cluster", "large_transfer"})

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The JVMs the tests start: tests/support/spark_conf/spark-defaults.conf says why. The
# standalone master and workers take their flags from SPARK_DAEMON_JAVA_OPTS.
os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "tests" / "support" / "spark_conf"))
os.environ.setdefault("SPARK_DAEMON_JAVA_OPTS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
# py4j logs at INFO from __del__ at interpreter exit, after pytest closed its streams.
logging.getLogger("py4j").setLevel(logging.WARNING)


def tier_of(item: pytest.Item) -> str:
    """The tier of a collected test: an explicit tier marker, else its directory (unit), else
    what it uses (e2e), else integration."""
    explicit = [name for name in TIERS if item.get_closest_marker(name) is not None]
    if len(explicit) > 1:
        raise pytest.UsageError(f"{item.nodeid} is marked with several tiers: {explicit}")
    if explicit:
        return explicit[0]
    if item.path.resolve().is_relative_to(UNIT_DIR):
        return "unit"
    fixtures = set(getattr(item, "fixturenames", ()))
    marks = {mark.name for mark in item.iter_markers()}
    if fixtures & E2E_FIXTURES or marks & E2E_MARKERS:
        return "e2e"
    return "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Tests that kill (part of) a shared service go last.
    items.sort(
        key=lambda item: any(f.startswith("doomed_") for f in getattr(item, "fixturenames", ()))
    )
    for item in items:
        tier = item.stash[TIER_KEY] = tier_of(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "unit" and not item.path.resolve().is_relative_to(UNIT_DIR):
            raise pytest.UsageError(f"{item.nodeid}: unit tests live in tests/unit")


TIER_KEY = pytest.StashKey[str]()  # each item's tier, decided once at collection
_tier_seconds: dict[str, float] = defaultdict(float)
_tier_tests: dict[str, set[str]] = defaultdict(set)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # Setup, call and teardown together: a shared fixture's start counts for the first test
    # that needs it, its stop for the last, so the tiers add up to the session's wall time.
    started = time.monotonic()
    try:
        return (yield)
    finally:
        tier = item.stash.get(TIER_KEY, "integration")
        _tier_seconds[tier] += time.monotonic() - started
        _tier_tests[tier].add(item.nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _tier_tests:
        return
    terminalreporter.section("wall time per tier")
    for tier in TIERS:
        if tier in _tier_tests:
            terminalreporter.write_line(
                f"{tier:<12} {len(_tier_tests[tier]):>4} tests  {_tier_seconds[tier]:8.1f} s"
            )


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """A local[2] SparkSession on loopback, shared by the whole test session."""
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("sparktorch-ops-tests")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.ui.enabled", "true")
        .config("spark.ui.port", "0")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def standalone_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A Spark standalone master and 2 workers (1 core each) on 127.0.0.1, free ports."""
    from tests.support import cluster as cluster_support

    with cluster_support.start_cluster(tmp_path_factory.mktemp("spark-cluster"), workers=2) as c:
        yield c


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    """A Spark Connect server on ``local[2]`` (its own JVM and Python workers), 127.0.0.1, a
    free port; ``connect_server.url`` is its ``sc://`` address.

    In this process, connect with ``pyspark.sql.connect.session.SparkSession.builder``:
    ``pyspark.sql.SparkSession.builder.remote(...)`` refuses while the classic ``spark``
    fixture runs, and otherwise sets ``SPARK_CONNECT_MODE_ENABLED`` for the whole process.
    Its Python workers run an interpreter with torch and pyspark whose own sparktorch_ops is
    broken (``tests/support/worker_env.py``): every run over Connect trains with the copy the
    client ships.
    """
    from harness.procs import measuring_coverage
    from tests.support import connect_server as connect_support
    from tests.support import worker_env

    directory = tmp_path_factory.mktemp("spark-connect")
    python = worker_env.build(
        directory / "executor-python", broken=True, coverage=measuring_coverage()
    )
    with connect_support.running_connect_server(directory, executor_python=python) as s:
        yield s


@pytest.fixture
def doomed_standalone_cluster(standalone_cluster: Cluster) -> Cluster:
    """The session's standalone cluster, for a test that kills one of its workers: such tests
    run after every other test (``pytest_collection_modifyitems``)."""
    return standalone_cluster


@pytest.fixture
def doomed_connect_server(connect_server: ConnectServer) -> ConnectServer:
    """The session's Connect server, for a test that kills it: such tests run after every
    other test (``pytest_collection_modifyitems``), so nothing needs the server after them and
    no second server has to start."""
    return connect_server
