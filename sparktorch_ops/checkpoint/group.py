"""The ranks of a save or load: this process's place in the process group, rank 0's
decisions broadcast to every rank, and what a rank says (:func:`announce`, :func:`describe`)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sparktorch_ops.errors import ConfigError
from sparktorch_ops.rank import reporting

_T = TypeVar("_T")


class Group:
    """This process's place in the default process group (or a group of one)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.initialized = dist.is_available() and dist.is_initialized()
        if self.initialized:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            return
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            world = 1
        if world > 1:
            raise ConfigError(
                "init_process_group",
                f"WORLD_SIZE={world} but torch.distributed is not initialized: call "
                "torch.distributed.init_process_group() before saving or loading checkpoints",
            )
        self.rank, self.world = 0, 1

    @property
    def no_dist(self) -> bool:
        return not self.initialized

    def decide(self, decision: Callable[[], _T]) -> _T:
        """Run ``decision`` on rank 0 and return its value (or raise its error) on every rank."""
        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                outcome = [(True, decision())]
            except Exception as exc:
                outcome = [(False, exc)]
        if self.initialized and self.world > 1:
            import torch.distributed as dist

            dist.broadcast_object_list(outcome, src=0)
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """DCP warns on every call with ``no_dist=True``, which a state rank 0 writes alone
        or one plain process uses on purpose."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield

    def barrier(self, process_group: Any = None) -> None:
        if self.initialized and self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=process_group)


def announce(text: str, log: logging.Logger | None, level: int = logging.INFO) -> None:
    """Say ``text`` as the checkpoint code: to ``log``, else to the driver's log (in a run),
    else to the process's stderr."""
    if log is not None:
        log.log(level, text)
        return
    line = f"sparktorch_ops.checkpoint: {text}"
    # Not the rank's stderr in a run: the driver logs that at WARNING, whatever the news.
    if not reporting.notice(line, level):
        sys.stderr.write(f"{line}\n")
        sys.stderr.flush()


def describe(exc: BaseException) -> str:
    """One line per failure: DCP's CheckpointException holds every rank's error, traceback
    included, in its text."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(
            f"{type(error).__name__}: {error} (on rank {rank})"
            for rank, (error, _trace) in sorted(failures.items())
        )
    return f"{type(exc).__name__}: {exc}"
