"""The run directory of a detached run: what its driver writes, what a handle reads, and the
clear errors for directories that are not usable (pure file I/O, no run)."""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import pytest

from sparktorch_ops import ConfigError
from sparktorch_ops.detached import RunDirectoryError, RunHandle
from sparktorch_ops.detached.rundir import LOST_AFTER_S, RunDirectory, state_of


def made(path: Path, training: str = "training-1") -> RunDirectory:
    directory = RunDirectory(path)
    directory.create({"training_id": training, "mode": "local"}, pickle.dumps("job"))
    return directory


def test_a_run_directory_keeps_state_streams_and_end_for_any_reader(tmp_path: Path) -> None:
    directory = made(tmp_path / "run")
    handle = RunHandle(tmp_path / "run")
    assert handle.training_id == "training-1" and handle.status().state == "submitted"
    directory.write_status({"state": "running", "heartbeat": time.time(), "progress": 0.5})
    directory.append("logs", [{"line": "a"}, {"line": "b"}], 1)
    directory.append("logs", [{"line": "c"}], 2)
    assert list(handle.logs()) == ["a", "b", "c"]
    assert [record["line"] for _, record in directory.read("logs", after=1)] == ["c"]
    status = handle.status()
    assert (status.state, status.progress, status.done) == ("running", 0.5, False)
    directory.write_end(
        {"state": "failed", "error": "rank 1 failed"}, error=pickle.dumps(ValueError("x"))
    )
    assert handle.status().state == "failed" and handle.status().error == "rank 1 failed"
    with pytest.raises(ValueError, match="x"):
        handle.wait(timeout=1)
    # Whole files are never left half-written: no temporary file stays behind.
    assert not [p for p in (tmp_path / "run").rglob(".writing-*")]


def test_a_driver_without_a_heartbeat_is_lost() -> None:
    now = time.time()
    assert state_of({"state": "running", "heartbeat": now}, now) == "running"
    assert state_of({"state": "running", "heartbeat": now - LOST_AFTER_S - 1}, now) == "lost"
    assert state_of({"state": "succeeded", "heartbeat": 0.0}, now) == "succeeded"


def test_a_cancel_is_a_request_in_the_directory(tmp_path: Path) -> None:
    directory = made(tmp_path / "run")
    assert directory.cancel_requested() is None
    RunHandle(tmp_path / "run").cancel("stop now")
    assert directory.cancel_requested() == "stop now"


def test_bad_run_directories_are_clear_config_errors_naming_run_dir(tmp_path: Path) -> None:
    def refused(path: Path | str, match: str) -> None:
        with pytest.raises(RunDirectoryError, match=match) as info:
            RunHandle(path)
        assert isinstance(info.value, ConfigError) and info.value.argument == "run_dir"
        assert pickle.loads(pickle.dumps(info.value)).problem == info.value.problem

    refused(tmp_path / "missing", "does not exist")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("not a run")
    refused(tmp_path / "foreign", r"is not a run directory \(no run.json\)")
    corrupt = made(tmp_path / "corrupt")
    Path(corrupt.location, "run.json").write_text("{not json")
    refused(tmp_path / "corrupt", "corrupt run.json")
    newer = made(tmp_path / "newer")
    record = json.loads(Path(newer.location, "run.json").read_text())
    Path(newer.location, "run.json").write_text(json.dumps({**record, "format": 99}))
    refused(tmp_path / "newer", "format 99")
    theirs = made(tmp_path / "theirs")
    os.chown(theirs.location, 65534, 65534)
    refused(tmp_path / "theirs", "belongs to .*another user's run")
    refused("  ", "is empty")
    # A directory of another training is never taken over.
    made(tmp_path / "taken", "training-a")
    with pytest.raises(RunDirectoryError, match="holds the training training-a, not training-b"):
        made(tmp_path / "taken", "training-b")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(RunDirectoryError, match="not empty and holds no run"):
        made(tmp_path / "busy")


def test_the_cluster_deploy_mode_command_runs_the_detached_driver_on_yarn_or_kubernetes() -> None:
    """Spark runs Python drivers in cluster deploy mode on YARN and Kubernetes only: the
    exact spark-submit that runs the run's detached driver there, and clear refusals where
    it cannot (a standalone master, a run directory the cluster cannot reach)."""
    from sparktorch_ops.detached.submit import cluster_submit_argv

    argv = cluster_submit_argv(
        "hdfs:///runs/n1", "yarn", {"spark.executor.memory": "4g"}, "/tmp/sparktorch_ops.zip"
    )
    driver = str(Path(__file__).parents[2] / "sparktorch_ops" / "detached" / "driver.py")
    assert argv == [
        "spark-submit", "--master", "yarn", "--deploy-mode", "cluster",
        "--conf", "spark.executor.memory=4g",
        "--py-files", "/tmp/sparktorch_ops.zip", driver, "hdfs:///runs/n1",
    ]  # fmt: skip
    k8s = cluster_submit_argv("s3a://b/runs/n1", "k8s://https://api:6443", {}, "/z.zip")
    assert k8s[:5] == [
        "spark-submit",
        "--master",
        "k8s://https://api:6443",
        "--deploy-mode",
        "cluster",
    ]
    with pytest.raises(ConfigError, match="YARN and Kubernetes only") as info:
        cluster_submit_argv("hdfs:///runs/n1", "spark://head:7077", {}, "/z.zip")
    assert info.value.argument == "spark_master"
    with pytest.raises(ConfigError, match="storage it reaches") as info:
        cluster_submit_argv("/local/runs/n1", "yarn", {}, "/z.zip")
    assert info.value.argument == "run_dir"
