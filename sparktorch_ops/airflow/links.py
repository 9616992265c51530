"""The operator extra links: the Spark UI of a barrier-mode run, and the MLflow run.

While the task runs, the operator pushes the live driver UI (or the History Server page) under
this link's XCom key as soon as its Spark session is up, so the button works during training.
When the task ends, Airflow asks :meth:`SparkUILink.get_link` once more and stores the answer:
the History Server page when one is configured (``spark.yarn.historyServer.address`` or
``spark.sparktorch.historyServer.url``), because the driver's live UI dies with the task;
otherwise an empty link.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey


class SparkUILink(BaseOperatorLink):
    """Link to the Spark UI of the task's run (History Server, else the live UI while running)."""

    name = "Spark UI"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        """The operator's Spark UI link as the task ends (``""`` when there is none).

        Airflow 3 calls this in the worker when the task finishes and stores the answer in XCom
        (the UI reads it from there); the operator keeps the link up to date while it runs.
        """
        return str(getattr(operator, "spark_ui_link", None) or "")

    def publish(self, detail: Mapping[str, Any], ti: Any, log: Any) -> str:
        """The session is up (``detail``: its SESSION_READY event's): push its UI to XCom
        for the button, and return the link to keep for the end of the task (only a History
        Server page outlives a session the task started)."""
        url = str(detail.get("ui_url") or "")
        if url:
            log.info("sparktorch_ops: Spark UI: %s", url)
            try:
                ti.xcom_push(key=self.xcom_key, value=url)
            except Exception:
                log.warning("sparktorch_ops: could not store the Spark UI link", exc_info=True)
        lasting = not detail.get("created") or "/history/" in url
        return url if lasting else ""


class MlflowRunLink(BaseOperatorLink):
    """Link to the task's MLflow run in the MLflow UI (an MLflow server's tracking URI)."""

    name = "MLflow run"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        """The run's MLflow page as the task ends (``""`` without tracking or a UI)."""
        return str(getattr(operator, "mlflow_run_link", None) or "")
