"""Every error survives pickling (they cross Spark task and process boundaries)."""

from __future__ import annotations

import pickle

from sparktorch_ops import (
    RankFailure,
    ResourceError,
    StartTimeoutError,
    TrainingCancelledError,
    TrainingFailedError,
    TrainingTimeoutError,
)


def _failure(rank: int, code: int | None, signal: str | None = None) -> RankFailure:
    return RankFailure(
        rank=rank,
        host="h1",
        exit_code=code,
        signal=signal,
        reason="ValueError: boom" if rank == 1 else "",
        output_tail="Traceback (most recent call last):\nValueError: boom",
        timestamp=1.0 + rank,
    )


def test_training_failed_error_names_root_cause_and_collateral() -> None:
    error = TrainingFailedError([_failure(1, 1), _failure(0, None, "SIGTERM")])
    text = str(error)
    assert text.startswith("rank 1 failed first (host h1, exit code 1, ValueError: boom)")
    assert "ValueError: boom" in text
    assert "collateral: rank 0 (host h1, signal SIGTERM)" in text
    assert error.first_failure is not None and error.first_failure.rank == 1
    assert [f.rank for f in error.collateral] == [0]


def test_a_failure_outside_any_rank_is_named_as_the_launch() -> None:
    lost = RankFailure(
        rank=-1, host="", exit_code=None, signal=None,
        reason="barrier task 1 on w1 was lost", output_tail="", timestamp=1.0,
    )  # fmt: skip
    assert str(TrainingFailedError([lost])).startswith(
        "the launch failed first (barrier task 1 on w1 was lost)"
    )


def test_all_errors_pickle_round_trip() -> None:
    errors = [
        TrainingFailedError([_failure(1, 3)], "torchrun exited with code 1"),
        StartTimeoutError("start_timeout", 5.0, "only 1 of 2 ranks started"),
        TrainingTimeoutError("timeout", 10.0),
        TrainingCancelledError("cancel() was called"),
        ResourceError("num_processes", "too many"),
    ]
    for error in errors:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert str(copy) == str(error)


def test_timeout_errors_name_the_setting_to_raise() -> None:
    assert "raise timeout" in str(TrainingTimeoutError("timeout", 3.0))
    assert "start_timeout=5" in str(StartTimeoutError("start_timeout", 5.0))
