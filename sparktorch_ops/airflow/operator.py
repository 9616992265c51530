"""TorchDistributorOperator: a thin Airflow operator over the sparktorch_ops core.

It renders its templated fields, turns them and its Spark connection into the core's job
(:func:`sparktorch_ops.job.build_job`), launches it, and maps the result and the core's outcome
to Airflow: an XCom summary, the task log, an extra link, and Airflow's exceptions (bad input
fails without a retry, anything else may be retried).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

from airflow.providers.common.compat.sdk import AirflowFailException, conf
from airflow.sdk import BaseOperator

from sparktorch_ops import events, options
from sparktorch_ops.airflow import deferred, storage
from sparktorch_ops.airflow.connection import (
    DEFAULT_CONN_ID,
    MissingConnectionError,
    mlflow_tracking_uri,
    session_settings,
)
from sparktorch_ops.airflow.durable import DurableTraining
from sparktorch_ops.airflow.errors import airflow_error
from sparktorch_ops.airflow.links import MlflowRunLink, SparkUILink
from sparktorch_ops.errors import ConfigError, SparkTorchError
from sparktorch_ops.job import CancelToken, build_job
from sparktorch_ops.options import DEFAULT_MAX_RESULT_BYTES
from sparktorch_ops.spark.dataframe import DataInput
from sparktorch_ops.spark.session import SparkSettings, redact_connect_url

if TYPE_CHECKING:
    from airflow.sdk import Context

    from sparktorch_ops.driver.durable import TrainingTry
    from sparktorch_ops.results import MetricRecord, RunResult


@options.documented("operator")
class TorchDistributorOperator(DurableTraining, BaseOperator):
    """Run a PyTorch training function or torchrun script with sparktorch_ops.

    Rank output goes to the task log live (``[rank N|host] line``; stdout at INFO, stderr at
    WARNING). The XCom is :meth:`RunResult.summary` plus ``value`` (rank 0's value, or a
    script's stdout) when JSON-safe and at most ``max_xcom_value_bytes``, else ``value_uri``,
    ``value_size``, ``value_format`` and ``value_sha256`` of a copy under ``result_location``
    (:func:`sparktorch_ops.airflow.load_result` reads it back).

    Barrier mode takes its master from the Spark provider's ``spark`` connection ``conn_id``,
    or a Spark Connect session from a ``spark_connect`` one (the token is never logged); an
    absent ``spark_default`` means ``spark_conf``'s ``spark.master``, else ``local[*]``. A
    running SparkContext is reused; local mode starts Spark only to read an ``input_*``.
    Bad input raises ``AirflowFailException`` before anything starts (no retry); failed,
    timed-out or cancelled training raises :class:`TorchTrainingError` (retried).

    **Durable** (:class:`DurableTraining`, Airflow 3.3 on): a task instance's tries are one
    training: a retry resumes from the latest checkpoint (by default under ``result_location``)
    into the same MLflow run (docs/durable.md), tagged with the dag, run, task and try.

    Args:
        train: the training function (called on every rank as ``train(*train_args,
            **train_kwargs)``) or the path of a torchrun script (templated).
        train_args: the function's positional arguments, or the script's argv (templated).
        train_kwargs: the function's keyword arguments (templated).
        <launch options>
        **kwargs: BaseOperator arguments (``task_id``, ``retries``, ``execution_timeout``...).
    """

    # ``train`` is rendered in ``execute``, and only when it is a script's path: Airflow calls a
    # callable template field with the context, also in a mapped task (which renders with
    # these class-level fields), and a training function must reach the ranks as it is.
    template_fields: Sequence[str] = (
        "train_args",
        "train_kwargs",
        *(option.name for option in options.taken("operator") if option.templated),
    )
    template_fields_renderers: ClassVar[dict[str, str]] = {
        "train_kwargs": "py",
        "input_sql": "sql",
        "spark_conf": "json",
        "env": "json",
    }
    operator_extra_links = (SparkUILink(), MlflowRunLink())
    # Set with the other launch options in __init__; read here besides passing them on.
    local_mode: bool
    checkpoint_dir: str | None
    mlflow_experiment: str | None
    mlflow_tracking_uri: str | None
    run_dir: str | None
    ui_color = "#ee4c2c"

    def __init__(
        self,
        *,
        train: Callable[..., Any] | str | os.PathLike[str],
        train_args: Sequence[Any] | None = None,
        train_kwargs: Mapping[str, Any] | None = None,
        num_processes: int | str = 1,
        local_mode: bool = True,
        use_gpu: bool = True,
        conn_id: str = DEFAULT_CONN_ID,
        spark_conf: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        max_restarts: int = 0,
        max_failures: int = 0,
        min_processes: int | str | None = None,
        timeout: float | datetime.timedelta | None = None,
        start_timeout: float | datetime.timedelta | None = None,
        stall_timeout: float | datetime.timedelta | None = None,
        torchrun_args: Sequence[str] | None = None,
        log_ranks: Sequence[int] | None = None,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        max_local_processes: int | None = None,
        allow_unencrypted_channel: bool = False,
        channel_host: str | None = None,
        detached: bool = False,
        run_dir: str | None = None,
        result_location: str | None = None,
        max_xcom_value_bytes: int | None = None,
        input_sql: str | None = None,
        input_table: str | None = None,
        input_path: str | None = None,
        input_format: str = "parquet",
        checkpoint_dir: str | None = None,
        warm_start_from: str | None = None,
        mlflow_experiment: str | None = None,
        mlflow_tracking_uri: str | None = None,
        mlflow_all_ranks: bool = False,
        mlflow_conn_id: str = "mlflow_default",
        durable: bool = True,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        **kwargs: Any,
    ) -> None:
        # Named here (not left to **kwargs) so that default_args={"durable": ...} reaches it.
        # The mixin's own default is True; below Airflow 3.3 its stand-in warns that any
        # durable= given has no effect, so only a training that asks not to be durable says so.
        if not durable:
            kwargs["durable"] = durable
        super().__init__(**kwargs)
        self.train = os.fspath(train) if isinstance(train, os.PathLike) else train
        self.train_args = list(train_args) if train_args is not None else []
        self.train_kwargs = dict(train_kwargs) if train_kwargs is not None else {}
        for name, value in options.values_of("operator", locals()).items():
            setattr(self, name, value)
        self.conn_id = conn_id
        self.spark_conf = dict(spark_conf) if spark_conf is not None else {}
        self.result_location = result_location
        self.max_xcom_value_bytes = max_xcom_value_bytes
        self.input_sql, self.input_table = input_sql, input_table
        self.input_path, self.input_format = input_path, input_format
        self.mlflow_conn_id = mlflow_conn_id
        self.deferrable = deferrable
        self.mlflow_run_link: str | None = None
        # Read by SparkUILink when the task ends; None: not known in this process.
        self.spark_ui_link: str | None = None
        # Made up front so that on_kill during templating is not lost; a fresh one per try.
        self._cancel_token = CancelToken()

    def execute(self, context: Context) -> dict[str, Any]:
        """Train (or, durable, resume the training, or return its stored summary); return
        the XCom summary."""
        self._summary = None
        return cast("dict[str, Any]", self.execute_resumable(context))

    def _train(self, context: Context, training: TrainingTry | None) -> dict[str, Any]:
        """Build the job from the rendered arguments, run it, return the XCom summary."""
        self.spark_ui_link = ""
        self.mlflow_run_link = ""
        token = self._cancel_token
        try:
            data = self._data_input()
            ti: Any = context["ti"]
            location = self._result_location()
            training_id = training.training_id if training else None
            launch = {
                **options.values_of("operator", self),
                "checkpoint_dir": self.checkpoint_dir
                or storage.task_location(ti, location, "checkpoints", training_id),
                "mlflow_tracking_uri": mlflow_tracking_uri(
                    self.mlflow_tracking_uri, self.mlflow_experiment, self.mlflow_conn_id, self.log
                ),
            }
            if self.deferrable:
                launch["detached"] = True
                launch["run_dir"] = self.run_dir or storage.task_location(
                    ti, location, "runs", training_id
                )
            train = self.train
            if isinstance(train, str):
                train = self.render_template(train, context)
            job = build_job(
                train=train,
                train_args=self.train_args,
                train_kwargs=self.train_kwargs,
                spark=self._spark_settings(),
                mlflow_tags=_mlflow_tags(ti),
                logger=self.log,
                on_metrics=self._on_metrics,
                on_event=lambda event: self._on_event(event, ti),
                cancel_token=token,
                data=data,
                training=training,
                **launch,
            )
            if self.deferrable:
                deferred.defer_training(self, job, context)
            from sparktorch_ops.distributor import launch_job

            result = launch_job(job)
        except SparkTorchError as exc:
            raise airflow_error(exc) from exc
        finally:
            self._cancel_token = CancelToken()  # a kill of this try is not the next try's
        return self._xcom_summary(result, ti)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """The deferred training ended: the same XCom summary as ``execute`` returns."""
        ti: Any = context["ti"]
        if deferred.stopped_for_an_earlier_try(event, ti.try_number, self.log):
            return self.execute(context)  # a cleared task's: its training starts over
        try:
            result = deferred.ended_run(event)
        except SparkTorchError as exc:
            raise airflow_error(exc) from exc
        if result.ui_url:
            self.spark_ui_link = SparkUILink().publish({"ui_url": result.ui_url}, ti, self.log)
        return self.store_summary(context, self._xcom_summary(result, ti))

    def on_kill(self) -> None:
        """Cancel the run: the Spark job is interrupted and every process of the run ends.

        Airflow calls this from its SIGTERM handler on the main thread, and when
        ``execution_timeout`` expires. It only sets a flag: the thread that waits in
        ``execute`` tears the run down and raises.
        """
        self._cancel_token.cancel("the Airflow task was killed (on_kill)")

    def _result_location(self) -> str:
        return str(self.result_location or storage.default_result_location())

    def _xcom_summary(self, result: RunResult, ti: Any) -> dict[str, Any]:
        self.mlflow_run_link = result.mlflow_run_url or ""
        location = self._result_location()
        return storage.xcom_summary(result, ti, location, self.max_xcom_value_bytes, self.log)

    def _data_input(self) -> DataInput | None:
        """The rendered ``input_*`` arguments as the core's input, or None."""
        return DataInput.given(
            None, self.input_sql, self.input_table, self.input_path, self.input_format
        )

    def _spark_settings(self) -> SparkSettings:
        """The session settings from ``conn_id`` and ``spark_conf`` (local mode: only to read
        an ``input_*``); a bad connection or conf fails the task without retry."""
        try:
            return session_settings(
                self.conn_id,
                self.spark_conf,
                local_only=self.local_mode and self._data_input() is None,
                app_name=f"airflow-{self.dag_id}-{self.task_id}",
                log=self.log,
            )
        except (MissingConnectionError, ValueError) as exc:
            # A ConfigError's message may quote a Connect URL, token and all.
            prefix = "sparktorch_ops: bad input: " if isinstance(exc, ConfigError) else ""
            raise AirflowFailException(prefix + redact_connect_url(str(exc))) from exc

    def _on_event(self, event: events.PhaseEvent, ti: Any) -> None:
        if event.name == events.SESSION_READY:
            self.spark_ui_link = SparkUILink().publish(event.detail, ti, self.log)

    def _on_metrics(self, record: MetricRecord) -> None:
        if record.rank == 0:
            self.log.info("sparktorch_ops: %s", record.describe())


def _mlflow_tags(ti: Any) -> dict[str, str]:
    """MLflow tags that find the task try that trained."""
    names = ["dag_id", "run_id", "task_id", "try_number"]
    names += ["map_index"] if storage.task_ids(ti)[3] >= 0 else []
    return {f"airflow.{name}": str(getattr(ti, name)) for name in names}
