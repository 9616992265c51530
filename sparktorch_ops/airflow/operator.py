"""TorchDistributorOperator: a thin Airflow operator over :class:`sparktorch_ops.TorchDistributor`.

It renders its templated fields, checks them before anything starts, opens the Spark session of
a barrier-mode run from an Airflow ``spark`` connection, calls the core, and maps the outcome to
Airflow: an XCom summary, the task log, an extra link, and Airflow's exceptions.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from sparktorch_ops.airflow import storage
from sparktorch_ops.airflow.connection import (
    DEFAULT_CONN_ID,
    MissingConnectionError,
    SparkConnection,
    is_local_master,
    resolve_connection,
)
from sparktorch_ops.airflow.links import SparkUILink
from sparktorch_ops.errors import (
    ConfigError,
    SparkTorchError,
    StartTimeoutError,
    TrainingCancelledError,
    TrainingFailedError,
    TrainingTimeoutError,
)

if TYPE_CHECKING:
    from airflow.sdk import Context

    from sparktorch_ops.distributor import TorchDistributor
    from sparktorch_ops.results import MetricRecord, RunResult

_KILL_POLL_S = 0.1


class TorchTrainingError(AirflowException):
    """Training failed, timed out or was cancelled; Airflow may retry the task.

    The message names the failing rank and ends with its traceback tail, so the task's failure
    in the Airflow UI says why.
    """


class TorchDistributorOperator(BaseOperator):
    """Run a PyTorch training function or torchrun script with sparktorch_ops.

    Each rank's output goes to the task log as it arrives (``[rank N|host] line``; stdout at INFO,
    stderr at WARNING). The return value, pushed as XCom, is a small JSON-safe summary:
    ``value`` (rank 0's return value, or rank 0's stdout for a script) when it is JSON-safe and
    at most ``max_xcom_value_bytes`` as JSON, else ``value_uri`` / ``value_size`` /
    ``value_format`` pointing at the copy written under ``result_location`` (read it back with
    :func:`sparktorch_ops.airflow.load_result`); and ``metrics`` (rank 0's latest reported
    values), ``progress``, ``duration_s``, ``num_processes``, ``mode``, ``app_id``, ``ui_url``,
    ``run_id``, ``exit_codes``, ``started_at``, ``finished_at``.

    Barrier mode (``local_mode=False``) takes its Spark master from the Spark provider's ``spark``
    connection ``conn_id`` (host = master URL). The default ``spark_default`` may be absent (then
    local Spark, ``local[*]``); any other missing connection is an error. When a SparkContext is
    already active in the process it is reused as it is (a running context's master and
    settings cannot change). ``local_mode=True`` starts no Spark at all.

    Bad input (an unknown ``conn_id``, a ``train`` that is neither callable nor an existing
    script, a non-integer ``num_processes``, anything the core rejects) raises
    ``AirflowFailException`` before anything starts: no retry. Failed, timed-out or cancelled
    training raises :class:`TorchTrainingError`, which Airflow retries as configured.

    Args:
        train: the training function (called on every rank as ``train(*train_args,
            **train_kwargs)``) or the path of a torchrun script (templated).
        train_args: the function's positional arguments, or the script's argv (templated).
        train_kwargs: the function's keyword arguments (templated).
        num_processes: total number of ranks (templated; an integer after rendering).
        local_mode: run the ranks on the worker (True) or in Spark barrier tasks (False).
        use_gpu: give every rank its own GPU (as pyspark's TorchDistributor, default True).
        conn_id: Airflow ``spark`` connection with the master for barrier mode.
        spark_conf: Spark settings for the session this task creates (templated); they
            override the connection's ``spark.*`` extras.
        env: extra environment variables for every rank (templated).
        max_restarts: torchrun's worker-group restarts within one run.
        timeout: seconds (or a timedelta) the whole run may take.
        start_timeout: seconds (or a timedelta) to wait for slots, executors and rendezvous.
        torchrun_args: further torchrun options.
        log_ranks: ranks whose output goes to the task log (default: all).
        result_location: where large or non-JSON values go (templated): a directory or an
            ObjectStoragePath / fsspec URL. Default: ``[sparktorch_ops] result_location``, else
            ``$AIRFLOW_HOME/sparktorch_ops/results``.
        max_xcom_value_bytes: the largest JSON-safe value kept inline (default:
            ``[sparktorch_ops] max_xcom_value_bytes``, else 48 KB).
        **kwargs: BaseOperator arguments (``task_id``, ``retries``, ``execution_timeout``...).
    """

    template_fields: Sequence[str] = (
        "train",
        "train_args",
        "train_kwargs",
        "num_processes",
        "spark_conf",
        "env",
        "result_location",
    )
    template_fields_renderers: ClassVar[dict[str, str]] = {
        "train_kwargs": "py",
        "spark_conf": "json",
        "env": "json",
    }
    operator_extra_links = (SparkUILink(),)
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
        timeout: float | datetime.timedelta | None = None,
        start_timeout: float | datetime.timedelta | None = None,
        torchrun_args: Sequence[str] | None = None,
        log_ranks: Sequence[int] | None = None,
        result_location: str | None = None,
        max_xcom_value_bytes: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.train = os.fspath(train) if isinstance(train, os.PathLike) else train
        if callable(self.train):
            # Airflow calls a callable template field with the context to render it; a training
            # function must reach the ranks as it is.
            self.template_fields = tuple(f for f in type(self).template_fields if f != "train")
        self.train_args = list(train_args) if train_args is not None else []
        self.train_kwargs = dict(train_kwargs) if train_kwargs is not None else {}
        self.num_processes = num_processes
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self.conn_id = conn_id
        self.spark_conf = dict(spark_conf) if spark_conf is not None else {}
        self.env = dict(env) if env is not None else {}
        self.max_restarts = max_restarts
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.torchrun_args = list(torchrun_args) if torchrun_args is not None else None
        self.log_ranks = list(log_ranks) if log_ranks is not None else None
        self.result_location = result_location
        self.max_xcom_value_bytes = max_xcom_value_bytes
        # Read by SparkUILink when the task ends; None: not known in this process.
        self.spark_ui_link: str | None = None
        self._distributor: TorchDistributor | None = None
        self._killed = False
        self._jvm_started_here = False
        self._session_keys: list[str] = []

    # -- Airflow entry points -------------------------------------------------------------

    def execute(self, context: Context) -> dict[str, Any]:
        """Check the rendered arguments, run the training, return the XCom summary."""
        self.spark_ui_link = ""
        self._killed = False  # a kill of an earlier try in this process is not this try's
        num_processes, train = self._checked_input()
        self._make_distributor(num_processes, spark=None)  # the core's checks, before Spark
        connection = self._connection()
        session, created = None, False
        done = threading.Event()
        try:
            if not self.local_mode:
                session, created = self._spark_session(connection)
                self._publish_ui_link(session, context)
            distributor = self._make_distributor(num_processes, spark=session)
            self._distributor = distributor
            threading.Thread(
                target=self._forward_kill, args=(distributor, done), daemon=True
            ).start()
            if self._killed:
                raise TrainingCancelledError("on_kill() was called before the launch")
            result = distributor.launch(train, *self.train_args, **self.train_kwargs)
        except ConfigError as exc:
            raise AirflowFailException(f"sparktorch_ops: bad input: {exc}") from exc
        except TrainingFailedError as exc:
            raise TorchTrainingError(f"training failed: {exc}") from exc
        except (StartTimeoutError, TrainingTimeoutError, TrainingCancelledError) as exc:
            raise TorchTrainingError(str(exc)) from exc
        except SparkTorchError as exc:
            raise TorchTrainingError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            done.set()
            self._distributor = None
            if created and session is not None:
                try:
                    self._stop_session(session)
                except Exception:  # must not hide the run's own outcome
                    self.log.warning("sparktorch_ops: could not stop Spark", exc_info=True)
        return self._summary(result, context)

    def on_kill(self) -> None:
        """Cancel the run: the Spark job is interrupted and every process of the run ends.

        Airflow calls this from its SIGTERM handler on the main thread, and when
        ``execution_timeout`` expires. It only sets flags (the core's ``cancel()`` does the
        same): the thread that waits in ``execute`` tears the run down and raises.
        """
        self._killed = True
        distributor = self._distributor
        if distributor is not None:
            distributor.cancel()

    # -- steps ----------------------------------------------------------------------------

    def _checked_input(self) -> tuple[int, Callable[..., Any] | str]:
        """The rendered ``num_processes`` and ``train``; AirflowFailException when bad."""
        value: Any = self.num_processes
        if isinstance(value, bool):
            raise AirflowFailException(f"num_processes: must be an integer, got {value!r}")
        try:
            num_processes = int(str(value).strip()) if isinstance(value, str) else int(value)
        except (TypeError, ValueError):
            raise AirflowFailException(
                f"num_processes: must be an integer after templating, got {value!r}"
            ) from None
        if isinstance(value, float) and value != num_processes:
            raise AirflowFailException(f"num_processes: must be an integer, got {value!r}")
        train: Any = self.train
        if callable(train):
            return num_processes, train
        if isinstance(train, str):
            path = Path(train.strip()).expanduser()
            if not path.is_file():
                raise AirflowFailException(
                    f"train: the script {train!r} does not exist (after templating; resolved: "
                    f"{path.resolve()})"
                )
            if self.train_kwargs:
                raise AirflowFailException(
                    "train_kwargs: a script takes command-line arguments only; pass "
                    f"{sorted(self.train_kwargs)} as '--name=value' strings in train_args"
                )
            return num_processes, str(path)
        raise AirflowFailException(
            "train: must be a callable or the path of a Python script, got "
            f"{type(train).__name__} ({train!r})"
        )

    def _make_distributor(self, num_processes: int, spark: Any) -> TorchDistributor:
        from sparktorch_ops.distributor import TorchDistributor

        try:
            return TorchDistributor(
                num_processes=num_processes,
                local_mode=self.local_mode,
                use_gpu=self.use_gpu,
                spark=spark,
                env={str(k): str(v) for k, v in self.env.items()},
                max_restarts=self.max_restarts,
                torchrun_args=self.torchrun_args,
                logger=self.log,
                on_metrics=self._on_metrics,
                start_timeout=self.start_timeout,
                timeout=self.timeout,
                log_ranks=self.log_ranks,
            )
        except ConfigError as exc:
            raise AirflowFailException(f"sparktorch_ops: bad input: {exc}") from exc

    def _connection(self) -> SparkConnection | None:
        """The Spark connection for barrier mode (also checked in local mode when explicit)."""
        if self.local_mode and self.conn_id == DEFAULT_CONN_ID:
            return None
        try:
            connection = resolve_connection(self.conn_id, self.log)
        except (MissingConnectionError, ValueError) as exc:
            raise AirflowFailException(str(exc)) from None
        if self.local_mode:
            self.log.info(
                "sparktorch_ops: local_mode=True runs the ranks on this worker without Spark; "
                "connection %r is not used",
                self.conn_id,
            )
            return None
        return connection

    def _spark_session(self, connection: SparkConnection | None) -> tuple[Any, bool]:
        """The active session (reused as it is), else a new one from the connection."""
        from sparktorch_ops import spark as spark_support

        active = spark_support.active_session()
        if active is not None:
            master = active.sparkContext.master
            if self.conn_id != DEFAULT_CONN_ID or self.spark_conf:
                self.log.warning(
                    "sparktorch_ops: reusing the SparkContext already running in this process "
                    "(master %s); conn_id %r and spark_conf cannot change a running context and "
                    "are not applied",
                    master,
                    self.conn_id,
                )
            else:
                self.log.info("sparktorch_ops: reusing the active SparkSession (master %s)", master)
            return active, False
        from pyspark import SparkContext
        from pyspark.sql import SparkSession

        assert connection is not None
        self._jvm_started_here = SparkContext._gateway is None
        conf = {**connection.conf, **{str(k): str(v) for k, v in self.spark_conf.items()}}
        if is_local_master(connection.master):
            # Loopback for a driver that only talks to itself; a cluster's driver address is
            # the cluster's business (spark_conf or the connection's extra).
            conf.setdefault("spark.driver.host", "127.0.0.1")
        builder = SparkSession.builder.master(connection.master).appName(
            f"airflow-{self.dag_id}-{self.task_id}"
        )
        for key, value in conf.items():
            builder = builder.config(key, value)
        self.log.info(
            "sparktorch_ops: starting a SparkSession on %s (connection %s)",
            connection.master,
            connection.conn_id or "none: local Spark",
        )
        session = builder.getOrCreate()
        self._session_keys = ["spark.master", "spark.app.name", *conf]
        return session, True

    def _publish_ui_link(self, session: Any, context: Context) -> None:
        from sparktorch_ops import spark as spark_support

        try:
            url = spark_support.ui_url(session.sparkContext) or ""
        except Exception:  # a link must never fail the task
            url = ""
        self.spark_ui_link = url
        if url:
            self.log.info("sparktorch_ops: Spark UI: %s", url)
            try:
                context["ti"].xcom_push(key=SparkUILink().xcom_key, value=url)
            except Exception:
                self.log.warning("sparktorch_ops: could not store the Spark UI link", exc_info=True)

    def _stop_session(self, session: Any) -> None:
        from sparktorch_ops import spark as spark_support

        sc = session.sparkContext
        live = sc.uiWebUrl
        final = spark_support.ui_url(sc)
        # The live UI dies with this session; only a History Server page outlives it.
        self.spark_ui_link = final if final and final != live else ""
        jvm = sc._jvm
        session.stop()
        if self._jvm_started_here and jvm is not None:
            # pyspark starts its JVM with the first session's settings as Java system
            # properties, which every later SparkContext of this process would inherit (a
            # dag.test() runs all tasks in one process): this task's settings end with it.
            for key in self._session_keys:
                try:
                    jvm.java.lang.System.clearProperty(key)
                except Exception:
                    self.log.debug("sparktorch_ops: could not clear %s", key, exc_info=True)

    def _forward_kill(self, distributor: TorchDistributor, done: threading.Event) -> None:
        """Repeat cancel() while execute runs: on_kill may come before the run registered."""
        while not done.wait(_KILL_POLL_S):
            if self._killed:
                distributor.cancel()

    def _on_metrics(self, record: MetricRecord) -> None:
        if record.rank != 0:
            return
        values = " ".join(f"{k}={v}" for k, v in record.values.items())
        if record.progress is not None:
            self.log.info(
                "sparktorch_ops: step %s progress %.0f%% %s",
                record.step,
                100 * record.progress,
                values,
            )
        else:
            self.log.info("sparktorch_ops: step %s %s", record.step, values)

    def _summary(self, result: RunResult, context: Context) -> dict[str, Any]:
        ti: Any = context["ti"]
        location = self.result_location or storage.default_result_location()
        max_bytes = (
            self.max_xcom_value_bytes
            if self.max_xcom_value_bytes is not None
            else storage.default_max_xcom_value_bytes()
        )
        key = storage.result_key(
            ti.dag_id, ti.run_id, ti.task_id, getattr(ti, "map_index", -1), ti.try_number
        )
        started = time.monotonic()
        try:
            fields = storage.value_fields(
                result.value, location=str(location), key=key, max_bytes=int(max_bytes)
            )
        except Exception as exc:
            raise TorchTrainingError(
                f"training succeeded but rank 0's value could not be written to "
                f"{location!r}: {type(exc).__name__}: {exc}"
            ) from exc
        if "value_uri" in fields:
            self.log.info(
                "sparktorch_ops: rank 0's value (%s) written to %s (%d bytes, %.1f s)",
                fields["value_stored_because"],
                fields["value_uri"],
                fields["value_size"],
                time.monotonic() - started,
            )
        metrics = {k: storage.json_scalar(v) for k, v in result.final_metrics(0).items()}
        summary: dict[str, Any] = {
            **fields,
            "metrics": metrics,
            "progress": result.progress,
            "duration_s": round(result.duration.total_seconds(), 3),
            "num_processes": result.num_processes,
            "mode": result.mode,
            "app_id": result.app_id,
            "ui_url": result.ui_url,
            "run_id": result.run_id,
            "exit_codes": {str(rank): code for rank, code in sorted(result.exit_codes.items())},
            "started_at": result.started_at.isoformat(),
            "finished_at": result.finished_at.isoformat(),
        }
        if result.output_truncated:
            summary["output_truncated"] = True
        return summary
