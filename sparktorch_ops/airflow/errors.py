"""The core's errors as Airflow's exceptions: whether Airflow may retry the task."""

from __future__ import annotations

from airflow.providers.common.compat.sdk import AirflowException, AirflowFailException

from sparktorch_ops.errors import SparkTorchError, outcome_of


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
