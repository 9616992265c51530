"""Finding the processes of a run by the marker every one of them carries."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

from sparktorch_ops.wire.env import RUN_ID_ENV

# What every rank must see, as torchrun sets it (plus the threads we set).
ENV_CONTRACT = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
)


def measuring_coverage() -> bool:
    """Whether this session runs under ``scripts/test.sh --coverage`` (every Python it starts
    is measured, and must end on its own to write what it measured)."""
    return bool(os.environ.get("COVERAGE_PROCESS_CONFIG") or os.environ.get("COVERAGE_FILE"))


def processes_with_marker(run_id: str | None = None) -> list[psutil.Process]:
    """Live processes whose environment carries the run marker (any run when run_id is None)."""
    return processes_with_env(RUN_ID_ENV, lambda value: run_id is None or value == run_id)


def processes_with_env(name: str, accept: Callable[[str], bool]) -> list[psutil.Process]:
    """Live processes (no zombies) whose environment has ``name`` with a value ``accept`` takes."""
    found = []
    for proc in psutil.process_iter():
        try:
            value = proc.environ().get(name)
            if value is not None and accept(value) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def wait_until_gone(run_id: str | None = None, timeout: float = 30.0) -> list[psutil.Process]:
    """Wait until no process of the run is left; return what is still there at the deadline."""
    deadline = time.monotonic() + timeout
    left = processes_with_marker(run_id)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = processes_with_marker(run_id)
    return left


def group_members(pgid: int) -> list[psutil.Process]:
    """Live processes of process group ``pgid`` (a server started in a group of its own)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


def alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` still running (the same process, not a reused pid) and not zombies."""
    left = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(proc)
        except psutil.Error:
            continue
    return left


def warm_processes(launcher: int | None = None) -> list[psutil.Process]:
    """Live warm agents (fork servers) started by ``launcher`` (any launcher when None)."""
    from sparktorch_ops.wire.env import WARM_PROCESS_ENV

    return processes_with_env(
        WARM_PROCESS_ENV, lambda token: launcher is None or token.startswith(f"{launcher}-")
    )


def cuda_touched_before_fork_env(tmp_path: Path) -> dict[str, str]:
    """A GPU-only condition, simulated (the one mock of the suite): an environment whose
    interpreters report that CUDA was initialised (torch's bad-fork flag), through a
    ``sitecustomize`` first on ``PYTHONPATH``. Unset PYTORCH_NVML_BASED_CUDA_CHECK too."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import torch.cuda\ntorch.cuda._is_in_bad_fork = lambda: True\n"
    )
    paths = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(paths)}
