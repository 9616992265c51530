"""Training functions for the fault tests (shipped by value: the ranks cannot import tests)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def mark_ready(ready_dir: str) -> None:
    """Write this rank's pid, so a test knows training is under way and whom to kill."""
    path = Path(ready_dir, f"rank{os.environ['RANK']}.pid")
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    os.replace(path.with_suffix(".tmp"), path)


def long_training(ready_dir: str, seconds: float = 300.0) -> str:
    """Collectives every 100 ms for ``seconds``: a run that only ends when something ends it."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mark_ready(ready_dir)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        dist.barrier()
        time.sleep(0.1)
    dist.destroy_process_group()
    return "finished"


def fail_after_ready(ready_dir: str, how: str) -> str:
    """Rank 1 fails (raise / exit 3) once every rank is in training; the others keep going."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mark_ready(ready_dir)
    dist.barrier()
    if os.environ["RANK"] == "1":
        time.sleep(0.5)
        if how == "raise":
            raise RuntimeError("rank 1 raised on purpose")
        os._exit(3)
    while True:  # rank 0 would wait on rank 1 forever: the distributor must end it
        time.sleep(0.1)


def stuck_in_data_loading() -> None:
    """A data loader that never returns."""
    time.sleep(3600)


def hang_in_collective(ready_dir: str) -> None:
    """Rank 0 waits in an all-reduce that rank 1, stuck loading data, never joins; rank 0's
    last line comes a second after rank 1's, so rank 1 is the one silent longest."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mark_ready(ready_dir)
    if os.environ["RANK"] == "1":
        print("loading the next batch", flush=True)
        stuck_in_data_loading()
    time.sleep(1.0)
    print("reducing", flush=True)
    dist.all_reduce(torch.ones(1))


def heartbeat_only(seconds: float) -> str:
    """Prints nothing for ``seconds``, but reports a heartbeat (no values) twice a second."""
    import sparktorch_ops

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sparktorch_ops.report()
        time.sleep(0.5)
    return "done"
