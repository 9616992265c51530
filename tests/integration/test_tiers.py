"""The tier markers as a collection sees them: tests land in the tier their directory and
fixtures say (tests/conftest.py), one each. (Every collection of the suite enforces "one tier,
unit only in tests/unit" itself: tier_of raises otherwise.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPORTER = """
TIERS = ("unit", "integration", "e2e")

def pytest_collection_finish(session):
    for item in session.items:
        tiers = [m.name for m in item.iter_markers() if m.name in TIERS]
        print("TIER", item.nodeid, ",".join(tiers))
"""


def collected_tiers(tmp_path: Path, nodeids: list[str]) -> dict[str, str]:
    """The tier markers of ``nodeids`` in a collection of them alone (a fresh process)."""
    (tmp_path / "tier_reporter.py").write_text(REPORTER)
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tier_reporter", *nodeids],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line[5:].rsplit(" ", 1) for line in proc.stdout.splitlines() if line[:5] == "TIER "]
    return {nodeid: tiers for nodeid, tiers in lines}


def test_every_test_has_one_tier_from_its_directory_and_fixtures(tmp_path: Path) -> None:
    expected = {
        # its directory
        "tests/unit/test_spec.py::test_defaults_match_pyspark": "unit",
        # a shared service fixture, directly or through a module fixture (connect)
        "tests/airflow/test_real_scheduler.py::test_the_example_dag_runs_on_its_schedule": "e2e",
        "tests/integration/test_connect.py::test_timeout_stops_the_ranks": "e2e",
        "tests/integration/test_connect.py::test_a_connect_server_that_dies_mid_run_fails_it": (
            "e2e"
        ),
        "tests/prefect/test_served.py::test_served_retrain_digits_runs_a_deployment_to_completion": (
            "e2e"
        ),
        # a whole pipeline under dag.test() / in process
        "tests/airflow/test_retrain_dag.py::test_a_worse_model_is_registered_but_the_champion_stays": (
            "e2e"
        ),
        # by mark: a cluster of its own, a transfer at the benchmark's size
        "tests/integration/test_cluster.py::test_spark_encryption_puts_the_channel_under_tls": (
            "e2e"
        ),
        "tests/integration/test_barrier_mode.py::test_a_256_mib_value_from_an_executor_arrives_whole": (
            "e2e"
        ),
        # the shared session, dag.test() of a test DAG, the Prefect harness
        "tests/integration/test_local_mode.py::test_a_40_mib_value_from_rank_0_arrives_whole": (
            "integration"
        ),
        "tests/airflow/test_operator.py::test_templated_fields_are_rendered": "integration",
        "tests/prefect/test_task.py::"
        "test_a_retry_resumes_from_the_last_checkpoint_into_the_same_mlflow_run": "integration",
    }
    tiers = collected_tiers(tmp_path, list(expected))
    assert tiers == expected  # one tier each, the expected one
