"""Attempts of a run (max_failures, min_processes): which failures a new attempt cures, how many
ranks it runs with, and what the run says and raises (pure)."""

from __future__ import annotations

import pickle

import pytest

from sparktorch_ops import ConfigError, ResourceError, TrainingFailedError
from sparktorch_ops.driver.attempts import Cause, infrastructure_cause, retry_line
from sparktorch_ops.driver.planning import tasks_that_fit
from sparktorch_ops.errors import TrainingStalledError
from sparktorch_ops.results import Attempt, RankFailure
from sparktorch_ops.spec import LaunchSpec


def failure(rank: int, signal: str | None = None, reason: str = "") -> RankFailure:
    return RankFailure(rank, f"10.0.0.{rank + 7}", None if signal else 1, signal, reason, "", 0.0)


def test_a_lost_barrier_task_is_an_infrastructure_failure_whatever_failed_first() -> None:
    """The survivors' collectives fail (a Python exception) as the executor goes: the lost
    task, not the exception that arrived first, is the cause."""
    raised = failure(0, reason="RuntimeError: Connection closed by peer")
    cause = infrastructure_cause([raised], {1: "10.0.0.8"}, {}, None)
    assert cause == Cause(
        "barrier task 1 on 10.0.0.8 was lost (its executor or host went away)", "10.0.0.8"
    )


def test_a_rank_killed_by_a_signal_is_one_but_torchruns_collateral_sigterm_is_not() -> None:
    assert infrastructure_cause([failure(1, "SIGKILL")], {}, {}, None) == Cause(
        "rank 1 on 10.0.0.8 was killed by SIGKILL", "10.0.0.8"
    )
    # The collateral raised first, then the OOM-killed rank's exit: still the kill.
    late_kill = [failure(0, reason="RuntimeError: gloo"), failure(1, "SIGKILL")]
    assert infrastructure_cause(late_kill, {}, {}, None) is not None
    # A preemption's SIGTERM, first to fail: retried.
    assert infrastructure_cause([failure(1, "SIGTERM")], {}, {}, None) is not None
    # A Python exception, then torchrun stopping the other rank with SIGTERM: the training's.
    user = [failure(1, reason="ValueError: bad batch"), failure(0, "SIGTERM")]
    assert infrastructure_cause(user, {}, {}, None) is None


def test_a_vanished_rank_or_spark_losing_an_executor_is_one_a_plain_failure_is_not() -> None:
    assert infrastructure_cause([failure(1)], {}, {1: "h"}, None) == Cause(
        "the process of rank 1 on h vanished", "h"
    )
    lost = "Job aborted: ExecutorLostFailure (executor 1 exited caused by one of the running tasks)"
    assert infrastructure_cause([], {}, {}, lost) == Cause(f"Spark lost an executor: {lost}")
    assert infrastructure_cause([failure(1)], {}, {}, "Job aborted: task 0 raised") is None
    assert infrastructure_cause([], {}, {}, None) is None


def test_the_retry_line_says_what_ended_where_and_how_the_next_attempt_starts() -> None:
    cause = Cause("barrier task 1 on 10.0.0.7 was lost (its executor or host went away)")
    assert retry_line(1, 2, cause, 4, 3, 2) == (
        "sparktorch_ops: attempt 1 of 2 ended: barrier task 1 on 10.0.0.7 was lost (its "
        "executor or host went away) at step 4; starting attempt 2 from the checkpoint of "
        "step 3 with 2 ranks"
    )
    assert retry_line(2, 3, cause, None, None, 1).endswith(
        "went away); starting attempt 3 afresh with 1 ranks"
    )


def test_an_attempt_runs_with_every_task_or_as_many_as_fit_down_to_the_fewest() -> None:
    assert tasks_that_fit(2, 2, 4, waited=False, wait_s=None) == 2
    assert tasks_that_fit(4, 1, 3, waited=True, wait_s=60) == 3  # elastic: what there is
    with pytest.raises(ResourceError, match="min_processes") as info:
        tasks_that_fit(4, 2, 1, waited=True, wait_s=60)
    assert info.value.argument == "min_processes"
    assert "after waiting 60 s" in str(info.value) and "asks for 4" in str(info.value)
    with pytest.raises(ResourceError, match="start_timeout=") as info:  # not elastic: as before
        tasks_that_fit(3, 3, 2, waited=False, wait_s=None)
    assert info.value.argument == "num_processes"


def test_the_attempt_options_are_validated_naming_the_argument() -> None:
    assert LaunchSpec(use_gpu=False, num_processes=4).fewest_processes == 4
    assert LaunchSpec(use_gpu=False, num_processes=4, min_processes=2).fewest_processes == 2
    for bad in ({"max_failures": -1}, {"max_failures": "2"}, {"min_processes": 0}):
        with pytest.raises(ConfigError) as info:
            LaunchSpec(use_gpu=False, num_processes=2, **bad)  # type: ignore[arg-type]
        assert info.value.argument == next(iter(bad))
    with pytest.raises(ConfigError, match="more than num_processes=2") as info:
        LaunchSpec(use_gpu=False, num_processes=2, min_processes=3)
    assert info.value.argument == "min_processes"


def test_a_failed_run_lists_every_attempt_and_keeps_them_through_pickling() -> None:
    attempts = [
        Attempt(1, 2, 0.0, 12.34, None, "barrier task 1 on h was lost", "h"),
        Attempt(2, 2, 13.0, 4.0, 3, "rank 0 on h was killed by SIGKILL", "h"),
    ]
    error = TrainingFailedError([failure(0, "SIGKILL")], "").with_attempts(attempts)
    text = str(error)
    assert "the run made 2 attempts:" in text
    assert "attempt 1 (2 ranks, 12.3 s): barrier task 1 on h was lost" in text
    assert "attempt 2 (2 ranks, 4.0 s): rank 0 on h was killed by SIGKILL" in text
    copy = pickle.loads(pickle.dumps(error))
    assert copy.attempts == attempts and str(copy) == text
    stalled = TrainingStalledError([failure(0)], 5.0, {0: 6.0}, {0: "in f"}).with_attempts(attempts)
    assert pickle.loads(pickle.dumps(stalled)).attempts == attempts
    assert "the run made 2 attempts:" in str(stalled)
    assert attempts[1].to_dict()["resumed_from"] == 3
