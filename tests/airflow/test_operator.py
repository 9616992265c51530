"""TorchDistributorOperator in real DAG runs (``dag.test()`` on the SQLite metadata DB).

One run of ``tests/airflow/dags/sto_ops.py`` serves the tests of this module; each checks one
task of it. ``sto_bad_input`` checks that bad input fails at once, without retry.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from harness.procs import wait_until_gone
from sparktorch_ops import options
from sparktorch_ops.airflow import load_result

RANK_LINE = re.compile(r"\[(\w+)\s*\] \[rank (\d+)\|[^\]]+\] (.*?) \[airflow\.task")
RUN_STARTED = re.compile(r"sparktorch_ops: (sparktorch-[0-9a-f]+) started")


def rank_lines(log: str) -> list[tuple[str, int, str]]:
    """``(level, rank, text)`` of every rank line in ``log``."""
    return [(m[1], int(m[2]), m[3]) for m in RANK_LINE.finditer(log)]


@pytest.fixture
def ops(capfd: pytest.CaptureFixture[str], run_dag: Any) -> Any:
    return run_dag(capfd, "sto_ops")


def test_summary_is_pushed_with_the_rank0_value_and_metrics(ops: Any) -> None:
    assert ops.task("summary").state == "success"
    summary = ops.xcom("summary")
    assert summary["value"]["rank"] == 0
    assert summary["value"]["world_size"] == 2
    assert summary["metrics"] == {"loss": pytest.approx(1 / 3)}
    assert summary["progress"] == 1.0
    assert summary["num_processes"] == 2
    assert summary["mode"] == "local"
    assert summary["app_id"] is None and summary["ui_url"] is None
    assert summary["exit_codes"] == {"0": 0, "1": 0}
    assert summary["duration_s"] > 0
    assert summary["run_id"].startswith("sparktorch-")
    assert "value_uri" not in summary
    # No Spark in local mode: the link is empty.
    assert ops.xcom("summary", key="_link_SparkUILink") == ""


def test_one_task_try_covers_a_second_attempt_after_a_lost_rank(ops: Any) -> None:
    """max_failures=1: rank 1's SIGKILL ends the first attempt, and the same task try's
    second attempt trains; the summary says both, the log why the second started."""
    ti = ops.task("attempts")
    assert (ti.state, ti.try_number) == ("success", 1)
    summary = ops.xcom("attempts")
    assert summary["value"] == "trained after a lost rank"
    first, second = summary["attempts"]
    assert first["cause"].startswith("rank 1 on ") and first["cause"].endswith("SIGKILL")
    assert second["cause"] is None and second["num_processes"] == 2
    log = ops.task_log("attempts")
    assert "sparktorch_ops: attempt 1 of 2 ended: rank 1 on " in log
    assert "starting attempt 2 afresh with 2 ranks" in log


def test_templated_fields_are_rendered(ops: Any) -> None:
    value = ops.xcom("summary")["value"]
    day = ops.logical_date.strftime("%Y-%m-%d")
    assert value["word"] == f"hello-{day.replace('-', '')}"
    assert value["out_dir"] == f"/data/out/{day}"
    assert value["tag"] == "sto_ops"
    assert value["env_tag"] == f"summary-{day}"
    rendered = ops.rendered("summary")
    assert rendered["num_processes"] == "2"
    assert rendered["spark_conf"] == {"spark.app.name": "sto_ops"}
    assert rendered["env"] == {"STO_TAG": f"summary-{day}"}
    assert rendered["train_kwargs"] == {"out_dir": f"/data/out/{day}", "tag": "sto_ops"}


def test_rank_output_reaches_the_task_log_at_info_with_rank_prefixes(ops: Any) -> None:
    lines = rank_lines(ops.task_log("summary"))
    assert ("info", 0, "training started on rank 0") in lines
    assert ("info", 1, "training started on rank 1") in lines
    assert ("warning", 0, "a note on stderr from rank 0") in lines
    assert ("warning", 1, "a note on stderr from rank 1") in lines
    assert {level for level, _, _ in lines} <= {"info", "warning"}
    assert not re.search(r"\[error\s*\] \[rank", ops.log)
    assert "sparktorch_ops: step 2 progress 100% loss=0.333" in ops.task_log("summary")


def test_non_json_value_goes_to_the_result_location(ops: Any, airflow_db: Any) -> None:
    assert ops.task("non_json").state == "success"
    summary = ops.xcom("non_json")
    assert "value" not in summary
    # No result_location given and none configured: the default one under AIRFLOW_HOME.
    default_dir = (airflow_db / "sparktorch_ops" / "results").as_uri()
    assert summary["value_uri"].startswith(f"{default_dir}/sto_ops/")
    assert re.search(r"/non_json~[0-9a-f]{16}/try-1/result\.pkl$", summary["value_uri"])
    assert re.fullmatch(r"[0-9a-f]{64}", summary["value_sha256"])
    assert summary["value_format"] == "pickle"
    assert summary["value_size"] > 0
    assert "builtins.set" in summary["value_stored_because"]
    assert load_result(summary) == {"labels": {1, 2, 3}, "blob": b"\x00\x01binary", "rank": 0}


def test_failing_rank_fails_the_task_with_its_traceback(ops: Any) -> None:
    task = ops.task("fails")
    assert task.state == "failed"
    log = ops.task_log("fails")
    error = log[log.index("Task failed with exception") :]
    assert "TorchTrainingError: training failed: rank 1 failed first" in error
    assert "ValueError: rank one exploded on purpose" in error
    assert 'in fail_on_rank_one\n    raise ValueError("rank one exploded on purpose")' in error
    run_id = RUN_STARTED.search(log)
    assert run_id and wait_until_gone(run_id[1], timeout=30) == []


def test_execution_timeout_cancels_the_run(ops: Any) -> None:
    task = ops.task("times_out")
    assert task.state == "failed"
    log = ops.task_log("times_out")
    assert "training started, sleeping" in log
    assert "AirflowTaskTimeout" in log
    # Where the ranks were when the timeout stopped them, taken before the teardown.
    for rank in (0, 1):
        assert f"rank {rank} is in sleep_long (sto_ops.py:" in log, log
    assert "time.sleep(300)" in log
    run_id = RUN_STARTED.search(log)
    assert run_id and wait_until_gone(run_id[1], timeout=30) == []


BAD_INPUT = {
    "unknown_conn": "the Airflow connection 'no_such_spark_conn' does not exist",
    "train_not_callable": "train: must be a callable or the path of a Python script, got int",
    "missing_script": "train: the script '/nonexistent-sparktorch-dir/train-",
    "num_processes_not_int": "num_processes: must be an integer after templating, got 'two'",
    "two_inputs": "input: give exactly one of a DataFrame, input_sql, input_table or input_path "
    "(got sql, table)",
}


def test_bad_input_fails_at_once_without_retry(
    capfd: pytest.CaptureFixture[str], run_dag: Any
) -> None:
    outcome = run_dag(capfd, "sto_bad_input")
    for task_id, message in BAD_INPUT.items():
        task = outcome.task(task_id)
        assert (task.state, task.try_number) == ("failed", 1), task_id
        log = outcome.task_log(task_id)
        assert "AirflowFailException" in log, task_id
        assert message in log, task_id
        # Nothing started: no Spark session, no ranks.
        assert "starting a SparkSession" not in log, task_id
        assert not RUN_STARTED.search(log), task_id


def test_every_launch_option_reaches_the_job(
    capfd: pytest.CaptureFixture[str], run_dag: Any
) -> None:
    outcome = run_dag(capfd, "sto_bad_input")
    for option in options.on("operator"):
        task_id = f"bad_{option.name}"
        task = outcome.task(task_id)
        assert (task.state, task.try_number) == ("failed", 1), task_id
        log = outcome.task_log(task_id)
        assert f"sparktorch_ops: bad input: {option.name}: " in log, (task_id, log[-3000:])
        assert not RUN_STARTED.search(log), task_id


def test_templated_sql_input_is_read_by_the_ranks(
    capfd: pytest.CaptureFixture[str], run_dag: Any
) -> None:
    outcome = run_dag(capfd, "sto_input")
    assert outcome.task("on_sql").state == "success"
    summary = outcome.xcom("on_sql")
    assert summary["value"]["rows"] == 12 and summary["value"]["max_id"] == 11
    assert summary["input"]["rows"] == 12
    assert summary["input"]["columns"] == ["id", "x"]
    day = outcome.logical_date.strftime("%Y%m%d")
    assert f"'{day}' LIKE" in summary["input"]["source"]
    assert f"range(12) WHERE '{day}'" in outcome.rendered("on_sql")["input_sql"]
    assert "starting a SparkSession (master local[2])" in outcome.task_log("on_sql")


def test_a_retried_task_resumes_from_its_last_checkpoint(
    capfd: pytest.CaptureFixture[str], run_dag: Any, tmp_path: Path
) -> None:
    marker, results = tmp_path / "failed-once", tmp_path / "results"
    outcome = run_dag(capfd, "sto_resume", marker=str(marker), results=str(results))
    assert outcome.task("train").state == "success" and marker.exists()
    summary = outcome.xcom("train")
    assert summary["value"] == {"start": 1, "ran": [2, 3], "total": 6.0}  # 0+1, then 2+3
    checkpoints = summary["checkpoint"]
    assert checkpoints["resumed_from_step"] == 1 and checkpoints["latest_step"] == 3
    # The task instance's own directory under result_location, shared by its two tries.
    assert checkpoints["dir"].startswith(str(results / "checkpoints" / "sto_resume"))
    first_try, second_try = outcome.log.split("resuming from step 1 of checkpoint_dir", 1)
    assert "yet: starting fresh" in first_try
    assert "sparktorch_ops.checkpoint: resumed from step 1 at" in second_try  # rank 0 says so
