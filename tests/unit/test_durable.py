"""A durable training's record and what each try decides from it (pure), and its file store."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from sparktorch_ops.driver.durable import (
    CLEARED,
    RESUMABLE,
    SUCCEEDED,
    UNREADABLE,
    RecordError,
    RecordFile,
    StoredTraining,
    TrainingRecord,
    TrainingTry,
    finished_line,
    status_of,
    stored_result,
    train_try,
    try_line,
)


def test_a_record_survives_the_store_as_json() -> None:
    record = (
        TrainingRecord.new(max_tries=2)
        .with_try(1)
        .with_mlflow_run("abc123")
        .with_try(2)
        .finished(2, {"value": [1, 2], "run_id": "sparktorch-x"})
    )
    stored = json.loads(json.dumps(record.to_json()))
    assert TrainingRecord.from_json(stored) == record
    assert stored["training_id"].startswith("training-") and stored["tries"] == [1, 2]
    assert TrainingRecord.new().training_id != TrainingRecord.new().training_id
    assert TrainingRecord.new().to_json().keys() == {"training_id", "tries"}  # no nulls


def test_each_try_is_counted_once() -> None:
    record = TrainingRecord.new().with_try(1).with_try(1).with_try(3)
    assert record.tries == (1, 3)


@pytest.mark.parametrize(
    ("record", "max_tries", "status"),
    [
        (TrainingRecord("t", (1,), max_tries=1), 1, RESUMABLE),  # a try died or failed
        (TrainingRecord("t", (1,), max_tries=1), 3, RESUMABLE),  # cleared after a failure
        (TrainingRecord("t", (1,), 1, finished_in_try=1, result={}), 1, SUCCEEDED),
        (TrainingRecord("t", (1,), 1, finished_in_try=1, result={}), 2, CLEARED),
        (TrainingRecord("t", (1,), None, finished_in_try=1, result={}), None, SUCCEEDED),
    ],
)
def test_what_the_next_try_does(record: TrainingRecord, max_tries: int, status: str) -> None:
    assert record.status(max_tries) == status


@pytest.mark.parametrize(
    "stored",
    [
        None,
        "training-1",
        {"tries": [1]},
        {"training_id": "t", "tries": "1"},
        {"training_id": "t", "tries": [1], "max_tries": "2"},
        {"training_id": "t", "tries": [1], "mlflow_run_id": 5},
    ],
)
def test_what_is_not_a_record_is_refused(stored: object) -> None:
    with pytest.raises(RecordError):
        TrainingRecord.from_json(stored)


def test_a_stored_training_saves_its_try_then_its_result_and_returns_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("tests.durable")
    saved: list[dict[str, object]] = []
    stored = StoredTraining(TrainingRecord.new(max_tries=1), saved.append)
    tries: list[TrainingTry] = []

    def train(training: TrainingTry) -> dict[str, int]:
        tries.append(training)
        return {"value": 3}

    assert stored.run(1, False, train) == {"value": 3}
    assert [s["tries"] for s in saved] == [[1], [1]] and saved[-1]["result"] == {"value": 3}
    assert tries[0].training_id == saved[-1]["training_id"]
    assert status_of(saved[-1], 1, log) == SUCCEEDED
    with caplog.at_level(logging.INFO, logger="tests.durable"):
        assert stored_result(saved[-1], log) == {"value": 3}
        assert status_of({"tries": "x"}, 1, log) == UNREADABLE
    assert "already finished in try 1" in caplog.text and "starting a new training" in caplog.text


def test_a_try_trains_alone_without_a_record_or_a_store_and_is_recorded_with_both() -> None:
    record = TrainingRecord("training-1", (1,), 1).to_json()
    saved: list[dict[str, object]] = []
    given: list[TrainingTry | None] = []

    def train(training: TrainingTry | None) -> str:
        given.append(training)
        return "done"

    assert train_try(None, saved.append, 2, 1, train) == "done"
    assert train_try(record, None, 2, 1, train) == "done"
    assert given == [None, None] and saved == []
    assert train_try(record, saved.append, 2, 1, train) == "done"
    second = given[-1]
    assert second is not None and second.resumed and second.last_try  # try 2 of max_tries 1
    assert [s["tries"] for s in saved] == [[1, 2], [1, 2]] and saved[-1]["result"] == "done"


def test_a_try_of_a_record() -> None:
    record = TrainingRecord("training-1", (1,), 1, mlflow_run_id="run-1")
    second = TrainingTry.of(record, 2, last_try=True)
    assert (second.training_id, second.tries, second.mlflow_run_id) == (
        "training-1",
        (1, 2),
        "run-1",
    )
    assert second.resumed and second.last_try
    assert not TrainingTry.of(TrainingRecord.new(), 1, last_try=False).resumed


def test_the_lines_a_try_logs() -> None:
    first = TrainingTry("training-1", 1, (1,))
    second = TrainingTry("training-1", 2, (1, 2))
    assert try_line(first, None, "r1") == (
        "sparktorch_ops: try 1 of the training training-1: starting, MLflow run r1"
    )
    assert try_line(second, 3, "r1") == (
        "sparktorch_ops: try 2 of the training training-1: resuming from step 3 "
        "(checkpoint), MLflow run r1"
    )
    assert "no checkpoint was committed yet" in try_line(second, None, None)
    assert "MLflow" not in try_line(second, None, None)
    done = TrainingRecord("training-1", (1,), 1, finished_in_try=1, result={})
    assert finished_line(done) == (
        "sparktorch_ops: the training training-1 already finished in try 1: returning its result"
    )


def test_the_record_file_is_replaced_whole(tmp_path: Path) -> None:
    store = RecordFile(tmp_path / "trainings" / "run.json")
    assert store.get() is None
    errors: list[BaseException] = []

    def write(n: int) -> None:
        try:
            for i in range(50):
                store.set(TrainingRecord(f"t{n}", (i,)).to_json())
                TrainingRecord.from_json(store.get())  # never a half-written file
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert [p.name for p in store.path.parent.iterdir()] == ["run.json"]
    store.path.write_text("{not json")
    with pytest.raises(RecordError, match="not JSON"):
        store.get()
