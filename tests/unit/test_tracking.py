"""MLflow tracking, the parts that need no MLflow: what ranks see, params, links, options."""

from __future__ import annotations

import pytest

from sparktorch_ops import ConfigError
from sparktorch_ops.driver.tracking import loggable_params, run_url
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire.env import strip_tracking_env
from sparktorch_ops.wire.plan import agent_env

pytestmark = pytest.mark.unit


def test_ranks_never_get_tracking_credentials() -> None:
    driver = {
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
        "MLFLOW_TRACKING_TOKEN": "secret",
        "DATABRICKS_TOKEN": "secret",
        "MLFLOW_EXPERIMENT_NAME_X": "kept",  # not a tracking credential
        "PATH": "/bin",
    }
    assert strip_tracking_env(driver) == {"MLFLOW_EXPERIMENT_NAME_X": "kept", "PATH": "/bin"}
    assert not any(key.startswith(("MLFLOW_TRACKING_", "DATABRICKS_")) for key in _env(driver))
    # Only an explicit env= may hand a rank a tracking URI.
    explicit = _env(driver, {"MLFLOW_TRACKING_URI": "file:///x"})
    assert explicit["MLFLOW_TRACKING_URI"] == "file:///x"


def _env(base: dict[str, str], user: dict[str, str] | None = None) -> dict[str, str]:
    return agent_env(
        base,
        user or {},
        run_id="r",
        channel="127.0.0.1:1",
        fingerprint=None,
        secret_path="/s",
        payload_path="/p",
        host="h",
        omp_threads=None,
        cuda_visible_devices=None,
    )


def test_params_are_strings_and_objects_are_named_not_dumped() -> None:
    spec = LaunchSpec(num_processes=2, use_gpu=False, torchrun_args=("--log-dir=/tmp/l",))
    params = loggable_params("train (function)", (0.1, object()), {"epochs": 3, "x": b"z"}, spec)
    assert params["num_processes"] == "2" and params["mode"] == "local"
    assert params["train"] == "train (function)"
    assert params["args"] == '[0.1, "<object>"]'
    assert params["kwargs.epochs"] == "3" and params["kwargs.x"] == '"<bytes>"'
    assert params["torchrun_args"] == "--log-dir=/tmp/l"
    long = loggable_params("t", (), {"big": "y" * 10_000}, spec)["kwargs.big"]
    assert len(long) == 6000


def test_run_links_only_for_an_mlflow_server() -> None:
    assert (
        run_url("http://mlflow:5000/", "3", "abc") == "http://mlflow:5000/#/experiments/3/runs/abc"
    )
    assert run_url("sqlite:////tmp/mlflow.db", "3", "abc") is None


def test_tracking_options_are_checked() -> None:
    assert not LaunchSpec().tracked
    assert LaunchSpec(mlflow_experiment="e").tracked
    assert LaunchSpec(mlflow_tracking_uri="sqlite:////x.db").tracked
    for name, value in (("mlflow_experiment", ""), ("mlflow_tracking_uri", 3)):
        with pytest.raises(ConfigError) as info:
            LaunchSpec(**{name: value})
        assert info.value.argument == name
    with pytest.raises(ConfigError) as info:
        LaunchSpec(mlflow_all_ranks="yes")  # type: ignore[arg-type]
    assert info.value.argument == "mlflow_all_ranks"
