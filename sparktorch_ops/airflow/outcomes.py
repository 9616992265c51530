"""How a training ends, in Airflow's terms: its exceptions, and the XCom summary of a success."""

from __future__ import annotations

from typing import Any

from airflow.providers.common.compat.sdk import AirflowException, AirflowFailException

from sparktorch_ops.airflow import storage, task_instance
from sparktorch_ops.errors import SparkTorchError, outcome_of
from sparktorch_ops.results import RunResult


class TorchTrainingError(AirflowException):
    """Training failed, timed out or was cancelled; Airflow may retry the task.

    The message names the failing rank and ends with its traceback tail, so the task's failure
    in the Airflow UI says why.
    """


def airflow_error(exc: SparkTorchError) -> AirflowException:
    """The core's error as Airflow's: bad input fails the task without a retry
    (``AirflowFailException``), anything else may be retried (:class:`TorchTrainingError`)."""
    outcome = outcome_of(exc)
    if not outcome.retryable:
        return AirflowFailException(f"sparktorch_ops: {outcome.message}")
    return TorchTrainingError(outcome.message)


def summary_of(
    result: RunResult, ti: Any, location: str, max_bytes: int | None, log: Any
) -> dict[str, Any]:
    """The XCom summary of a finished training: rank 0's value inline, or stored under
    ``location`` (a write that fails is a :class:`TorchTrainingError`)."""
    try:
        return storage.xcom_summary(
            result,
            location=location,
            key=task_instance.result_key(ti),
            max_bytes=max_bytes,
            log=log,
        )
    except Exception as exc:
        raise TorchTrainingError(
            f"training succeeded but rank 0's value could not be written to "
            f"{location!r}: {type(exc).__name__}: {exc}"
        ) from exc
