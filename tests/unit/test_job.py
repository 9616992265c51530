"""The job model, its wrapper-side builder, the cancel token and the outcome mapping."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from sparktorch_ops.errors import (
    ConfigError,
    StartTimeoutError,
    TrainingCancelledError,
    TrainingFailedError,
    TrainingTimeoutError,
    outcome_of,
)
from sparktorch_ops.job import CancelToken, TrainingJob, build_job
from sparktorch_ops.results import RankFailure
from sparktorch_ops.spark.session import SparkSettings
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire.payload import Script


def train(a: int, b: int = 0) -> int:
    return a + b


@pytest.fixture
def script(tmp_path: Path) -> str:
    """A training script (a function job needs pyspark's pickler: tests/integration)."""
    path = tmp_path / "t.py"
    path.write_text("print(1)")
    return str(path)


def test_a_script_job_is_validated_and_packed_once(script: str) -> None:
    scripted = TrainingJob(script, ("--lr", 1), options=LaunchSpec(num_processes=2, use_gpu=False))
    assert isinstance(scripted.payload, Script) and scripted.payload.argv == ("--lr", "1")
    assert scripted.args == ("--lr", 1) and scripted.mode == "local"


def test_wrapper_builder_coerces_rendered_templates_and_names_wrapper_arguments(
    tmp_path: Path,
) -> None:
    script = tmp_path / "t.py"
    script.write_text("print(1)")
    job = build_job(
        train=f"  {script}\n", train_args=["--x=1"], num_processes=" 3 ", max_restarts="1",
        use_gpu=False, env={"N": 4}, timeout=datetime.timedelta(minutes=1),
    )  # fmt: skip
    assert (job.options.num_processes, job.options.max_restarts) == (3, 1)
    assert dict(job.options.env) == {"N": "4"} and job.options.timeout == 60
    cases = [
        ({"train": train, "num_processes": "two"}, "num_processes", "after templating"),
        ({"train": 42}, "train", "callable or the path"),
        ({"train": str(tmp_path / "missing.py")}, "train", "the script"),
        ({"train": str(script), "train_kwargs": {"a": 1}}, "train_kwargs", "command-line"),
        ({"train": train, "train_args": "abc"}, "train_args", "list or tuple"),
        ({"train": train, "num_processes": 0}, "num_processes", "positive"),
        ({"train": train, "spark": None, "env": {"RANK": "1"}}, "env", "set by torchrun"),
    ]
    for kwargs, argument, text in cases:
        with pytest.raises(ConfigError) as info:
            build_job(use_gpu=False, **kwargs)  # type: ignore[arg-type]
        assert info.value.argument == argument and text in str(info.value), kwargs


def test_cancel_token_keeps_the_first_reason() -> None:
    token = CancelToken()
    assert not token.cancelled and token.reason is None
    token.cancel("first")
    token.cancel("second")
    assert token.cancelled and token.reason == "first"


def test_a_job_cancelled_before_launch_never_starts(script: str) -> None:
    from sparktorch_ops.distributor import launch_job

    job = TrainingJob(script, (), options=LaunchSpec(use_gpu=False))
    job.cancel_token.cancel("killed during templating")
    with pytest.raises(TrainingCancelledError, match="killed during templating"):
        launch_job(job)


def test_job_holds_spark_settings_checked_up_front() -> None:
    with pytest.raises(ConfigError, match="spark_master"):
        TrainingJob(train, (1,), spark=SparkSettings(master="bogus"))


def test_one_outcome_mapping_for_every_wrapper() -> None:
    failure = RankFailure(1, "h1", 4, None, "ValueError: boom", "line\nTraceback...", 1.0)
    cases = [
        (None, "succeeded", False, 0),
        (ConfigError("x", "bad"), "bad_input", False, 2),
        (TrainingFailedError([failure]), "failed", True, 4),
        (TrainingTimeoutError("timeout", 5), "timed_out", True, 124),
        (StartTimeoutError("start_timeout", 5), "timed_out", True, 124),
        (TrainingCancelledError("stop"), "cancelled", True, 130),
        (KeyboardInterrupt(), "cancelled", True, 130),
        (RuntimeError("odd"), "error", True, 1),
    ]
    for error, status, retryable, code in cases:
        outcome = outcome_of(error)
        assert (outcome.status, outcome.retryable, outcome.exit_status) == (
            status,
            retryable,
            code,
        ), error
    failed = outcome_of(TrainingFailedError([failure]))
    assert (failed.rank, failed.host) == (1, "h1") and "Traceback" in failed.tail
    assert failed.headline.startswith("training failed: rank 1 failed first")


@pytest.mark.parametrize("value", ["+-2", "²", "2.5", ""])
def test_templated_integers_that_are_not_integers_are_config_errors(value: str) -> None:
    with pytest.raises(ConfigError, match="num_processes"):
        build_job(train=train, num_processes=value, use_gpu=False)


def test_an_env_value_of_none_is_refused_not_stringified() -> None:
    with pytest.raises(ConfigError, match="env"):
        build_job(train=train, use_gpu=False, env={"A": None})


def test_dry_run_reads_spark_numbers_from_the_conf_and_names_a_bad_one(script: str) -> None:
    from sparktorch_ops.distributor import plan_job

    def job(conf: dict[str, str]) -> TrainingJob:
        spec = LaunchSpec(num_processes=2, local_mode=False, use_gpu=True)
        return TrainingJob(script, (), options=spec, spark=SparkSettings(conf=conf))

    plan = plan_job(job({"spark.task.resource.gpu.amount": "2", "spark.task.cpus": "4"}))
    assert (plan.layout.num_tasks, plan.nodes[0].omp_threads) == (1, 2)
    with pytest.raises(ConfigError, match=r"spark\.task\.cpus: is not an integer") as info:
        plan_job(job({"spark.task.cpus": "four", "spark.task.resource.gpu.amount": "1"}))
    assert info.value.argument == "spark.task.cpus"  # as a run reading the session says it
