"""Rank code shared by the orchestrator retry tests: it resumes from its checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def checkpointed_steps(steps: int, after_save: Callable[[int], None]) -> dict[str, Any]:
    """A step counter in a checkpoint, saved every step (and reported as ``total``), with
    ``after_save(step)`` called once each step's checkpoint is committed. Returns where it
    started, the steps it ran and the total."""
    import torch
    import torch.distributed as dist

    from sparktorch_ops import checkpoint, report

    dist.init_process_group("gloo")
    try:
        state = {"total": torch.zeros(1)}
        start = checkpoint.load_latest(state)
        ran = []
        for step in range(0 if start is None else start + 1, steps):
            state["total"] += step
            report(step=step, total=float(state["total"]))
            checkpoint.save(state, step)
            ran.append(step)
            after_save(step)
        return {"start": start, "ran": ran, "total": float(state["total"])}
    finally:
        dist.destroy_process_group()


def steps_with_one_failure(steps: int, marker: str) -> dict[str, Any]:
    """:func:`checkpointed_steps` whose first try fails after step 1 (``marker`` remembers
    it)."""
    import os

    import torch.distributed as dist

    def fail_once(step: int) -> None:
        if step == 1 and not os.path.exists(marker):
            dist.barrier()
            if dist.get_rank() == 0:
                open(marker, "w").close()
            raise RuntimeError("the first try dies after step 1's checkpoint")

    return checkpointed_steps(steps, fail_once)


def steps_killed_once(steps: int, directory: str, kill_after: int = 2) -> dict[str, Any]:
    """:func:`checkpointed_steps` whose first attempt loses rank 1 to a SIGKILL (as from the
    OOM killer) right after step ``kill_after``'s checkpoint. Each rank records its pid in
    ``directory`` (``<attempt>.rank<N>``, attempt ``first`` or ``later``); a later attempt's
    value adds the first attempt's ranks it still found alive when it started."""
    import os
    import signal
    from pathlib import Path

    folder, rank = Path(directory), int(os.environ["RANK"])
    first = not (folder / "killed").exists()
    (folder / f"{'first' if first else 'later'}.rank{rank}").write_text(str(os.getpid()))
    alive = [] if first else [pid for pid in _pids(folder, "first") if _alive(pid)]

    def kill_once(step: int) -> None:
        if first and step == kill_after and rank == 1:
            (folder / "killed").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)

    return {**checkpointed_steps(steps, kill_once), "earlier_alive": alive}


def killed_every_time(directory: str) -> None:
    """Rank 1 SIGKILLs itself at once, in every attempt (counted in ``directory``)."""
    import os
    import signal
    from pathlib import Path

    if os.environ["RANK"] == "1":
        count = len(list(Path(directory).glob("attempt*")))
        Path(directory, f"attempt{count + 1}").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    import time

    time.sleep(60)  # rank 0 waits to be stopped


def _pids(folder: Any, attempt: str) -> list[int]:
    return [int(path.read_text()) for path in folder.glob(f"{attempt}.rank*")]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
