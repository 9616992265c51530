"""run_torch_distributor under a real Prefect API: failures, retries, timeouts, bad input,
barrier mode with a SparkCluster block. Everything is read back through the Prefect client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect import flow

from harness.procs import wait_until_gone
from sparktorch_ops import options as launch_options
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.prefect import (
    TASK_RUN_RESULT_KEY,
    SparkCluster,
    run_torch_distributor,
    validate_master,
)
from sparktorch_ops.prefect.artifacts import check_artifact_key, key_from_name, metrics_table
from sparktorch_ops.results import MetricRecord
from tests.prefect.conftest import flow_run_artifacts, flow_run_logs, run_ids, task_runs
from tests.support.connect_server import ConnectServer
from tests.support.launch_options import BAD

ROOT = Path(__file__).resolve().parents[2]


def _fail_on_rank_1() -> str:
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("boom from rank 1")
    return "rank 0 is fine"


def _sleep_forever(marker_dir: str) -> None:
    import os
    import time

    with open(os.path.join(marker_dir, f"rank{os.environ['RANK']}"), "w") as handle:
        handle.write(os.environ["SPARKTORCH_OPS_RUN_ID"])
    time.sleep(600)


def _half_then_wait(go_file: str) -> bool:
    import os
    import time

    from sparktorch_ops import report

    report(progress=0.5, phase=1)
    deadline = time.monotonic() + 60
    while not os.path.exists(go_file) and time.monotonic() < deadline:
        time.sleep(0.1)
    return os.path.exists(go_file)


def _barrier_job() -> dict[str, Any]:
    import os

    from sparktorch_ops import report

    report(step=0, progress=1.0, value=int(os.environ["RANK"]) + 1)
    return {"world_size": int(os.environ["WORLD_SIZE"])}


def test_failing_rank_fails_the_task_with_rank_and_traceback() -> None:
    @flow
    def failing() -> str:
        return run_torch_distributor(
            _fail_on_rank_1, num_processes=2, local_mode=True, use_gpu=False
        )

    state = failing(return_state=True)
    assert state.is_failed()
    [task_run] = task_runs(state.state_details.flow_run_id)
    message = task_run.state.message
    assert "rank 1 failed first" in message
    assert "ValueError: boom from rank 1" in message
    artifacts = flow_run_artifacts(state.state_details.flow_run_id)
    summary = artifacts["run-torch-distributor-summary"].data
    assert ": failed" in summary and "Traceback" in summary and "boom from rank 1" in summary
    assert artifacts["run-torch-distributor-progress"].data < 100
    logs = flow_run_logs(state.state_details.flow_run_id)
    # rank 1's own output reached the API live, prefixed, its traceback as warnings
    rank1 = [log for log in logs if log.message.startswith("[rank 1|")]
    assert any("ValueError: boom from rank 1" in log.message for log in rank1)
    assert {log.level for log in rank1} == {30}
    [run_id] = run_ids(logs)
    assert wait_until_gone(run_id, timeout=15) == []


def test_progress_artifact_is_updated_live(tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.runtime import flow_run

    @flow
    def live(go_file: str) -> tuple[list[float], bool]:
        future = run_torch_distributor.with_options(name="live").submit(
            _half_then_wait, (go_file,), num_processes=2, local_mode=True, use_gpu=False
        )
        seen: list[float] = []
        deadline = time.monotonic() + 90
        with get_client(sync_client=True) as client:
            # While rank 0 waits, its report(progress=0.5) must already show in the API.
            while time.monotonic() < deadline and 50 not in seen and not future.state.is_final():
                for artifact in client.read_artifacts(
                    artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["live-progress"]))
                ):
                    if str(artifact.flow_run_id) == flow_run.get_id():
                        seen.append(artifact.data)
                time.sleep(0.3)
        Path(go_file).touch()
        return seen, future.result()

    state = live(str(tmp_path / "go"), return_state=True)
    assert state.is_completed(), state.message
    seen, released = state.result()
    assert released is True
    assert 50 in seen and set(seen) <= {0, 50}
    artifacts = flow_run_artifacts(state.state_details.flow_run_id)
    assert artifacts["live-progress"].data == 100


def test_a_retry_resumes_from_the_last_checkpoint_into_the_same_mlflow_run(
    tmp_path: Path,
) -> None:
    from mlflow.tracking import MlflowClient

    from tests.support.checkpointed import steps_with_one_failure

    retried = run_torch_distributor.with_options(name="resumed", retries=1, retry_delay_seconds=0)
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"

    @flow
    def with_retry(marker: str) -> dict[str, Any]:
        return retried(
            steps_with_one_failure,
            (4, marker),
            num_processes=2,
            local_mode=True,
            use_gpu=False,
            mlflow_tracking_uri=tracking,
            mlflow_experiment="resumed",
        )

    marker = tmp_path / "failed-once"
    state = with_retry(str(marker), return_state=True)
    assert state.is_completed(), state.message
    assert state.result() == {"start": 1, "ran": [2, 3], "total": 6.0} and marker.exists()
    flow_run_id = state.state_details.flow_run_id
    [task_run] = task_runs(flow_run_id)
    assert task_run.run_count == 2
    records = flow_run_logs(flow_run_id)
    # The retry reran the whole job: a launch of its own, and neither left a process.
    first, second = run_ids(records)
    assert first != second
    for run_id in (first, second):
        assert wait_until_gone(run_id, timeout=15) == []
    logs = [log.message for log in records]
    fresh = [line for line in logs if "yet: starting fresh" in line]
    resumed = [line for line in logs if line.startswith("sparktorch_ops: resuming from step 1")]
    assert len(fresh) == 1 and len(resumed) == 1
    # The task run's own directory, keyed by the flow run: a new flow run starts fresh.
    assert f"/sparktorch_ops/checkpoints/{flow_run_id}/" in resumed[0]
    summary = flow_run_artifacts(flow_run_id)["resumed-summary"].data
    assert ": completed" in summary and "resumed from step 1; latest step 3" in summary
    # One training: one MLflow run for both tries, ended by the last; every step's metric.
    client = MlflowClient(tracking)
    [run] = client.search_runs([client.get_experiment_by_name("resumed").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["sparktorch_ops.tries"] == "1,2"
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "total"))
    assert steps == [0, 1, 2, 3], steps  # step 1 of the first try once: the replay skips it
    training = run.data.tags["sparktorch_ops.training_id"]
    line = (
        f"sparktorch_ops: try 2 of the training {training}: resuming from step 1 (checkpoint), "
        f"MLflow run {run.info.run_id}"
    )
    assert line in logs, [entry for entry in logs if "try 2" in entry]


@pytest.mark.parametrize("call", ["direct", "submit"])
def test_task_timeout_stops_the_training(call: str, tmp_path: Path) -> None:
    # Long enough for both ranks to start on a loaded 2-core machine, so the timeout
    # interrupts a training in progress (checked below through the ranks' marker files).
    limited = run_torch_distributor.with_options(timeout_seconds=6)

    @flow
    def too_long(marker_dir: str) -> None:
        kwargs: dict[str, Any] = {"num_processes": 2, "local_mode": True, "use_gpu": False}
        if call == "submit":  # a worker thread: the timeout is an injected exception
            limited.submit(_sleep_forever, (marker_dir,), **kwargs).result()
        else:
            limited(_sleep_forever, (marker_dir,), **kwargs)

    started = time.monotonic()
    state = too_long(str(tmp_path), return_state=True)
    elapsed = time.monotonic() - started
    assert state.is_failed()
    [task_run] = task_runs(state.state_details.flow_run_id)
    assert task_run.state.name == "TimedOut", task_run.state
    markers = sorted(p.name for p in tmp_path.iterdir())
    assert markers == ["rank0", "rank1"], f"the ranks had not started: {markers}"
    run_id = (tmp_path / "rank0").read_text()
    assert (tmp_path / "rank1").read_text() == run_id
    assert wait_until_gone(run_id, timeout=15) == []
    assert elapsed < 60
    logs = flow_run_logs(state.state_details.flow_run_id)
    assert run_ids(logs) == [run_id]
    # Where the ranks were when the timeout stopped them, in the task run's log.
    where = [log.message for log in logs if " is in _sleep_forever (test_task.py:" in log.message]
    assert len(where) == 2 and all("time.sleep(600)" in message for message in where), where
    summary = flow_run_artifacts(state.state_details.flow_run_id)["run-torch-distributor-summary"]
    assert ": timed out" in summary.data and "timeout_seconds=6" in summary.data


@pytest.mark.parametrize(
    ("options", "argument"),
    [
        ({"artifact_key": "Not_Valid"}, "artifact_key"),
        ({"train": 42}, "train"),
        ({"train": "no/such/train_script.py"}, "train"),
        ({"spark_master": "nonsense://x", "local_mode": False}, "spark_master"),
        ({"spark_conf": {"spark.executor.cores": [2]}, "local_mode": False}, "spark_conf"),
        # Never silently dropped: a spark.master that contradicts the cluster block's.
        (
            {
                "cluster": SparkCluster(master="local[2]"),
                "spark_conf": {"spark.master": "local[1]"},
                "local_mode": False,
            },
            "spark_conf",
        ),
        ({"num_processes": 0}, "num_processes"),
        ({"input_sql": "SELECT 1 AS x", "input_table": "events"}, "input"),
    ],
)
def test_bad_input_fails_before_anything_starts(options: dict[str, Any], argument: str) -> None:
    task_ = run_torch_distributor.with_options(retries=2, retry_delay_seconds=0)
    kwargs: dict[str, Any] = {"num_processes": 2, "local_mode": True, "use_gpu": False}
    kwargs.update(options)
    train = kwargs.pop("train", _barrier_job)

    @flow
    def bad() -> None:
        task_(train, **kwargs)

    state = bad(return_state=True)
    assert state.is_failed()
    [task_run] = task_runs(state.state_details.flow_run_id)
    assert task_run.run_count == 1  # bad input is not retried
    assert f"{argument}:" in task_run.state.message
    logs = flow_run_logs(state.state_details.flow_run_id)
    assert any("ConfigError" in log.message and f"{argument}:" in log.message for log in logs)
    assert run_ids(logs) == []  # nothing was launched
    assert flow_run_artifacts(state.state_details.flow_run_id) == {}


def test_every_launch_option_reaches_the_job() -> None:
    """A value the job refuses, for each launch option in turn: each task run fails naming it
    (the task passes every option on), one flow run for all of them."""

    @flow
    def bad_options() -> dict[str, Any]:
        return {
            option.name: run_torch_distributor(
                _barrier_job, **{"use_gpu": False, option.name: BAD[option.name]}, return_state=True
            )
            for option in launch_options.on("task")
        }

    states = bad_options()
    assert set(states) == {option.name for option in launch_options.on("task")}
    for name, state in states.items():
        assert state.is_failed(), name
        error = state.result(raise_on_failure=False)
        assert isinstance(error, ConfigError) and error.argument == name, (name, error)


def test_barrier_mode_on_a_named_cluster_links_the_spark_ui(spark: Any) -> None:
    SparkCluster(master="local[2]", conf={"spark.ui.showConsoleProgress": "false"}).save(
        "test-local-cluster", overwrite=True
    )

    @flow
    def on_cluster() -> dict[str, Any]:
        return run_torch_distributor(
            _barrier_job,
            num_processes=2,
            local_mode=False,
            use_gpu=False,
            cluster="test-local-cluster",
            artifact_key="barrier-job",
        )

    state = on_cluster(return_state=True)
    assert state.is_completed(), state.message
    assert state.result() == {"world_size": 2}
    flow_run_id = state.state_details.flow_run_id
    artifacts = flow_run_artifacts(flow_run_id)
    assert artifacts["barrier-job-progress"].data == 100
    summary = artifacts["barrier-job-summary"].data
    assert "barrier (one rank per Spark barrier task)" in summary
    assert spark.sparkContext.applicationId in summary
    link = artifacts["barrier-job-spark-ui"]
    assert link.type == "markdown"  # Prefect renders link artifacts as markdown links
    assert spark.sparkContext.uiWebUrl in link.data
    rows = {(row["rank"], row["value"]) for row in _table(artifacts["barrier-job-metrics"])}
    assert rows == {(0, 1), (1, 2)}
    logs = flow_run_logs(flow_run_id)
    assert any("reusing the SparkContext" in log.message for log in logs)
    [run_id] = run_ids(logs)
    assert wait_until_gone(run_id, timeout=15) == []


def test_barrier_mode_over_spark_connect_on_a_cluster_block(
    prefect_api: str, connect_server: ConnectServer, tmp_path: Path
) -> None:
    token = "s3cret-block-token"
    # localhost: pyspark sends a token over a plain channel only to localhost.
    url = f"sc://localhost:{connect_server.port}/;token={token}"
    SparkCluster(master=url).save("test-connect-cluster", overwrite=True)
    assert SparkCluster.load("test-connect-cluster").settings().master == url

    # Its own process: here a classic SparkContext may run, which the task would reuse
    # instead of the Connect session; and a Connect client leaves its state behind.
    out = tmp_path / "outcome.json"
    env = dict(os.environ)
    env.update(
        PREFECT_API_URL=prefect_api,
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_LOCAL_STORAGE_PATH=str(tmp_path / "results"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    script = Path(__file__).with_name("connect_flow.py")
    flow_run = subprocess.run(
        [sys.executable, str(script), "test-connect-cluster", str(out)],
        cwd=str(ROOT),
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    output = flow_run.stdout + flow_run.stderr
    assert flow_run.returncode == 0, f"{output[-20000:]}\nserver log:\n{connect_server.log()}"
    outcome = json.loads(out.read_text())
    assert outcome["completed"], outcome["message"]
    assert outcome["value"] == {"sum": 3.0, "world_size": 2}

    flow_run_id = UUID(outcome["flow_run_id"])
    [task_run] = task_runs(flow_run_id)
    assert task_run.state.is_completed()
    artifacts = flow_run_artifacts(flow_run_id)
    assert artifacts["connect-job-progress"].data == 100
    rows = {(row["rank"], row["contributed"]) for row in _table(artifacts["connect-job-metrics"])}
    assert rows == {(0, 1), (1, 2)}
    summary = artifacts["connect-job-summary"].data
    assert "completed" in summary and "| Processes | 2 |" in summary
    assert "barrier (one rank per Spark barrier task)" in summary
    assert "| Spark application | `local-" in summary  # the Connect server's application
    logs = [log.message for log in flow_run_logs(flow_run_id)]
    redacted = f"sc://localhost:{connect_server.port}/;token=***"
    assert f"sparktorch_ops: connecting to Spark Connect at {redacted}" in logs, logs
    for rank in (0, 1):
        assert any(
            line.startswith(f"[rank {rank}|") and f"rank {rank} all-reduced 3" in line
            for line in logs
        ), logs
    assert not any(token in line for line in logs)
    assert not any(token in str(artifact.data) for artifact in artifacts.values())
    assert token not in output
    [run_id] = run_ids(flow_run_logs(flow_run_id))
    assert wait_until_gone(run_id, timeout=15) == []


def _rows_seen(batch_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from sparktorch_ops.data import partition_loader

    dist.init_process_group("gloo")
    ids = [i for batch in partition_loader(batch_size) for i in batch["id"].tolist()]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ids)
    dist.destroy_process_group()
    return {"rows": len({i for rank_ids in gathered for i in rank_ids})}


def test_dataframe_input_reaches_the_ranks_and_the_summary(spark: Any) -> None:
    frame = spark.range(10, numPartitions=3).selectExpr("id", "CAST(id AS DOUBLE) * 2 AS x")

    @flow
    def on_frame() -> dict[str, Any]:
        return run_torch_distributor(
            _rows_seen, [3], num_processes=2, use_gpu=False, dataframe=frame
        )

    state = on_frame(return_state=True)
    assert state.is_completed(), state.message
    assert state.result() == {"rows": 10}
    summary = flow_run_artifacts(state.state_details.flow_run_id)["run-torch-distributor-summary"]
    assert "| Input | 10 rows from a DataFrame; columns `id`, `x` |" in summary.data


def _table(artifact: Any) -> list[dict[str, Any]]:
    import json

    data = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    return list(data)


# Pure helpers: no Prefect run needed.


@pytest.mark.parametrize(
    "master",
    [
        "local",
        "local[2]",
        "local[*]",
        "local[4,2]",
        "local-cluster[2,1,1024]",
        "spark://head:7077",
        "spark://a:7077,b:7077",
        "yarn",
        "k8s://https://api:6443",
        "mesos://zk:5050",
        "sc://spark-connect:15002",
        "sc://spark-connect/;use_ssl=true;token=abc;user_id=me",
    ],
)
def test_valid_masters(master: str) -> None:
    assert validate_master(master) == master


def test_cluster_block_examples_are_valid_masters() -> None:
    examples = SparkCluster.model_fields["master"].examples or []
    assert "sc://spark-connect:15002" in examples
    for example in examples:
        assert SparkCluster(master=example).master == example


@pytest.mark.parametrize("master", ["nonsense://x", "local[0]", "local[x]", "spark://", "", 7])
def test_invalid_masters_name_the_argument(master: object) -> None:
    with pytest.raises(ConfigError) as info:
        validate_master(master)
    assert info.value.argument == "master"


def test_cluster_block_validates_its_master() -> None:
    with pytest.raises(ValueError, match="not a Spark master URL"):
        SparkCluster(master="nonsense://x")
    with pytest.raises(ValueError, match="contradicts the master 'spark://head:7077'"):
        SparkCluster(master="spark://head:7077", conf={"spark.master": "local[2]"})
    same = SparkCluster(master="local[2]", conf={"spark.master": "local[2]"})
    assert same.settings().master == "local[2]" and "spark.master" not in same.settings().conf
    cluster = SparkCluster(master="yarn", history_server_url="http://history:18080")
    assert cluster.settings().conf["spark.sparktorch.historyServer.url"] == "http://history:18080"


def test_result_key_depends_on_the_task_run_only() -> None:
    import threading
    from types import SimpleNamespace

    ctx: Any = SimpleNamespace(task_run=SimpleNamespace(id="0123"))
    unhashable_session = threading.Lock()  # stands for a SparkSession or a logger
    key = TASK_RUN_RESULT_KEY.compute_key(ctx, {"spark": unhashable_session}, {})
    assert key == "sparktorch-ops-0123"


def test_artifact_keys() -> None:
    assert key_from_name("Train Digits_v2") == "train-digits-v2"
    assert key_from_name("run_torch_distributor") == "run-torch-distributor"
    assert check_artifact_key("nightly-1") == "nightly-1"
    for bad in ("Upper", "under_score", "", "spa ce"):
        with pytest.raises(ConfigError):
            check_artifact_key(bad)


def test_metrics_table_has_even_columns() -> None:
    records = [
        MetricRecord(rank=1, step=0, time=0.0, values={"loss": 2.0}),
        MetricRecord(rank=0, step=0, time=0.0, values={"loss": 1.0}, progress=0.5),
        MetricRecord(rank=0, step=1, time=0.0, values={"acc": 0.9}, progress=1.0),
    ]
    assert metrics_table(records) == [
        {"step": 0, "rank": 0, "progress": 0.5, "loss": 1.0, "acc": None},
        {"step": 0, "rank": 1, "progress": None, "loss": 2.0, "acc": None},
        {"step": 1, "rank": 0, "progress": 1.0, "loss": None, "acc": 0.9},
    ]


DETACHED_FLOW = """
import json, os, sys, time
from prefect import flow
from sparktorch_ops.prefect import run_torch_distributor

def train(marks):
    rank = os.environ["RANK"]
    open(os.path.join(marks, f"started.rank{rank}.{os.getpid()}"), "w").close()
    time.sleep(6)
    return {"rank": int(rank), "pid": os.getpid()}

@flow
def detached_flow(marks: str, run_dir: str) -> dict:
    # durable=False: the rerun is another flow run, whose own training id would not match the
    # directory's; the directory is what it reattaches by.
    return run_torch_distributor(train, (marks,), num_processes=2, local_mode=True,
                                 use_gpu=False, detached=True, run_dir=run_dir, durable=False)

if __name__ == "__main__":
    state = detached_flow(sys.argv[1], sys.argv[2], return_state=True)
    print("RESULT " + json.dumps({"value": state.result(), "flow_run": str(state.state_details.flow_run_id)}))
"""


def test_a_detached_training_outlives_its_crashed_flow_run_and_the_rerun_reattaches(
    tmp_path: Path,
) -> None:
    """detached=True: the flow run's process is SIGKILLed mid-training; the training goes on,
    and the rerun (the same run directory) reattaches to it instead of training again, with
    its summary artifact as an attached run has."""
    script, marks, run_dir = tmp_path / "flow.py", tmp_path / "marks", tmp_path / "run"
    script.write_text(DETACHED_FLOW)
    marks.mkdir()
    from prefect.settings import PREFECT_API_URL

    command = [sys.executable, str(script), str(marks), str(run_dir)]
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}  # this session's server
    crashed = subprocess.Popen(
        command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while len(list(marks.iterdir())) < 2:
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.1)
    crashed.kill()
    crashed.wait(30)
    rerun = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    line = next((x for x in rerun.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert rerun.returncode == 0 and line is not None, rerun.stderr[-3000:]
    found = json.loads(line[len("RESULT ") :])
    assert found["value"]["rank"] == 0
    assert len(list(marks.iterdir())) == 2  # trained once: the rerun reattached
    assert f"started.rank0.{found['value']['pid']}" in {p.name for p in marks.iterdir()}
    artifacts = flow_run_artifacts(UUID(found["flow_run"]))
    assert ": completed" in artifacts["run-torch-distributor-summary"].data
