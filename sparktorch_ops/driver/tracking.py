"""MLflow tracking from the driver: one MLflow run per training run, never one per rank.

With ``mlflow_experiment=`` (or ``mlflow_tracking_uri=``) set, :class:`MlflowTracker` opens an
MLflow run before anything starts, on the caller's thread (so an MLflow run active there
becomes its parent), and logs to it from the driver only:

* params: ``num_processes``, ``mode``, ``use_gpu``, ``max_restarts``, the training function or
  script, its arguments as far as they are loggable, ``torchrun_args``;
* every ``sparktorch_ops.report()`` record as metrics at its step (rank 0's; with
  ``mlflow_all_ranks=True`` every rank's, other ranks' keys suffixed ``/rank<N>``), logged
  with MLflow's asynchronous logging (``synchronous=False``) so a slow tracking server never
  slows the run (a report waits only while a thousand are unsent); MLflow merges what is queued
  into fewer requests when ``MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS`` is set;
* tags: the run id, the Spark application id and UI link, and whatever the orchestrator adds
  (Airflow's dag/run/task, Prefect's flow run); at the end the outcome, ``duration_s`` and
  the run's status (``FINISHED``, ``FAILED`` or ``KILLED`` for a cancelled run).

A durable training (:class:`~sparktorch_ops.driver.durable.TrainingTry`) has one MLflow run for
all its tries: a later try reopens the earlier one's (``RUNNING`` again, tagged with the tries it
spans) instead of creating another; a try that fails with a retry to come leaves it
``RUNNING``; the metrics a resumed checkpoint replays are logged only where the continued run
lacks them (a new run, as without ``durable``, takes none: they are the earlier run's).

The ranks never talk to MLflow: the tracking URI and credentials (``MLFLOW_TRACKING_*``) are
removed from their environment (:func:`~sparktorch_ops.wire.env.strip_tracking_env`). The
tracking URI is ``mlflow_tracking_uri=``, else ``MLFLOW_TRACKING_URI``, else MLflow's default.
mlflow is imported only when tracking is on (extra ``sparktorch_ops[mlflow]``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from sparktorch_ops.driver.durable import TRAINING_ID_TAG, TRIES_TAG
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.events import ATTEMPT_STARTED, SESSION_READY

#: The attempts a run made (``max_failures``), set once a second one starts.
ATTEMPTS_TAG = "sparktorch_ops.attempts"

_PARAM_VALUE_LIMIT = 6000  # MLflow's limit on a param value
_MAX_PENDING = 1000  # MLflow operations in flight before a report waits for the oldest
_FLUSH_TIMEOUT_S = 60.0  # how long the run's end waits for MLflow to take what is queued
# MLflow keeps one async queue per tracking URI in a process, and set_terminated shuts it down
# and starts it again: a batch queued by one run while another ends could be lost or stranded,
# so queueing and ending take turns.
_QUEUE_TURNS = threading.Lock()


def loggable_params(train: str, args: Any, kwargs: Mapping[str, Any], spec: Any) -> dict[str, str]:
    """The run's params as MLflow takes them (strings, cut to MLflow's limit); arguments that
    are not JSON (tensors, DataFrames) are named by type, not dumped."""

    def text(value: Any) -> str:
        try:
            rendered = json.dumps(value, default=lambda v: f"<{type(v).__name__}>")
        except (TypeError, ValueError):
            rendered = f"<{type(value).__name__}>"
        return rendered[:_PARAM_VALUE_LIMIT]

    params = {
        "num_processes": str(spec.num_processes),
        "mode": spec.mode,
        "use_gpu": str(spec.use_gpu),
        "max_restarts": str(spec.max_restarts),
        "train": train,
    }
    if args:
        params["args"] = text(list(args))
    for key, value in kwargs.items():
        params[f"kwargs.{key}"] = text(value)
    if spec.torchrun_args:
        params["torchrun_args"] = " ".join(spec.torchrun_args)
    return params


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The MLflow UI's page of a run, when the tracking URI is an MLflow server (http[s])."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


class MlflowTracker:
    """One training run's MLflow run, written from the driver.

    Args:
        experiment: the experiment name (created when missing); None: MLflow's default.
        tracking_uri: the tracking URI; None: ``MLFLOW_TRACKING_URI`` or MLflow's default.
        all_ranks: log every rank's records (other ranks' keys suffixed ``/rank<N>``).
        log: where problems with the tracking server are reported (they never fail a run).

    Raises:
        ConfigError: mlflow is not installed, or the tracking server or experiment cannot
            be reached, before anything of the run starts.
    """

    def __init__(
        self,
        experiment: str | None,
        tracking_uri: str | None,
        *,
        all_ranks: bool = False,
        log: logging.Logger | Any,
    ) -> None:
        try:
            import mlflow
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ConfigError(
                "mlflow_experiment",
                f"needs mlflow ({exc}): pip install 'sparktorch_ops[mlflow]'",
            ) from None
        self.log = log
        self.all_ranks = all_ranks
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        argument = "mlflow_tracking_uri" if tracking_uri else "mlflow_experiment"
        try:
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            self.experiment_id = self._experiment_id(experiment)
        except Exception as exc:
            raise ConfigError(
                argument, f"MLflow at {self.tracking_uri} cannot be used: {_first_line(exc)}"
            ) from exc
        # Read here, on the caller's thread: mlflow's active run is thread-local.
        active = mlflow.active_run()
        self.parent_run_id = active.info.run_id if active is not None else None
        self.run_id = ""
        self.url: str | None = None
        # Steps a continued run already has per metric key: replays skip them. None: a new
        # run, which takes no replayed records (they belong to another run's curve).
        self._logged: dict[str, set[int]] | None = None
        self.replayed_logged = 0  # replayed metrics the run lacked, logged by this try
        # The steps this tracker logged, by metric, and a copy of them as a later attempt
        # started: that attempt trains again from its checkpoint, and a step it reports again
        # is not logged twice. Reports and events come from several threads: _lock.
        self._sent: dict[str, set[int]] = {}
        self._before_attempt: dict[str, set[int]] = {}
        self._pending: deque[Any] = deque()  # MLflow's RunOperations, oldest first
        self._lock = threading.Lock()
        self._started = 0.0

    def _experiment_id(self, name: str | None) -> str:
        if name is None:
            return "0"
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except Exception:  # created meanwhile by another run
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def start(self, run_name: str, params: Mapping[str, str], tags: Mapping[str, str]) -> str:
        """Create the MLflow run (nested under the caller's active run, if any); its id."""
        all_tags = dict(tags)
        if self.parent_run_id is not None:
            all_tags["mlflow.parentRunId"] = self.parent_run_id
        from mlflow.entities import Param

        try:
            run = self.client.create_run(self.experiment_id, tags=all_tags, run_name=run_name)
        except Exception as exc:
            raise ConfigError(
                "mlflow_experiment", f"MLflow could not create the run: {_first_line(exc)}"
            ) from exc
        self.run_id = run.info.run_id
        self.url = run_url(self.tracking_uri, self.experiment_id, self.run_id)
        self._started = time.monotonic()
        try:
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])
        except Exception as exc:
            # Nothing of the training started: end the MLflow run instead of leaving it RUNNING.
            with _QUEUE_TURNS:
                self._call(self.client.set_terminated, self.run_id, status="FAILED")
            raise ConfigError(
                "mlflow_experiment", f"MLflow refused the run's params: {_first_line(exc)}"
            ) from exc
        self._begin("")
        return self.run_id

    def resume(self, run_id: str, tags: Mapping[str, str]) -> str | None:
        """Continue the MLflow run ``run_id`` of an earlier try: RUNNING again, ``tags`` set,
        the steps it has noted so replayed metrics are not logged twice. None when the run
        is gone (deleted, or on another server): the caller starts a new one."""
        try:
            run = self.client.get_run(run_id)
        except Exception as exc:
            self.log.warning(
                "sparktorch_ops: the MLflow run %s of the earlier try cannot be continued "
                "(%s); starting a new run",
                run_id,
                _first_line(exc),
            )
            return None
        if run.info.lifecycle_stage != "active":
            self.log.warning(
                "sparktorch_ops: the MLflow run %s of the earlier try was deleted; starting a "
                "new run",
                run_id,
            )
            return None
        try:
            self.client.update_run(run_id, status="RUNNING")
            self._logged = {
                key: {metric.step for metric in self.client.get_metric_history(run_id, key)}
                for key in run.data.metrics
            }
        except Exception as exc:
            raise ConfigError(
                "mlflow_experiment", f"MLflow could not reopen run {run_id}: {_first_line(exc)}"
            ) from exc
        self.run_id = run_id
        self.experiment_id = str(run.info.experiment_id)
        self.url = run_url(self.tracking_uri, self.experiment_id, self.run_id)
        self._started = time.monotonic()
        self.set_tags(tags)
        self._begin("continued ")
        return run_id

    def _begin(self, how: str) -> None:
        self.log.info(
            "sparktorch_ops: %sMLflow run %s in experiment %s%s",
            how,
            self.run_id,
            self.experiment_id,
            f" ({self.url})" if self.url else f" at {self.tracking_uri}",
        )

    def on_metrics(self, record: Any) -> None:
        """A ``report()`` record: its new metrics queued for MLflow's async logging."""
        if record.rank != 0 and not self.all_ranks:
            return
        with self._lock:
            metrics = self._metrics_of(record, "" if record.rank == 0 else f"/rank{record.rank}")
        if metrics:
            self._log_async(self.client.log_batch, self.run_id, metrics=metrics)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Tags learnt during the run (the Spark application and UI)."""
        for key, value in tags.items():
            if value is not None:
                self._log_async(self.client.set_tag, self.run_id, key, str(value))

    def _log_async(self, method: Any, *args: Any, **kwargs: Any) -> None:
        with _QUEUE_TURNS:
            operations = self._call(method, *args, **kwargs, synchronous=False)
        if operations is None:
            return
        with self._lock:
            self._pending.append(operations)
            oldest = self._pending.popleft() if len(self._pending) > _MAX_PENDING else None
        if oldest is not None:
            self._wait(oldest)

    def _wait_all(self, pending: Iterable[Any]) -> None:
        for operations in pending:
            self._wait(operations)

    def _wait(self, operations: Any) -> None:
        try:
            operations.wait()
        except Exception as exc:
            self.log.warning("sparktorch_ops: MLflow could not log to run %s: %s", self.run_id, exc)

    def on_event(self, event: Any) -> None:
        """A phase event of the run: the session's, once ready, tags the run; a later
        attempt's start tags it with the attempts so far."""
        number = event.detail.get("attempt", 1) if event.name == ATTEMPT_STARTED else 1
        if number > 1:
            self.set_tags({ATTEMPTS_TAG: number})
            with self._lock:
                self._before_attempt = {k: set(v) for k, v in self._sent.items()}
        if event.name == SESSION_READY:
            self.set_tags(
                {
                    "spark.app_id": event.detail.get("app_id"),
                    "spark.ui_url": event.detail.get("ui_url"),
                    "spark.master": event.detail.get("master"),
                }
            )

    def finish(self, outcome: Any, *, last_try: bool = True) -> None:
        """Flush the metrics, then end the run with the outcome's status.

        ``outcome`` is the :class:`~sparktorch_ops.RunResult` or the exception the run ended
        with; tracking problems are logged, never raised. With ``last_try=False`` a failure
        that a retry may mend leaves the run RUNNING for that retry (its outcome tagged); a
        success, bad input and a cancel end it either way.
        """
        from sparktorch_ops.errors import TrainingCancelledError, outcome_of

        if not self.run_id:
            return
        with self._lock:
            pending, self._pending = self._pending, deque()
        # MLflow waits on a tracking server that stopped answering as long as its retries last:
        # the run ends after a bounded wait, saying what may be missing.
        flush = threading.Thread(
            target=self._wait_all,
            args=(pending,),
            name="sparktorch-mlflow-flush",
            daemon=True,
        )
        flush.start()
        flush.join(_FLUSH_TIMEOUT_S)
        if flush.is_alive():
            self.log.warning(
                "sparktorch_ops: MLflow had not logged the run's last metrics to run %s after "
                "%g s; ending the run without waiting for them",
                self.run_id,
                _FLUSH_TIMEOUT_S,
            )
        if self.replayed_logged:
            self.log.info(
                "sparktorch_ops: %d metric values an earlier try reported were missing from "
                "MLflow run %s; logged from the resumed checkpoint",
                self.replayed_logged,
                self.run_id,
            )
        status: str | None
        if isinstance(outcome, BaseException):
            cancelled = isinstance(outcome, TrainingCancelledError)
            status = "KILLED" if cancelled else "FAILED"
            if not last_try and not cancelled and outcome_of(outcome).retryable:
                status = None  # the next try continues this run
            detail = f"{type(outcome).__name__}: {_first_line(outcome)}"
        else:
            status, detail = "FINISHED", "succeeded"
        try:
            self.client.set_tag(self.run_id, "sparktorch_ops.outcome", detail[:5000])
            self.client.log_metric(
                self.run_id, "duration_s", round(time.monotonic() - self._started, 3)
            )
            if status is not None:
                with _QUEUE_TURNS:
                    self.client.set_terminated(self.run_id, status=status)
        except Exception as exc:
            self.log.warning("sparktorch_ops: could not end MLflow run %s: %s", self.run_id, exc)

    def _metrics_of(self, record: Any, suffix: str) -> list[Any]:
        """A record's numbers as MLflow metrics; of a replayed record, only the steps a
        continued run lacks (the crashed try's driver had not sent them)."""
        from mlflow.entities import Metric

        if record.replayed and self._logged is None:
            return []

        values = dict(record.values)
        if record.progress is not None:
            values["progress"] = record.progress
        metrics = []
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue  # MLflow metrics are numbers
            name = f"{key}{suffix}"
            sent = self._sent.setdefault(name, set())
            if record.replayed:
                assert self._logged is not None
                if record.step in self._logged.get(name, ()) or record.step in sent:
                    continue
                self.replayed_logged += 1
            elif record.step in self._before_attempt.get(name, ()):
                continue
            sent.add(record.step)
            metrics.append(Metric(name, float(value), int(record.time * 1000), record.step))
        return metrics

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as exc:  # tracking must never fail the training
            self.log.warning("sparktorch_ops: MLflow %s failed: %s", method.__name__, exc)
            return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def start_tracking(
    spec: Any, run_id: str, train: str, args: Any, kwargs: Mapping[str, Any], log: Any
) -> MlflowTracker:
    """Start the MLflow run of one training run of ``spec`` (``train`` describes what runs),
    or continue the one of an earlier try of the same durable training; on the caller's
    thread, so that it nests under the caller's active MLflow run."""
    tracker = MlflowTracker(
        spec.mlflow_experiment, spec.mlflow_tracking_uri, all_ranks=spec.mlflow_all_ranks, log=log
    )
    tags = {"sparktorch_ops.run_id": run_id, **spec.mlflow_tags}
    training = spec.training
    if training is not None:
        tags[TRAINING_ID_TAG] = training.training_id
        tags[TRIES_TAG] = ",".join(str(number) for number in training.tries)
    if (
        training is None
        or training.mlflow_run_id is None
        or not tracker.resume(training.mlflow_run_id, tags)
    ):
        tracker.start(
            run_name=f"{train} {training.training_id if training else run_id}",
            params=loggable_params(train, args, kwargs, spec),
            tags=tags,
        )
    if training is not None and training.on_mlflow_run is not None:
        try:
            training.on_mlflow_run(tracker.run_id)
        except Exception as exc:  # the training can go on; a retry would open a new run
            log.warning(
                "sparktorch_ops: could not store the MLflow run id %s of the training %s: %s",
                tracker.run_id,
                training.training_id,
                exc,
            )
    return tracker
