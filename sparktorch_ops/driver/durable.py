"""A training's identity across the tries of one orchestrator task (durable retries).

An orchestrator task that trains (an Airflow task instance, a Prefect task run) may be tried
several times: a worker is OOM-killed, evicted or redeployed mid-training, and the next try
starts. The tries of one task are one **training**: one ``training_id`` (apart from each try's
own ``run_id``, which keys the rendezvous, process markers and the channel secret), one MLflow
run and one checkpoint directory. The wrapper keeps a :class:`TrainingRecord` in its own store
(Airflow's ``task_state_store``, a file per Prefect task run) and tells the core about each try
with a :class:`TrainingTry`:

* the first try makes the record (:meth:`TrainingRecord.new`) and stores it before training;
* once the MLflow run exists its id is stored (:meth:`TrainingRecord.with_mlflow_run`), so a try
  that dies later is continued, not duplicated;
* a success stores its result (:meth:`TrainingRecord.finished`) before the wrapper hands it on,
  so a try that dies after that returns it without training again;
* a later try reads the record and decides (:meth:`TrainingRecord.status`): ``resumable`` (an
  earlier try died or failed: resume from the latest checkpoint into the same MLflow run),
  ``succeeded`` (return the stored result) or ``cleared`` (the task succeeded and was cleared
  since, or its ``max_tries`` was raised: a new training).

Everything here is pure; the stores and the MLflow calls live with their callers.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from sparktorch_ops.checkpoint.storage import replace_file

RESUMABLE = "resumable"
SUCCEEDED = "succeeded"
CLEARED = "cleared"
UNREADABLE = "unreadable"  # what is stored is not a record: a new training
_R = TypeVar("_R")

#: The MLflow tag that lists the tries a training's run spans (``"1,2"``).
TRIES_TAG = "sparktorch_ops.tries"
#: The MLflow tag with the training's id.
TRAINING_ID_TAG = "sparktorch_ops.training_id"


def new_training_id() -> str:
    """A fresh training id."""
    return f"training-{uuid.uuid4().hex[:16]}"


class RecordError(ValueError):
    """A stored training record that is not one (written by something else, or damaged)."""


@dataclass(frozen=True)
class TrainingRecord:
    """What a wrapper stores about one training, across its tries (JSON in the store).

    Attributes:
        training_id: the training's id (MLflow tag, checkpoint directory, result).
        tries: the try numbers that trained so far, in order.
        max_tries: the orchestrator's ``max_tries`` when the training began (Airflow raises it
            when a task is cleared: a success stored before then belongs to an older clear).
        mlflow_run_id: the MLflow run all tries log to, once it exists.
        finished_in_try: the try whose training succeeded.
        result: what that try returned, as the wrapper stores it (JSON).
    """

    training_id: str
    tries: tuple[int, ...] = ()
    max_tries: int | None = None
    mlflow_run_id: str | None = None
    finished_in_try: int | None = None
    result: Any = None

    @classmethod
    def new(cls, max_tries: int | None = None) -> TrainingRecord:
        """A new training's record, before its first try trains."""
        return cls(training_id=new_training_id(), max_tries=max_tries)

    def to_json(self) -> dict[str, Any]:
        """The record as the store keeps it."""
        record = {k: v for k, v in asdict(self).items() if v is not None}
        return {**record, "tries": list(self.tries)}

    @classmethod
    def from_json(cls, stored: Any) -> TrainingRecord:
        """A record from the store.

        Raises:
            RecordError: ``stored`` is not a record this module wrote.
        """
        if not isinstance(stored, Mapping) or not isinstance(stored.get("training_id"), str):
            raise RecordError(f"not a sparktorch_ops training record: {stored!r:.200}")
        tries = stored.get("tries", [])
        if not isinstance(tries, list) or not all(isinstance(t, int) for t in tries):
            raise RecordError(f"a training record's tries must be integers: {tries!r:.200}")
        for name in ("max_tries", "finished_in_try"):
            if stored.get(name) is not None and not isinstance(stored[name], int):
                raise RecordError(f"a training record's {name} must be an integer")
        run = stored.get("mlflow_run_id")
        if run is not None and not isinstance(run, str):
            raise RecordError("a training record's mlflow_run_id must be a string")
        return cls(
            training_id=stored["training_id"],
            tries=tuple(tries),
            max_tries=stored.get("max_tries"),
            mlflow_run_id=run,
            finished_in_try=stored.get("finished_in_try"),
            result=stored.get("result"),
        )

    def status(self, max_tries: int | None = None) -> str:
        """What the next try does: ``resumable``, ``succeeded`` or ``cleared``.

        ``max_tries`` is the orchestrator's now: a stored success with another ``max_tries``
        was followed by a clear of the task (Airflow raises ``max_tries`` then), so the task
        starts a new training; with the same, the try that stored it died before the
        orchestrator saw the success, and its result is returned.
        """
        if self.finished_in_try is None:
            return RESUMABLE
        if max_tries is not None and self.max_tries is not None and max_tries != self.max_tries:
            return CLEARED
        return SUCCEEDED

    def with_try(self, try_number: int) -> TrainingRecord:
        """The record once ``try_number`` starts training."""
        if try_number in self.tries:
            return self
        return replace(self, tries=(*self.tries, try_number))

    def with_mlflow_run(self, run_id: str) -> TrainingRecord:
        """The record once the training's MLflow run exists."""
        return replace(self, mlflow_run_id=run_id)

    def finished(self, try_number: int, result: Any) -> TrainingRecord:
        """The record once ``try_number`` succeeded with ``result`` (JSON)."""
        return replace(self, finished_in_try=try_number, result=result)


@dataclass(frozen=True)
class TrainingTry:
    """This try of a durable training, as the core needs it.

    Attributes:
        training_id: the training's id (tagged on its MLflow run, given in the result).
        try_number: this try's number (the orchestrator's count, from 1).
        tries: every try of the training so far, this one last.
        last_try: no try follows this one if it fails: it sets the MLflow run's final status.
            Earlier tries that fail leave the run RUNNING for the next one (a success, bad
            input and a cancel end it at once).
        mlflow_run_id: the MLflow run to continue (None: this try creates it).
        on_mlflow_run: called with the MLflow run's id as soon as it exists (the wrapper
            stores it, so a try that dies is continued by the next).
    """

    training_id: str
    try_number: int = 1
    tries: tuple[int, ...] = (1,)
    last_try: bool = True
    mlflow_run_id: str | None = None
    on_mlflow_run: Callable[[str], None] | None = field(default=None, compare=False)

    @classmethod
    def of(cls, record: TrainingRecord, try_number: int, last_try: bool) -> TrainingTry:
        """This try of the training ``record`` describes."""
        record = record.with_try(try_number)
        return cls(
            training_id=record.training_id,
            try_number=try_number,
            tries=record.tries,
            last_try=last_try,
            mlflow_run_id=record.mlflow_run_id,
        )

    @property
    def resumed(self) -> bool:
        """Whether an earlier try of this training trained."""
        return len(self.tries) > 1


class StoredTraining:
    """A training's record in a wrapper's store, saved (``save`` writes its JSON) at each
    change as it happens, so a try that dies leaves what the next one needs."""

    def __init__(self, record: TrainingRecord, save: Callable[[dict[str, Any]], None]) -> None:
        self.record = record
        self._save = save

    @classmethod
    def load(cls, stored: Any, save: Callable[[dict[str, Any]], None], log: Any) -> StoredTraining:
        """The training ``stored`` records; a new one when there is none, or when what is
        stored is not a record (said in ``log``)."""
        try:
            record = TrainingRecord.from_json(stored) if stored is not None else None
        except RecordError as exc:
            log.warning("sparktorch_ops: %s; starting a new training", exc)
            record = None
        return cls(record or TrainingRecord.new(), save)

    def begin(self, try_number: int, last_try: bool) -> TrainingTry:
        """Save that ``try_number`` trains; the try to give the job (it saves the MLflow run
        id once the run exists)."""
        self._update(self.record.with_try(try_number))
        return replace(
            TrainingTry.of(self.record, try_number, last_try), on_mlflow_run=self._on_mlflow_run
        )

    def run(self, try_number: int, last_try: bool, train: Callable[[TrainingTry], _R]) -> _R:
        """:meth:`begin`, ``train`` this try, then :meth:`finish` with what it returned."""
        result = train(self.begin(try_number, last_try))
        self.finish(try_number, result)
        return result

    def finish(self, try_number: int, result: Any) -> None:
        """Save that ``try_number`` succeeded with ``result`` (JSON)."""
        self._update(self.record.finished(try_number, result))

    def _on_mlflow_run(self, run_id: str) -> None:
        if self.record.mlflow_run_id != run_id:
            self._update(self.record.with_mlflow_run(run_id))

    def _update(self, record: TrainingRecord) -> None:
        self.record = record
        self._save(record.to_json())


def train_try(
    stored: Any,
    save: Callable[[dict[str, Any]], None] | None,
    try_number: int,
    max_tries: int,
    train: Callable[[TrainingTry | None], _R],
) -> _R:
    """One try of the training a wrapper's record ``stored`` (JSON) keeps in a store that
    ``save`` writes; ``train`` gets the try, or None when there is no record or no store
    (then the try is a training of its own). The try past ``max_tries`` is the last."""
    if stored is None or save is None:
        return train(None)
    training = StoredTraining(TrainingRecord.from_json(stored), save)
    return training.run(try_number, try_number > max_tries, train)


def try_line(training: TrainingTry, resumed_step: int | None, mlflow_run_id: str | None) -> str:
    """The task log's line saying what this try does."""
    head = f"sparktorch_ops: try {training.try_number} of the training {training.training_id}"
    if not training.resumed:
        what = "starting"
    elif resumed_step is None:
        what = "resuming, but no checkpoint was committed yet: training from the start"
    else:
        what = f"resuming from step {resumed_step} (checkpoint)"
    run = f", MLflow run {mlflow_run_id}" if mlflow_run_id else ""
    return f"{head}: {what}{run}"


def status_of(stored: Any, max_tries: int | None, log: Any) -> str:
    """A later try's decision for the record a wrapper stored (:meth:`TrainingRecord.status`);
    :data:`UNREADABLE`, said in ``log``, when what is stored is not a record."""
    try:
        return TrainingRecord.from_json(stored).status(max_tries)
    except RecordError as exc:
        log.warning("sparktorch_ops: %s; starting a new training", exc)
        return UNREADABLE


def stored_result(stored: Any, log: Any) -> Any:
    """The result an earlier try of the training ``stored`` records stored, said in ``log``."""
    record = TrainingRecord.from_json(stored)
    log.info(finished_line(record))
    return record.result


def finished_line(record: TrainingRecord) -> str:
    """The task log's line when a try returns an earlier try's stored result."""
    return (
        f"sparktorch_ops: the training {record.training_id} already finished in try "
        f"{record.finished_in_try}: returning its result"
    )


class RecordFile:
    """A training record kept in one JSON file (Prefect's task runs have no state store).

    Writes replace the file atomically, so a crash leaves the old record or the new one.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def get(self) -> Any:
        """The stored JSON, or None when there is none."""
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise RecordError(f"{self.path} is not JSON: {exc}") from None

    def set(self, value: Any) -> None:
        """Store ``value`` (JSON)."""
        replace_file(str(self.path), json.dumps(value).encode())
