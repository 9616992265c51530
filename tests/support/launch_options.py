"""Values of every launch option for the tests that prove each surface passes each option on:
a valid, non-default value (``GOOD``) and one the job refuses by the option's name (``BAD``)."""

from __future__ import annotations

import logging
from typing import Any

from sparktorch_ops.driver.durable import TrainingTry

#: A value the job refuses, naming the option, before anything starts.
BAD: dict[str, Any] = {
    "num_processes": 0,
    "local_mode": "yes",
    "use_gpu": "yes",
    "env": {"RANK": "3"},
    "max_restarts": -1,
    "max_failures": -1,
    "min_processes": 0,
    "torchrun_args": ["--nproc-per-node=2"],
    "start_timeout": -1,
    "timeout": -1,
    "stall_timeout": 0,
    "log_ranks": [-1],
    "allow_unencrypted_channel": "yes",
    "max_result_bytes": 0,
    "max_local_processes": 0,
    "checkpoint_dir": "nosuchproto://checkpoints",
    "warm_start_from": "/nonexistent/sparktorch-weights.pt",
    "mlflow_experiment": 7,
    "mlflow_tracking_uri": 7,
    "mlflow_all_ranks": "yes",
    "channel_host": "http://driver:7077",
    "detached": "yes",
    "run_dir": 7,
    "logger": object(),
    "on_metrics": 7,
    "on_event": 7,
    "mlflow_tags": 7,
    "training": "training-1",
}


def good(existing_file: str) -> dict[str, Any]:
    """A valid value of every option, none of them the default (``existing_file``: for
    ``warm_start_from``, which must exist)."""
    return {
        "num_processes": 2,
        "local_mode": False,
        "use_gpu": False,
        "env": {"SPARKTORCH_TEST": "1"},
        "max_restarts": 2,
        "max_failures": 3,
        "min_processes": 1,
        "torchrun_args": ["--monitor-interval=1"],
        "start_timeout": 5.0,
        "timeout": 7.0,
        "stall_timeout": 9.0,
        "log_ranks": [1],
        "allow_unencrypted_channel": True,
        "max_result_bytes": 100,
        "max_local_processes": 8,
        "checkpoint_dir": "/tmp/sparktorch-checkpoints",
        "warm_start_from": existing_file,
        "mlflow_experiment": "options-test",
        "mlflow_tracking_uri": "file:///tmp/sparktorch-mlruns",
        "mlflow_all_ranks": True,
        "channel_host": "10.1.2.3",
        "detached": True,
        "run_dir": "/tmp/sparktorch-runs/options-test",
        "logger": logging.getLogger("options-test"),
        "on_metrics": print,
        "on_event": print,
        "mlflow_tags": {"team": "ml"},
        "training": TrainingTry("training-1", 2, (1, 2), last_try=False),
    }


def as_validated(name: str, value: Any) -> Any:
    """``value`` as the job keeps it (LaunchSpec normalises collections)."""
    if name == "torchrun_args":
        return tuple(value)
    if name == "log_ranks":
        return frozenset(value)
    return value
