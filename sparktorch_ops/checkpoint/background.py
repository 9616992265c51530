"""Saves in the background (``save(..., blocking=False)``): the state copied now, written and
committed by one writer thread on a gloo group of its own; :func:`wait` for this rank's save
in flight, which ``destroy_process_group`` and the end of the training function also wait for."""

from __future__ import annotations

import atexit
import contextlib
import copy
import logging
import os
import queue
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from sparktorch_ops.checkpoint.group import Group, announce, describe
from sparktorch_ops.checkpoint.state import plain_state_dict
from sparktorch_ops.errors import CheckpointError

if TYPE_CHECKING:
    from sparktorch_ops.checkpoint.saving import Write


class _BackgroundSave:
    """This rank's one save in flight: done once written (or failed), and its failure."""

    def __init__(self, rank: int, step: int, url: str) -> None:
        self.rank = rank
        self.step = step
        self.url = url
        self.error: CheckpointError | None = None
        self.done = threading.Event()


_in_flight: list[_BackgroundSave] = []  # at most one; a list so no `global` is needed
_in_flight_lock = threading.Lock()
# (the default process group, the group of background saves created from it)
_background_groups: list[tuple[Any, Any]] = []


def wait() -> str | None:
    """Wait for this rank's save in flight (``save(..., blocking=False)``) to commit.

    Called by the next save, :func:`load_latest`, ``destroy_process_group`` and at the end of
    the training function; call it where the checkpoint must exist, e.g. before reading it.
    Only this rank waits (no collective); a state that rank 0 writes alone is in flight on
    rank 0 only.

    Returns:
        The step directory of the save waited for, None when none was in flight.

    Raises:
        CheckpointError: the background save failed (its error is the ``__cause__``).
    """
    with _in_flight_lock:
        pending = _in_flight.pop() if _in_flight else None
    if pending is None:
        return None
    pending.done.wait()
    if pending.error is not None:
        raise pending.error
    return pending.url


def save_in_background(write: Write, converted: Mapping[str, Any]) -> None:
    """Copy the state now; the writer thread writes and commits it."""
    group = write.group
    process_group = _background_group(group)
    staged = None
    if group.rank == 0 or not write.alone:
        staged = _copied(plain_state_dict(converted), sharded=not write.alone)
    if write.alone and group.rank == 0:
        # See Group.quiet; from a thread, catch_warnings races.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
    pending = _BackgroundSave(group.rank, write.step, write.url)

    def job() -> None:
        try:
            write(staged, process_group)
        except BaseException as exc:
            pending.error = CheckpointError(pending.rank, write.step, write.url, describe(exc))
            pending.error.__cause__ = exc
            announce(
                f"{pending.error}; the run fails at the next save, wait() or its end",
                None,
                logging.WARNING,
            )
        finally:
            pending.done.set()

    _wait_before_destroying_process_groups()
    with _in_flight_lock:
        _in_flight.append(pending)
    _writer.submit(job)


def _copied(state: Any, *, sharded: bool) -> Any:
    """A copy of ``state`` in CPU memory that training cannot change: DCP's stager for sharded
    tensors, a plain copy of each tensor otherwise (a tenth of its time for a small state)."""
    import torch

    if sharded:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(False, False, False, False))
        try:
            return stager.stage(state)
        finally:
            stager.close()
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, Mapping):
        return {key: _copied(value, sharded=False) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_copied(value, sharded=False) for value in state)
    return copy.deepcopy(state)


class _Writer:
    """The thread that writes this process's background saves, one after the other.

    One thread, started by the first background save: a thread started per save would make
    the training thread wait for it to be scheduled. It runs at the OS's idle priority where
    there is one (Linux's ``SCHED_IDLE``), so a write takes the CPU that training leaves; a
    rank that waits for the write leaves its core to it. It stops with the process group
    (``destroy_process_group``) and at exit: a thread that ran collectives must end before
    the process's C++ state is torn down.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # none yet, or forked
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._run, args=(self._jobs,), name="checkpoint-writer", daemon=True
                )
                self._thread.start()
                atexit.register(self.stop)
            self._jobs.put(job)

    def stop(self) -> None:
        """End the thread once its jobs are done; the next save starts another."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            atexit.unregister(self.stop)
            self._jobs.put(None)
        thread.join()

    @staticmethod
    def _run(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        with contextlib.suppress(AttributeError, OSError):  # not Linux, or refused
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        while (job := jobs.get()) is not None:
            job()


_writer = _Writer()


def _background_group(group: Group) -> Any:
    """The gloo group background saves use, made once per default process group."""
    if group.no_dist:
        return None
    import torch.distributed as dist

    world = dist.group.WORLD
    for known, made in _background_groups:
        if known is world:
            return made
    made = dist.new_group(backend="gloo")  # a collective: every rank saves at the same point
    _background_groups[:] = [(world, made)]
    return made


def _wait_before_destroying_process_groups() -> None:
    """Make ``torch.distributed.destroy_process_group`` wait for the save in flight first:
    training code calls it at its end, and it would tear down the background save's group."""
    import functools

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group
    if getattr(original, "_waits_for_checkpoints", False):
        return

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> None:
        try:
            wait()
        finally:
            _writer.stop()
            original(*args, **kwargs)

    destroy_process_group._waits_for_checkpoints = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
