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
