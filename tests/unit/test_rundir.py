"""The run directory of a detached run: what its driver writes, what a handle reads, and the
clear errors for directories that are not usable (pure file I/O, no run)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest

from sparktorch_ops import ConfigError
from sparktorch_ops.detached import RunDirectoryError, RunHandle
from sparktorch_ops.detached.rundir import LOST_AFTER_S, RunDirectory, state_of
from sparktorch_ops.errors import SparkTorchError


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
    unnamed = made(tmp_path / "unnamed")
    os.chown(unnamed.location, 54321, 54321)  # a uid with no name on this machine
    refused(tmp_path / "unnamed", "belongs to uid 54321, not to")
    other = made(tmp_path / "other")
    Path(other.location, "run.json").write_text(json.dumps({"format": 1}))
    refused(tmp_path / "other", "has a run.json that is not a run's")
    refused("  ", "is empty")
    # A directory of another training is never taken over.
    made(tmp_path / "taken", "training-a")
    with pytest.raises(RunDirectoryError, match="holds the training training-a, not training-b"):
        made(tmp_path / "taken", "training-b")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(RunDirectoryError, match="not empty and holds no run"):
        made(tmp_path / "busy")


def test_corrupt_state_files_of_a_run_are_clear_errors_naming_run_dir(tmp_path: Path) -> None:
    """A run directory whose status or result a writer left unreadable: the handle says which
    file, instead of a JSON error or a run that looks submitted."""
    directory = made(tmp_path / "run")
    handle = RunHandle(tmp_path / "run")
    status = Path(directory.location, "status.json")
    status.write_text("{cut sh")
    with pytest.raises(RunDirectoryError, match=r"has a corrupt status\.json"):
        handle.status()
    status.write_text(json.dumps({"progress": 0.5}))
    with pytest.raises(RunDirectoryError, match=r"has a status\.json without a state"):
        handle.status()
    Path(directory.location, "result.json").write_text("[1, 2")
    with pytest.raises(RunDirectoryError, match=r"has a corrupt result\.json") as info:
        directory.end()
    assert info.value.argument == "run_dir"


def test_a_write_that_fails_leaves_the_previous_state_and_no_partial_file(tmp_path: Path) -> None:
    """Writes go through a staging file and a rename: when the rename fails, the error is
    raised and the staging file is gone; ``remove`` deletes a run that never started."""
    directory = made(tmp_path / "run")
    (tmp_path / "run" / "status.json").mkdir()  # a rename onto it fails
    with pytest.raises(OSError):
        directory.write_status({"state": "running"})
    assert not list((tmp_path / "run").glob(".writing-*"))
    directory.remove()
    assert not (tmp_path / "run").exists()


def test_the_cluster_deploy_mode_command_runs_the_detached_driver_on_yarn_or_kubernetes() -> None:
    """Spark runs Python drivers in cluster deploy mode on YARN and Kubernetes only: the
    exact spark-submit that runs the run's detached driver there, and clear refusals where
    it cannot (a standalone master, a run directory the cluster cannot reach)."""
    from sparktorch_ops.detached.submit import cluster_submit_argv

    argv = cluster_submit_argv(
        "hdfs:///runs/n1", "yarn", {"spark.executor.memory": "4g"}, "/tmp/sparktorch_ops.zip"
    )
    driver = str(Path(__file__).parents[2] / "sparktorch_ops" / "detached" / "main.py")
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


def test_a_run_directory_behind_fsspec_serves_a_handle_through_a_whole_run() -> None:
    """An fsspec URL (memory:// here, s3:// in use) holds the same files: a handle follows
    the run from submitted through running and finishing to its result, and says each state
    and error plainly (a run not ended, one whose driver vanished, a wait that runs out)."""
    import pendulum

    from sparktorch_ops.detached.handle import RunLostError
    from sparktorch_ops.detached.main import result_fields
    from sparktorch_ops.results import Attempt, MetricRecord, RunResult

    url = f"memory://runs/{time.time_ns()}"
    directory = RunDirectory(url)
    assert directory.is_url and directory.location == url
    directory.create({"training_id": "training-u", "mode": "barrier"}, pickle.dumps("job"))
    assert directory.job() == pickle.dumps("job")
    handle = RunHandle(url)
    assert repr(handle) == f"RunHandle({url!r})" and handle.status().state == "submitted"
    with pytest.raises(RunDirectoryError, match="has not ended yet: wait"):
        handle.result()
    directory.write_status({"state": "running", "heartbeat": time.time(), "pid": 7})
    directory.append("metrics", [MetricRecord(0, 1, 1.0, {"loss": 0.5}).to_dict()], 1)
    directory.append("logs", [{"line": "[rank 0|h] step 1"}], 1)
    with pytest.raises(TimeoutError, match="is still running"):
        handle.wait(timeout=0.05)
    handle.cancel("asked")
    assert directory.cancel_requested() == "asked"
    directory.write_status({"state": "succeeded", "heartbeat": time.time()})
    assert handle.status().state == "finishing"  # final status, its end not written yet
    now = pendulum.now("UTC")
    result = RunResult(
        {"weights": 1}, {0: 0, 1: 0}, {0: "", 1: ""}, [], now, now, "barrier", 2,
        attempts=(Attempt(1, 2, now.timestamp(), 1.5),),
    )  # fmt: skip
    directory.write_end(
        {"state": "succeeded", "error": None, "result": result_fields(result)},
        value=pickle.dumps(result.value),
    )
    ended = handle.wait(timeout=5)
    assert (ended.value, ended.num_processes, ended.exit_codes) == ({"weights": 1}, 2, {0: 0, 1: 0})
    assert ended.attempts[0].number == 1 and ended.metrics[0].values == {"loss": 0.5}
    assert list(handle.logs()) == ["[rank 0|h] step 1"]
    handle.cancel("too late")  # an ended run is left as it ended
    assert directory.cancel_requested() == "asked"

    lost = RunDirectory(f"{url}-lost")
    lost.create({"training_id": "training-l", "mode": "local"}, pickle.dumps("job"))
    lost.write_status({"state": "running", "heartbeat": time.time() - LOST_AFTER_S - 1})
    with pytest.raises(RunLostError, match="was lost: its driver stopped") as info:
        RunHandle(f"{url}-lost").result()
    assert pickle.loads(pickle.dumps(info.value)).run_dir == f"{url}-lost"
    failed = RunDirectory(f"{url}-failed")
    failed.create({"training_id": "training-f", "mode": "local"}, pickle.dumps("job"))
    failed.write_end({"state": "timed_out", "error": "timeout=5 ran out"})
    with pytest.raises(SparkTorchError, match="timed_out: timeout=5 ran out"):
        RunHandle(f"{url}-failed").result()


WRITTEN_BEFORE = Path(__file__).parents[1] / "fixtures" / "run_directory_written_before_storage"


def test_a_run_directory_written_before_the_storage_helper_reads(tmp_path: Path) -> None:
    """The on-disk format did not change: a run directory the earlier code wrote
    (tests/fixtures/run_directory_written_before_storage/README.md) reads the same, and the
    next write lands beside what it holds."""
    shutil.copytree(WRITTEN_BEFORE / "run", tmp_path / "run")
    directory = RunDirectory(tmp_path / "run")
    identity = directory.identity()
    assert (identity["format"], identity["training_id"], identity["mode"]) == (
        1,
        "training-fixture",
        "local",
    )
    assert pickle.loads(directory.job()) == {"job": "fixture"}
    assert directory.status() == {
        "state": "succeeded",
        "heartbeat": 1700000001.0,
        "pid": 4242,
        "host": "fixture-host",
        "progress": 1.0,
    }
    assert directory.chunks("logs") == [1, 2]
    assert [record for _, record in directory.read("events")] == [
        {"event": "launched", "time": 1700000000.0}
    ]
    assert [record["values"] for _, record in directory.read("metrics")] == [{"loss": 1.0}]
    handle = RunHandle(tmp_path / "run")
    assert handle.training_id == "training-fixture" and handle.status().state == "succeeded"
    assert list(handle.logs()) == ["[rank 0|fixture-host] epoch 0", "[rank 0|fixture-host] epoch 1"]
    assert directory.end() == {"state": "succeeded", "error": None}
    assert pickle.loads(directory.value()) == {"answer": 42}
    assert directory.error() is None
    assert directory.cancel_requested() == "fixture cancel"
    directory.append("logs", [{"line": "later"}], 3)
    assert [record["line"] for _, record in directory.read("logs", after=2)] == ["later"]
