"""What the Prefect task derives from its task run: its result key, where its result and
checkpoints go, its MLflow tags, its durable training's record, and which failures Prefect
retries."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.cache_policies import CachePolicy
from prefect.client.schemas.objects import TaskRun
from prefect.context import TaskRunContext
from prefect.states import State

from sparktorch_ops.driver.durable import RecordError, RecordFile, StoredTraining, TrainingTry
from sparktorch_ops.errors import outcome_of


@dataclass
class TaskRunResultKey(CachePolicy):
    """A result key unique to each task run: results are persisted, never reused by another run.

    Training is not something to skip because a similar call ran before, so no inputs go into
    the key (nor could a Spark session, a logger or a callback); a retry of the same task run
    reruns the job because a failed attempt stores nothing.
    """

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        """``sparktorch-ops-<task run id>``."""
        return self.key_for(task_ctx.task_run.id)

    @staticmethod
    def key_for(task_run_id: Any) -> str:
        """The storage key of a task run's result."""
        return f"sparktorch-ops-{task_run_id}"


TASK_RUN_RESULT_KEY = TaskRunResultKey()


def retry_unless_bad_input(task: Any, task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect ``retry_condition_fn``: retry what may succeed again (not bad input)."""
    error = state.data
    return not isinstance(error, BaseException) or outcome_of(error).retryable


def result_location(ctx: TaskRunContext | None, value: Any) -> str:
    """One line for the summary: what rank 0 returned and where Prefect keeps it."""
    kind = f"rank 0 returned a `{type(value).__name__}`"
    if ctx is None or not ctx.persist_result:
        return f"{kind}, handed to the flow in memory (result persistence is off)"
    storage = getattr(ctx.result_store, "result_storage", None)
    base = getattr(storage, "basepath", None)
    if isinstance(ctx.task.cache_policy, TaskRunResultKey):
        key = TaskRunResultKey.key_for(ctx.task_run.id)
        where = f"{str(base).rstrip('/')}/{key}" if base else f"key {key}"
        return f"{kind}, persisted in Prefect result storage at `{where}`"
    return f"{kind}, persisted in Prefect result storage" + (f" under `{base}`" if base else "")


def training_of(ctx: TaskRunContext | None, log: Any) -> TrainingTry | None:
    """This try of the task run's durable training: its record is kept in a file under
    Prefect's local storage path (``.../sparktorch_ops/trainings/<task run id>.json``), made
    by the first try; the tries are Prefect's ``run_count``. None outside a task run."""
    if ctx is None:
        return None
    store = RecordFile(_own_storage("trainings", f"{ctx.task_run.id}.json"))
    try:
        stored = store.get()
    except RecordError as exc:
        log.warning("sparktorch_ops: %s; starting a new training", exc)
        stored = None
    try_number = max(1, ctx.task_run.run_count)
    training = StoredTraining.load(stored, store.set, log)
    return training.begin(try_number, last_try=try_number > (ctx.task.retries or 0))


def default_checkpoint_dir(ctx: TaskRunContext | None) -> str | None:
    """The task run's own ``checkpoint_dir``: under Prefect's local storage path, keyed by the
    flow run and the task (its key and its call in the flow), so its retries resume and a new
    flow run starts fresh. None outside a task run."""
    if ctx is None:
        return None
    run = ctx.task_run
    task = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{run.task_key}-{run.dynamic_key}")
    return str(_own_storage("checkpoints", str(run.flow_run_id), task))


def _own_storage(*names: str) -> Path:
    """A path under ``sparktorch_ops`` in Prefect's local storage path."""
    from prefect.settings import get_current_settings

    base = Path(get_current_settings().results.local_storage_path).expanduser()
    return base.joinpath("sparktorch_ops", *names)


def mlflow_tags(ctx: TaskRunContext | None) -> dict[str, str]:
    """MLflow tags that find the flow run and task run that trained."""
    if ctx is None:
        return {}
    tags = {"prefect.task_run_id": str(ctx.task_run.id), "prefect.task_run": ctx.task_run.name}
    if ctx.task_run.flow_run_id is not None:
        tags["prefect.flow_run_id"] = str(ctx.task_run.flow_run_id)
    return tags
