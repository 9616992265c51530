"""Rank code shared by the orchestrator retry tests: it resumes from its checkpoints."""

from __future__ import annotations

from typing import Any


def steps_with_one_failure(steps: int, marker: str) -> dict[str, Any]:
    """A step counter in a checkpoint, saved every step; the first try fails after step 1
    (``marker`` remembers it). Returns where it started, the steps it ran and the total."""
    import os

    import torch
    import torch.distributed as dist

    from sparktorch_ops import checkpoint

    dist.init_process_group("gloo")
    try:
        state = {"total": torch.zeros(1)}
        start = checkpoint.load_latest(state)
        ran = []
        for step in range(0 if start is None else start + 1, steps):
            state["total"] += step
            checkpoint.save(state, step)
            ran.append(step)
            if step == 1 and not os.path.exists(marker):
                dist.barrier()
                if dist.get_rank() == 0:
                    open(marker, "w").close()
                raise RuntimeError("the first try dies after step 1's checkpoint")
        return {"start": start, "ran": ran, "total": float(state["total"])}
    finally:
        dist.destroy_process_group()
