"""Attempts inside one call (max_failures): a rank killed by a signal is followed by a new
attempt that resumes from the checkpoint, in local and barrier mode; the training's own
exception is final; exhausted attempts say every cause; a cancel between attempts returns at
once. (An executor and a worker lost on a standalone cluster: tests/faults/test_cluster_faults.)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from harness.procs import wait_until_gone
from sparktorch_ops import TrainingCancelledError, TrainingFailedError
from sparktorch_ops.events import ATTEMPT_FAILED, ATTEMPT_STARTED
from tests.faults.test_teardown import distributor
from tests.support.checkpointed import killed_every_time, steps_killed_once


@pytest.mark.parametrize("mode", ["local", "barrier"])
def test_a_rank_killed_mid_run_is_followed_by_an_attempt_that_resumes_from_the_checkpoint(
    mode: str, spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    events: list[Any] = []
    logger = logging.getLogger(f"test.attempts.{mode}")
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    d = distributor(
        mode,
        spark,
        max_failures=1,
        checkpoint_dir=str(tmp_path / "checkpoints"),
        logger=logger,
        on_event=events.append,
    )
    with caplog.at_level(logging.WARNING, logger=logger.name):
        result = d.launch(steps_killed_once, 6, str(ranks))
    # Rank 1 was SIGKILLed after step 2's checkpoint; the second attempt resumed from it.
    assert result.value == {"start": 2, "ran": [3, 4, 5], "total": 15.0, "earlier_alive": []}
    first, second = result.attempts
    assert (first.number, first.num_processes, first.resumed_from) == (1, 2, None)
    assert first.cause == f"rank 1 on {first.host} was killed by SIGKILL"
    assert (second.number, second.resumed_from, second.cause) == (2, 2, None)
    assert result.summary()["attempts"][0]["cause"] == first.cause
    # Every step's metric: the checkpoint's (replayed) and the second attempt's own.
    steps = {m.step: m.replayed for m in result.metrics if m.rank == 0}
    assert steps == {0: True, 1: True, 2: True, 3: False, 4: False, 5: False}
    said = [r.getMessage() for r in caplog.records if "attempt 1 of 2 ended" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        "; starting attempt 2 from the checkpoint of step 2 with 2 ranks"
    ), said
    assert f"ended: rank 1 on {first.host} was killed by SIGKILL at step " in said[0]
    names = [(e.name, e.detail.get("attempt")) for e in events if "attempt" in e.name]
    assert names == [(ATTEMPT_STARTED, 1), (ATTEMPT_FAILED, 1), (ATTEMPT_STARTED, 2)]
    failed = next(e for e in events if e.name == ATTEMPT_FAILED)
    assert failed.detail["cause"] == first.cause and failed.detail["retried"] is True
    assert wait_until_gone(result.run_id, timeout=30) == []


def test_the_trainings_own_exception_is_final_and_exhausted_attempts_say_every_cause(
    tmp_path: Path,
) -> None:
    from tests.faults.training import fail_after_ready

    ready = tmp_path / "ready"
    ready.mkdir()
    with pytest.raises(TrainingFailedError, match="rank 1 raised on purpose") as raised:
        distributor("local", None, max_failures=2).run(fail_after_ready, str(ready), "raise")
    assert len(raised.value.attempts) == 1 and "attempts" not in str(raised.value)

    counted = tmp_path / "counted"
    counted.mkdir()
    with pytest.raises(TrainingFailedError) as exhausted:
        distributor("local", None, max_failures=1).run(killed_every_time, str(counted))
    assert len(list(counted.iterdir())) == 2  # two attempts, no third
    text = str(exhausted.value)
    assert "the run made 2 attempts:" in text
    assert text.count("was killed by SIGKILL") >= 2
    assert [a.number for a in exhausted.value.attempts] == [1, 2]


def test_a_cancel_between_attempts_returns_at_once_and_starts_no_other(tmp_path: Path) -> None:
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    cancelled_at: list[float] = []

    def cancel_on_failure(event: Any) -> None:
        if event.name == ATTEMPT_FAILED:  # cancel() only sets a flag: safe from the hook
            cancelled_at.append(time.monotonic())
            d.cancel()

    d = distributor(
        "local",
        None,
        max_failures=3,
        checkpoint_dir=str(tmp_path / "checkpoints"),
        on_event=cancel_on_failure,
    )
    with pytest.raises(TrainingCancelledError):
        d.run(steps_killed_once, 6, str(ranks))
    assert time.monotonic() - cancelled_at[0] < 15
    assert not list(ranks.glob("later.rank*"))  # the next attempt never started
