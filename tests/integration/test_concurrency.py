"""Several runs from threads of one process at once: local and barrier mode on the shared
local[2] session, runs queued for its slots, and a cancel of one run among others.

Runs meet through files (each waits, bounded, until the others have started), so a test that
passes proves they overlapped; nothing here sleeps to make runs line up.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from sparktorch_ops import (
    StartTimeoutError,
    TorchDistributor,
    TrainingCancelledError,
)
from tests.support.concurrent import WAIT_S, Runs, hold, meet, rank_lines, wait_for
from tests.support.records import collecting_logger


def holds_every_slot(spark: Any) -> None:
    """Wait until Spark's status store, which lags its scheduler (by seconds on a loaded
    machine), counts the running run's tasks: the next run then sees the slots busy."""
    from sparktorch_ops.spark.preflight import busy_slots

    wait_for(lambda: busy_slots(spark.sparkContext) == 2, "Spark to count the busy slots")


@pytest.mark.parametrize("local_mode", [True, False], ids=["local", "barrier"])
def test_runs_from_threads_at_once_each_see_only_their_own_lines(
    spark: Any, tmp_path: Path, local_mode: bool
) -> None:
    # Barrier mode: 1-rank runs, as many as local[2] has slots; local mode: four at once.
    names = ["a", "b"] if not local_mode else ["a", "b", "c", "d"]
    runs, collects = Runs(), {}
    for name in names:
        logger, collects[name] = collecting_logger(f"tests.concurrency.{name}")
        distributor = TorchDistributor(
            num_processes=1, local_mode=local_mode, use_gpu=False, spark=spark, logger=logger
        )
        runs.start(
            name,
            lambda d=distributor, n=name: d.launch(meet, str(tmp_path), n, len(names), 20),
        )
    outcomes = runs.join()
    for name in names:
        result = outcomes[name]
        assert not isinstance(result, BaseException), f"{name}: {result!r}"
        assert result.value["name"] == name
        assert rank_lines(collects[name]) == [f"{name} line {i}" for i in range(20)]
    assert len({outcomes[name].value["pid"] for name in names}) == len(names)


def test_a_barrier_run_waits_for_slots_another_run_holds_then_starts(
    spark: Any, tmp_path: Path
) -> None:
    runs = Runs()
    first = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark)
    runs.start("first", lambda: first.launch(hold, str(tmp_path), "first"))
    wait_for(lambda: len(list(tmp_path.glob("first.started.*"))) == 2, "the first run's ranks")
    holds_every_slot(spark)
    logger, collect = collecting_logger("tests.concurrency.second")
    second = TorchDistributor(
        num_processes=2, local_mode=False, use_gpu=False, spark=spark, logger=logger
    )
    runs.start("second", lambda: second.launch(hold, str(tmp_path), "second"))
    wait_for(
        lambda: any("waiting for 2 free barrier task slots" in m for m in collect.messages()),
        "the second run to say it waits",
    )
    assert not list(tmp_path.glob("second.started.*"))  # queued, not started
    waiting = [m for m in collect.messages() if "free barrier task slots" in m]
    assert len(waiting) == 1 and "2 of the cluster's 2 are busy" in waiting[0], waiting
    (tmp_path / "first.release").write_text("")
    wait_for(lambda: len(list(tmp_path.glob("second.started.*"))) == 2, "the second run")
    (tmp_path / "second.release").write_text("")
    outcomes = runs.join()
    assert outcomes["first"].value == "first released"
    assert outcomes["second"].value == "second released"
    first_end = outcomes["first"].finished_at
    second_ranks = min(float(p.read_text()) for p in tmp_path.glob("second.started.*"))
    assert first_end.timestamp() <= second_ranks + 1.0  # started once the first had let go


@pytest.mark.parametrize("stop", ["cancel", "start_timeout"])
def test_a_queued_barrier_run_stops_at_once_and_leaves_the_other_running(
    spark: Any, tmp_path: Path, stop: str
) -> None:
    runs = Runs()
    holder = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark)
    runs.start("holder", lambda: holder.launch(hold, str(tmp_path), "holder"))
    wait_for(lambda: len(list(tmp_path.glob("holder.started.*"))) == 2, "the holder's ranks")
    holds_every_slot(spark)
    logger, collect = collecting_logger("tests.concurrency.queued")
    queued = TorchDistributor(
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        spark=spark,
        logger=logger,
        start_timeout=3 if stop == "start_timeout" else None,
    )
    runs.start("queued", lambda: queued.launch(hold, str(tmp_path), "queued"))
    if stop == "cancel":
        wait_for(
            lambda: any("free barrier task slots" in m for m in collect.messages()),
            "the queued run to wait",
        )
        cancelled_at = time.monotonic()
        queued.cancel()
        runs.threads["queued"].join(WAIT_S)
        assert time.monotonic() - cancelled_at < 5
        assert isinstance(runs.outcomes["queued"], TrainingCancelledError)
    else:
        runs.threads["queued"].join(WAIT_S)
        error = runs.outcomes["queued"]
        assert isinstance(error, StartTimeoutError), repr(error)
        assert "start_timeout" in str(error) and "busy" in str(error)
    assert runs.threads["holder"].is_alive()  # the other run goes on
    assert not list(tmp_path.glob("queued.started.*"))
    (tmp_path / "holder.release").write_text("")
    outcomes = runs.join()
    assert outcomes["holder"].value == "holder released"


@pytest.mark.parametrize("local_mode", [True, False], ids=["local", "barrier"])
def test_cancelling_one_of_two_runs_leaves_the_other_running(
    spark: Any, tmp_path: Path, local_mode: bool
) -> None:
    runs = Runs()
    distributors = {
        name: TorchDistributor(num_processes=1, local_mode=local_mode, use_gpu=False, spark=spark)
        for name in ("stopped", "kept")
    }
    for name, distributor in distributors.items():
        runs.start(name, lambda d=distributor, n=name: d.launch(hold, str(tmp_path), n))
    wait_for(
        lambda: all(list(tmp_path.glob(f"{n}.started.*")) for n in distributors),
        "both runs' ranks",
    )
    distributors["stopped"].cancel()
    runs.threads["stopped"].join(WAIT_S)
    assert isinstance(runs.outcomes["stopped"], TrainingCancelledError)
    assert runs.threads["kept"].is_alive()
    (tmp_path / "kept.release").write_text("")
    outcomes = runs.join()
    assert outcomes["kept"].value == "kept released"
