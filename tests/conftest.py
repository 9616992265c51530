"""Shared fixtures: one local[2] SparkSession per test session, a Spark standalone cluster and
a Spark Connect server.

Nothing here imports pyspark, Airflow or Prefect at import time: the unit tier
(``tests/unit``) runs without them. The fixtures import what they need when first used.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.support.cluster import Cluster
    from tests.support.connect_server import ConnectServer

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# py4j logs at INFO from __del__ at interpreter exit, after pytest closed its streams.
logging.getLogger("py4j").setLevel(logging.WARNING)


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
    """
    from tests.support import connect_server as connect_support

    with connect_support.running_connect_server(tmp_path_factory.mktemp("spark-connect")) as s:
        yield s
