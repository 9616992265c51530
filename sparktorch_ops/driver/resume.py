"""What the driver says about a run's checkpoints: resume, warm start or a fresh start."""

from __future__ import annotations

import logging
from typing import Any

from sparktorch_ops import checkpoint
from sparktorch_ops.driver.durable import try_line
from sparktorch_ops.spec import LaunchSpec


def latest_step(directory: str, log: logging.Logger) -> int | None:
    """The latest complete checkpoint's step as the driver sees it (None when it cannot look:
    a directory only the executors reach)."""
    try:
        return checkpoint.latest_step(directory=directory)
    except Exception as exc:
        log.warning(
            "sparktorch_ops: cannot list checkpoints in %s from the driver: %s", directory, exc
        )
        return None


def latest(spec: LaunchSpec, log: logging.Logger) -> int | None:
    """The run's latest complete checkpoint, as the driver sees it (None without
    ``checkpoint_dir``)."""
    directory = spec.checkpoint_dir
    return latest_step(directory, log) if directory is not None else None


def announce(spec: LaunchSpec, log: logging.Logger, mlflow_run_id: str | None = None) -> int | None:
    """Say whether the ranks will resume, warm start or start fresh, and what this try of a
    durable training does (``mlflow_run_id``: its MLflow run); the step resumed."""
    directory = spec.checkpoint_dir
    step = latest(spec, log)
    if spec.training is not None:
        log.info(try_line(spec.training, step, mlflow_run_id))
    if directory is None:
        return None
    warm = spec.warm_start_from
    if step is not None:
        log.info(
            "sparktorch_ops: resuming from step %d of checkpoint_dir %s%s",
            step,
            directory,
            f" (warm_start_from {warm} not used: a resume wins)" if warm else "",
        )
    elif warm is not None:
        log.info("sparktorch_ops: no checkpoint in %s yet: warm start from %s", directory, warm)
    else:
        log.info("sparktorch_ops: no checkpoint in %s yet: starting fresh", directory)
    return step


def summary(
    spec: LaunchSpec, resumed_from: int | None, log: logging.Logger
) -> dict[str, Any] | None:
    """The run result's ``checkpoint`` entry (None without a ``checkpoint_dir``)."""
    directory = spec.checkpoint_dir
    if directory is None:
        return None
    return {
        "dir": directory,
        "resumed_from_step": resumed_from,
        "warm_start_from": spec.warm_start_from if resumed_from is None else None,
        "latest_step": latest_step(directory, log),
    }
