"""The example retraining flow's configuration: what it shares with the DAG. The flow runs end
to end as a served deployment under the session's Prefect server (test_served.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_flow_and_the_dag_share_state_directory_defaults_and_schedule(
    tmp_path: Path,
) -> None:
    """Both pipelines read $SPARKTORCH_STATE and examples/pipeline.py's defaults and schedule
    (the DAG's side: tests/airflow/test_retrain_dag.py)."""
    probe = (
        "import inspect, json, sys; sys.path.insert(0, 'flows'); import retrain_digits as f; "
        "import pipeline; p = inspect.signature(f.retrain_digits.fn).parameters; "
        "print(json.dumps({'state': p['state'].default, 'defaults': {k: p[k].default for k in "
        "pipeline.DEFAULTS}, 'pipeline': pipeline.DEFAULTS, 'schedule': pipeline.SCHEDULE}))"
    )
    env = {**os.environ, "SPARKTORCH_STATE": str(tmp_path / "shared-state")}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["state"] == str(tmp_path / "shared-state")
    assert found["defaults"] == found["pipeline"]
    assert found["schedule"] == "0 3 * * *"
