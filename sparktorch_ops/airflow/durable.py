"""Airflow's durable execution mapped onto a training: a task instance's tries are one training.

``ResumableJobMixin`` (Airflow 3.3 on) thinks of an external job that outlives a try; here the
"job" is the training's record in the ``task_state_store`` (:class:`TrainingRecord`): a try that
finds an earlier one dead or failed resumes it from its latest checkpoint, one that finds a
stored success returns that summary (docs/durable.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

# The common-compat provider (installed with Airflow) maps this onto each Airflow 3.x; below
# Airflow 3.3 its ResumableJobMixin is a stand-in that trains afresh on every try.
from airflow.providers.common.compat.sdk import ResumableJobMixin

from sparktorch_ops.driver.durable import (
    RESUMABLE,
    SUCCEEDED,
    StoredTraining,
    TrainingRecord,
    TrainingTry,
    status_of,
    stored_result,
    train_try,
)

if TYPE_CHECKING:
    from airflow.sdk import Context


class DurableTraining(ResumableJobMixin):
    """The mixin's protocol for an operator whose ``_train(context, training)`` trains one try
    and returns its XCom summary (``durable``, ``log`` and ``mlflow_run_link`` are the
    operator's)."""

    # The task_state_store key of the training's record (renaming it breaks in-flight retries).
    external_id_key = "sparktorch_training"
    durable: bool
    log: Any
    mlflow_run_link: str | None
    _summary: dict[str, Any] | None = None  # this try's, once it trained
    _train: Callable[[Context, TrainingTry | None], dict[str, Any]]

    def submit_job(self, context: Context) -> Any:
        """A new training's record (None: not durable)."""
        if not self.durable:
            return None
        return TrainingRecord.new(max_tries=context["ti"].max_tries).to_json()

    def get_job_status(self, external_id: Any, context: Context) -> str:
        """``resumable``, ``succeeded`` or ``cleared`` (see :class:`TrainingRecord`)."""
        return status_of(external_id, context["ti"].max_tries, self.log)

    def is_job_active(self, status: str) -> bool:
        """An earlier try died or failed: resume it."""
        return status == RESUMABLE

    def is_job_succeeded(self, status: str) -> bool:
        """An earlier try stored its summary: return it."""
        return status == SUCCEEDED

    # The mixin returns what this returns when it reconnects (a retry): the summary, not None.
    def poll_until_complete(  # type: ignore[override]
        self, external_id: Any, context: Context
    ) -> dict[str, Any]:
        """Train this try (resuming the training ``external_id`` records); store and return
        the summary."""
        ti: Any = context["ti"]
        store = context.get("task_state_store")
        save = functools.partial(store.set, self.external_id_key) if store is not None else None
        # Stored before Airflow pushes the XCom: a try that dies then is not trained again.
        self._summary = train_try(
            external_id, save, ti.try_number, ti.max_tries, lambda t: self._train(context, t)
        )
        return self._summary

    def store_summary(self, context: Context, summary: dict[str, Any]) -> dict[str, Any]:
        """A deferred try ends in ``execute_complete``: store its summary as a try that
        trained in place does (a later try returns it instead of training)."""
        store = context.get("task_state_store")
        stored = store.get(self.external_id_key) if self.durable and store is not None else None
        if store is not None and stored is not None:
            save = functools.partial(store.set, self.external_id_key)
            try_number = context["ti"].try_number
            StoredTraining(TrainingRecord.from_json(stored), save).finish(try_number, summary)
        self._summary = summary
        return summary

    def get_job_result(self, external_id: Any, context: Context) -> dict[str, Any]:
        """This try's summary, or the one an earlier try stored."""
        if self._summary is not None:
            return self._summary
        summary = cast("dict[str, Any]", stored_result(external_id, self.log))
        self.mlflow_run_link = summary.get("mlflow_run_url") or ""
        return summary
