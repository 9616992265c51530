"""Every way a run can die leaves no process of it behind (local mode and barrier mode on
local[2]); timeouts and cancellation go through the same teardown."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from harness.procs import wait_until_gone
from sparktorch_ops import (
    ConfigError,
    StartTimeoutError,
    TorchDistributor,
    TrainingCancelledError,
    TrainingFailedError,
    TrainingStalledError,
    TrainingTimeoutError,
)
from sparktorch_ops.wire.env import RUN_ID_ENV
from tests.faults.training import (
    fail_after_ready,
    hang_in_collective,
    heartbeat_only,
    long_training,
)

MODES = ["local", "barrier"]


class Run:
    """A run in a background thread, with what it returned or raised."""

    def __init__(self, distributor: TorchDistributor, fn: Callable[..., Any], *args: Any) -> None:
        self.outcome: Any = None
        self.thread = threading.Thread(target=self._go, args=(distributor, fn, args), daemon=True)
        self.thread.start()

    def _go(
        self, distributor: TorchDistributor, fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> None:
        try:
            self.outcome = distributor.run(fn, *args)
        except BaseException as exc:
            self.outcome = exc

    def result(self, timeout: float = 120) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the run did not end within {timeout} s"
        return self.outcome


def distributor(mode: str, spark: Any, **options: Any) -> TorchDistributor:
    return TorchDistributor(
        num_processes=2,
        local_mode=mode == "local",
        use_gpu=False,
        spark=spark if mode == "barrier" else None,
        **options,
    )


def wait_ready(ready_dir: Path, ranks: int = 2, timeout: float = 120) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = {r: ready_dir / f"rank{r}.pid" for r in range(ranks)}
        if all(p.exists() for p in pids.values()):
            return {r: int(p.read_text()) for r, p in pids.items()}
        time.sleep(0.1)
    raise AssertionError("the ranks never started training")


def run_id_of(pid: int) -> str:
    return psutil.Process(pid).environ()[RUN_ID_ENV]


def assert_nothing_left(run_id: str) -> None:
    left = wait_until_gone(run_id, timeout=30)
    assert not left, f"left behind: {[(p.pid, p.cmdline()) for p in left]}"


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest, spark: Any) -> str:
    return str(request.param)


@pytest.mark.parametrize("how", ["raise", "exit3"])
def test_failing_rank_tears_down_the_others(
    mode: str, spark: Any, tmp_path: Path, how: str
) -> None:
    run = Run(distributor(mode, spark), fail_after_ready, str(tmp_path), how)
    pids = wait_ready(tmp_path)
    run_id = run_id_of(pids[0])
    error = run.result()
    assert isinstance(error, TrainingFailedError), error
    first = error.first_failure
    assert first is not None and first.rank == 1
    if how == "raise":
        assert "RuntimeError: rank 1 raised on purpose" in first.output_tail
    else:
        assert first.exit_code == 3
    assert all(f.rank != 1 for f in error.collateral)
    assert_nothing_left(run_id)


def test_rank_sigkilled_from_outside(mode: str, spark: Any, tmp_path: Path) -> None:
    run = Run(distributor(mode, spark), long_training, str(tmp_path))
    pids = wait_ready(tmp_path)
    run_id = run_id_of(pids[1])
    os.kill(pids[1], signal.SIGKILL)
    error = run.result()
    assert isinstance(error, TrainingFailedError), error
    assert error.first_failure is not None and error.first_failure.rank == 1
    assert error.first_failure.signal == "SIGKILL"
    assert_nothing_left(run_id)


def test_torchrun_agent_sigkilled(mode: str, spark: Any, tmp_path: Path) -> None:
    run = Run(distributor(mode, spark), long_training, str(tmp_path))
    pids = wait_ready(tmp_path)
    run_id = run_id_of(pids[0])
    agents = [
        p
        for p in psutil.Process(pids[0]).parents()
        if "sparktorch_ops.node.agent" in " ".join(p.cmdline())
    ]
    assert agents, "no agent above rank 0"
    agents[-1].kill()  # the topmost: the forked supervisor shares the agent's command line
    error = run.result()
    assert isinstance(error, TrainingFailedError), error
    assert_nothing_left(run_id)


def test_cancel_from_another_thread_says_where_the_ranks_were(
    mode: str, spark: Any, tmp_path: Path
) -> None:
    d = distributor(mode, spark)
    d.cancel()  # nothing in progress: does nothing
    assert d.stacks() == {}
    run = Run(d, long_training, str(tmp_path))
    pids = wait_ready(tmp_path)
    run_id = run_id_of(pids[0])
    stacks = d.stacks()  # on demand, from another thread, while the ranks train
    assert sorted(stacks) == [0, 1]
    assert all("long_training" in text for text in stacks.values()), stacks
    with pytest.raises(ConfigError, match="run_id"):
        d.stacks(run_id="sparktorch-not-a-run")
    d.cancel()
    error = run.result()
    assert isinstance(error, TrainingCancelledError), error
    assert sorted(error.stacks) == [0, 1] and "long_training" in error.stacks[1]
    assert "where the ranks were" in str(error) and "rank 1 in " in str(error)
    assert_nothing_left(run_id)
    d.cancel()  # after the run: does nothing


def test_cancel_from_a_sigterm_handler_on_the_main_thread(tmp_path: Path) -> None:
    d = distributor("local", None)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: d.cancel())
    run_ids: list[str] = []

    def send_sigterm() -> None:
        pids = wait_ready(tmp_path)
        run_ids.append(run_id_of(pids[0]))
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send_sigterm, daemon=True).start()
    try:
        with pytest.raises(TrainingCancelledError):
            d.run(long_training, str(tmp_path))  # the main thread waits here
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert_nothing_left(run_ids[0])


def test_timeout_expiring(spark: Any, tmp_path: Path) -> None:
    """A timeout stops the run as a cancel does (the supervisor's, whichever the launcher:
    local mode's teardown is the cancel tests'), saying where the ranks were."""
    run = Run(distributor("barrier", spark, timeout=10), long_training, str(tmp_path))
    pids = wait_ready(tmp_path)
    run_id = run_id_of(pids[0])
    error = run.result()
    assert isinstance(error, TrainingTimeoutError), error
    assert error.setting == "timeout" and "raise timeout" in str(error)
    assert "long_training" in error.stacks[0], error.stacks
    assert_nothing_left(run_id)


STALL_S = 5.0


def test_a_stalled_run_fails_with_every_ranks_stack(spark: Any, tmp_path: Path) -> None:
    """Rank 1 sleeps in its data loading while rank 0 waits for it in an all-reduce. (The
    silences and stacks come over the channel, the same in either mode; a quiet local run is
    test_a_heartbeat_keeps_a_quiet_run_from_stalling's.)"""
    run = Run(
        distributor("barrier", spark, stall_timeout=STALL_S), hang_in_collective, str(tmp_path)
    )
    pids = wait_ready(tmp_path)
    run_id = run_id_of(pids[0])
    ready = time.monotonic()
    error = run.result()
    took = time.monotonic() - ready
    assert isinstance(error, TrainingStalledError), error
    assert isinstance(error, TrainingFailedError)  # retried like any failed training
    assert took < STALL_S + 30, f"the stall took {took:.1f} s to become an error"
    assert [f.rank for f in error.failures] == [1, 0]  # rank 1 went silent first
    assert error.stall_timeout == STALL_S and min(error.silent_for.values()) >= STALL_S
    text = str(error)
    assert "rank 1 silent for" in text and "in stuck_in_data_loading (training.py:" in text
    assert "rank 0 silent for" in text and "in all_reduce (" in text
    assert "time.sleep(3600)" in error.stacks[1] and "hang_in_collective" in error.stacks[0]
    assert_nothing_left(run_id)


def test_a_heartbeat_keeps_a_quiet_run_from_stalling() -> None:
    d = distributor("local", None, stall_timeout=2)
    assert d.run(heartbeat_only, 6.0) == "done"


def test_too_few_slots_with_start_timeout(spark: Any) -> None:
    started = time.monotonic()
    with pytest.raises(StartTimeoutError, match="start_timeout") as info:
        TorchDistributor(
            num_processes=3, local_mode=False, use_gpu=False, spark=spark, start_timeout=3
        ).run(print)
    assert info.value.setting == "start_timeout"
    assert 3 <= time.monotonic() - started < 60
