"""Prefect tests run against a real Prefect API and database: one ``prefect_test_harness()``
for the whole session (it takes 15-30 s to start), results stored under a temporary path."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

RUN_ID = re.compile(r"sparktorch_ops: (sparktorch-[0-9a-f]+) started")


@pytest.fixture(scope="session", autouse=True)
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A temporary Prefect server and database; yields its API URL."""
    from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    storage = tmp_path_factory.mktemp("prefect-results")
    with (
        prefect_test_harness(server_startup_timeout=120),
        temporary_settings({PREFECT_LOCAL_STORAGE_PATH: str(storage)}),
    ):
        yield str(PREFECT_API_URL.value())


def flush_logs() -> None:
    """Send the log records still queued in this process to the API."""
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()


def flow_run_logs(flow_run_id: UUID) -> list[Any]:
    """Every log record of a flow run (its task runs included), read back from the API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    flush_logs()
    with get_client(sync_client=True) as client:
        return list(
            client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                sort=LogSort.TIMESTAMP_ASC,
            )
        )


def run_ids(logs: list[Any]) -> list[str]:
    """The core's run ids announced in the logs, in order (one per launch)."""
    return [m.group(1) for log in logs if (m := RUN_ID.search(log.message))]


def flow_run_artifacts(flow_run_id: UUID) -> dict[str, Any]:
    """The artifacts of a flow run by key (the latest of each), read back from the API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])),
            sort=ArtifactSort.CREATED_DESC,
        )
    by_key: dict[str, Any] = {}
    for artifact in found:
        if artifact.key is not None:
            by_key.setdefault(artifact.key, artifact)
    return by_key


def task_runs(flow_run_id: UUID, count: int = 1) -> list[Any]:
    """The task runs of a flow run, from the API, once ``count`` of them are there in a final
    state: the server records task runs from events, a moment after the flow returned."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + 30
    with get_client(sync_client=True) as client:
        while True:
            runs = list(
                client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
                )
            )
            recorded = len(runs) >= count and all(r.state and r.state.is_final() for r in runs)
            if recorded or time.monotonic() > deadline:
                return runs
            time.sleep(0.2)


@pytest.fixture(scope="session")
def prefect_runner(prefect_api: str) -> Callable[..., Any]:
    """``with prefect_runner(script, args, workdir=...) as served:`` serves a flow script with a
    Prefect runner subprocess against the session's API (``serve_flow_script`` of
    harness/prefect_served.py); tests that use it are e2e."""
    from harness.prefect_served import serve_flow_script

    return functools.partial(serve_flow_script, api_url=prefect_api)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """An empty pipeline state directory (table, held-out split, MLflow store)."""
    path = tmp_path / "state"
    path.mkdir()
    return path
