"""The warm agent (issue 16): runs reuse a fork server that has imported torch, invisibly.

Every test checks that the warm path was really taken (the agent's parent is the warm process)
before it checks that nothing of one run reaches the next, and the "nothing left" checks look
for the warm process itself next to the run's marked processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from harness.procs import (
    alive,
    cuda_touched_before_fork_env,
    wait_until_gone,
    warm_processes,
)
from sparktorch_ops import (
    TorchDistributor,
    TrainingCancelledError,
    TrainingFailedError,
    TrainingTimeoutError,
)
from sparktorch_ops.node import prefork
from sparktorch_ops.wire import env as wire_env
from sparktorch_ops.wire.env import WARM_PROCESS_ENV
from tests.support.cluster import cluster_env
from tests.support.driver import ROOT


@pytest.fixture(autouse=True)
def no_warm_process_before_or_after() -> Any:
    prefork.shutdown()
    yield
    prefork.shutdown()


def visible_state(tmp: str, change: bool) -> dict[str, Any]:
    """What a run could leave behind in a reused process; the first run changes all of it."""
    import torch

    seen = {
        "env": os.environ.get("STO_LEAKED_VARIABLE"),
        "module": "sto_leaked_module" in sys.modules,
        "threads": torch.get_num_threads(),
        "agent_parent": psutil.Process().parent().parent().ppid(),  # rank < sup < agent < warm
        "forked_warm": forked_warm(),
        "marker": psutil.Process().environ().get("SPARKTORCH_OPS_RUN_ID"),
        "run_id": os.environ["SPARKTORCH_OPS_RUN_ID"],
    }
    if change:
        os.environ["STO_LEAKED_VARIABLE"] = "set by the first run"
        sys.path.insert(0, tmp)
        import sto_leaked_module  # noqa: F401

        torch.set_num_threads(torch.get_num_threads() + 2)
    return seen


def forked_warm() -> bool:
    """Whether this rank's agent was forked by a warm process."""
    agent = psutil.Process().parent().parent()
    assert agent.cmdline()[1:3] == ["-m", "sparktorch_ops.node.agent"]  # the same, forked or not
    return WARM_PROCESS_ENV in psutil.Process(agent.ppid()).environ()


def test_a_second_run_reuses_the_warm_agent_and_sees_nothing_of_the_first(
    tmp_path: Path,
) -> None:
    (tmp_path / "sto_leaked_module.py").write_text("VALUE = 1\n")
    distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    first = distributor.run(visible_state, str(tmp_path), True)
    (server,) = warm_processes(os.getpid())
    second = distributor.run(visible_state, str(tmp_path), False)
    assert first["agent_parent"] == second["agent_parent"] == server.pid
    assert first["forked_warm"] and second["forked_warm"]
    assert second["env"] is None and second["module"] is False
    assert second["threads"] == first["threads"]
    # Every process of a run carries its marker in the process table, forked or not.
    assert first["marker"] == first["run_id"] and second["marker"] == second["run_id"]
    # After a success the warm process stays (the allow-list), and only it.
    assert [p.pid for p in warm_processes(os.getpid())] == [server.pid]
    assert wait_until_gone(first["run_id"]) == [] and wait_until_gone(second["run_id"]) == []


def agent_parent() -> int:
    return psutil.Process().parent().parent().ppid()


def test_a_killed_warm_process_is_replaced() -> None:
    distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    first = distributor.run(agent_parent)
    os.kill(first, signal.SIGKILL)
    assert _gone(first)
    second = distributor.run(agent_parent)
    assert second != first
    assert [p.pid for p in warm_processes(os.getpid())] == [second]


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_another_environment_gets_its_own_warm_process_and_the_old_one_leaves() -> None:
    first = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(agent_parent)
    second = TorchDistributor(
        num_processes=2, local_mode=True, use_gpu=False, env={"STO_IMPORT_TIME_SETTING": "1"}
    ).run(agent_parent)
    assert second != first
    assert _gone(first)
    assert [p.pid for p in warm_processes(os.getpid())] == [second]


def sleep_then(seconds: float, fail: bool = False) -> str:
    time.sleep(seconds)
    if fail:
        raise RuntimeError("failed on purpose")
    return os.environ["SPARKTORCH_OPS_RUN_ID"]


@pytest.mark.parametrize("ending", ["cancel", "timeout", "failure"])
def test_no_warm_process_is_left_after_a_run_that_did_not_succeed(ending: str) -> None:
    distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    run_id = distributor.run(sleep_then, 0.0)  # a warm process now exists
    assert warm_processes(os.getpid())
    if ending == "cancel":
        timer = threading.Timer(2.0, distributor.cancel)
        timer.start()
        with pytest.raises(TrainingCancelledError):
            distributor.run(sleep_then, 60.0)
        timer.join()
    elif ending == "timeout":
        with pytest.raises(TrainingTimeoutError):
            TorchDistributor(num_processes=2, local_mode=True, use_gpu=False, timeout=3).run(
                sleep_then, 60.0
            )
    else:
        with pytest.raises(TrainingFailedError):
            distributor.run(sleep_then, 0.0, fail=True)
    assert _no_warm_process_within(30.0)
    assert wait_until_gone(run_id) == []
    assert wait_until_gone() == []


def _no_warm_process_within(timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while warm_processes(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not warm_processes(os.getpid())


DRIVER = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from sparktorch_ops import TorchDistributor

def warm_pid():
    import psutil
    return psutil.Process().parent().parent().ppid()

def hang(marker):
    Path(marker + os.environ["RANK"]).write_text(str(os.getpid()))
    time.sleep(300)

d = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
print("WARM", d.run(warm_pid), flush=True)
d.run(hang, {marker!r})
"""


def test_a_killed_driver_leaves_no_warm_process_and_no_rank(tmp_path: Path) -> None:
    marker = str(tmp_path / "rank-")
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT), marker=marker))
    driver = subprocess.Popen(
        [sys.executable, str(script)],
        env=cluster_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()
        while line and not line.startswith("WARM "):  # the run's own output comes first
            line = driver.stdout.readline()
        assert line.startswith("WARM "), line
        warm_pid = int(line.split()[1])
        deadline = time.monotonic() + 120
        while not all(Path(f"{marker}{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and driver.poll() is None
            time.sleep(0.1)
        ranks = [psutil.Process(int(Path(f"{marker}{r}").read_text())) for r in (0, 1)]
        server = psutil.Process(warm_pid)
        assert WARM_PROCESS_ENV in server.environ()
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 30
    while alive([server, *ranks]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive([server, *ranks]) == []
    assert warm_processes(driver.pid) == []


def test_a_warm_process_that_touched_cuda_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU-only condition, simulated (the one mock here): torch says CUDA was initialised
    in the warm process. It must refuse to fork; the run starts a cold agent and works."""
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    env = cuda_touched_before_fork_env(tmp_path)
    distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False, env=env)
    facts = distributor.run(agent_command)
    # The agent is a fresh interpreter, and so are the ranks (the supervisor's own check).
    assert facts["warm"] is False and facts["agent"][1:3] == ["-m", "sparktorch_ops.node.agent"]
    assert facts["rank"][1:4] == ["-u", "-m", "sparktorch_ops.rank.worker"], facts
    assert _no_warm_process_within(30.0)


def agent_command() -> dict[str, Any]:
    me = psutil.Process()
    return {"rank": me.cmdline(), "agent": me.parent().parent().cmdline(), "warm": forked_warm()}


def test_the_warm_agent_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(wire_env.WARM_AGENT_ENV, "0")
    facts = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(agent_command)
    assert facts["warm"] is False
    assert warm_processes(os.getpid()) == []


def barrier_state(tmp: str, change: bool) -> dict[str, Any]:
    return visible_state(tmp, change)


def test_barrier_runs_reuse_each_python_workers_warm_agent_invisibly(
    spark: Any, tmp_path: Path
) -> None:
    (tmp_path / "sto_leaked_module.py").write_text("VALUE = 1\n")
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    first = distributor.run(barrier_state, str(tmp_path), True)
    second = distributor.run(barrier_state, str(tmp_path), False)
    assert first["forked_warm"] and second["forked_warm"]
    assert second["env"] is None and second["module"] is False
    assert second["threads"] == first["threads"]
    assert second["marker"] == second["run_id"]
    assert wait_until_gone(first["run_id"]) == [] and wait_until_gone(second["run_id"]) == []


def test_a_cancelled_barrier_run_leaves_no_warm_process(spark: Any) -> None:
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    distributor.run(sleep_then, 0.0)
    assert _warm_processes_under_spark()
    timer = threading.Timer(4.0, distributor.cancel)
    timer.start()
    with pytest.raises(TrainingCancelledError):
        distributor.run(sleep_then, 60.0)
    timer.join()
    deadline = time.monotonic() + 30
    while _warm_processes_under_spark() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _warm_processes_under_spark() == []
    assert wait_until_gone() == []


def _warm_processes_under_spark() -> list[psutil.Process]:
    """Warm processes started by this session's Python workers (children of our JVM)."""
    return [proc for proc in warm_processes() if any(p.name() == "java" for p in _ancestors(proc))]


def _ancestors(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.parents()
    except psutil.Error:
        return []
