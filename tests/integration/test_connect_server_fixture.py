"""The ``connect_server`` fixture: a real Spark Connect server that a Connect client can use.

The client runs in a subprocess, so this test leaves no Connect state (the client's default
session, ``SPARK_CONNECT_MODE_ENABLED``) in the test process.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.connect_server import ConnectServer

CLIENT = """\
import sys
import psutil
from pyspark.sql import SparkSession
spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
try:
    count = spark.range(3).count()
    javas = [p for p in psutil.Process().children(recursive=True) if p.name() == "java"]
    print(type(spark).__module__, count, len(javas))
finally:
    spark.stop()
"""


def test_a_connect_client_runs_a_job(connect_server: ConnectServer) -> None:
    assert connect_server.url == f"sc://127.0.0.1:{connect_server.port}"
    assert connect_server.process.poll() is None
    assert os.getpgid(connect_server.process.pid) == connect_server.process.pid  # own group
    assert any(p.name() == "java" for p in connect_server.group_members())
    client = subprocess.run(
        [sys.executable, "-c", CLIENT, connect_server.url],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert client.returncode == 0, f"{client.stderr[-3000:]}\nserver log:\n{connect_server.log()}"
    # A Connect session, the job's count, and no JVM started by the client.
    assert client.stdout.split() == ["pyspark.sql.connect.session", "3", "0"]
