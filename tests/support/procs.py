"""Finding the processes of a run by the marker every one of them carries."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import psutil

from sparktorch_ops.planning import RUN_ID_ENV

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


def processes_with_marker(run_id: str | None = None) -> list[psutil.Process]:
    """Live processes whose environment carries the run marker (any run when run_id is None)."""
    found = []
    for proc in psutil.process_iter():
        try:
            value = proc.environ().get(RUN_ID_ENV)
            if (
                value is not None
                and (run_id is None or value == run_id)
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
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
