"""Saving: :func:`save`, which form a state is written in (rank 0 alone or every rank with
DCP), the steps a process knows of a directory, one save's write, commit and pruning
(:class:`Write`), and saves in the background (``blocking=False``) with :func:`wait`.

A background save of DCP's files is DCP's ``async_save`` on a gloo group of its own; its
commit and pruning run when it completes. A state file (``state.pt``, a small replicated
state) is one ``torch.save``, which ``async_save`` does not write: that save runs on a
thread of ``concurrent.futures`` of its own, with the same commit.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import json
import logging
import threading
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparktorch_ops.checkpoint import reports
from sparktorch_ops.checkpoint.group import Group, announce, describe
from sparktorch_ops.checkpoint.state import (
    ModuleState,
    OptimizerState,
    TrainingState,
    plain_state_dict,
    sharded,
    sharded_types,
    to_dcp,
)
from sparktorch_ops.checkpoint.storage import (
    COMMIT_MARKER,
    Storage,
    dcp_writer,
    location_of,
    step_dir_name,
    steps,
    write_state,
)
from sparktorch_ops.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    import torch


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a non-negative int" if minimum == 0 else f"an int >= {minimum}"
        raise ConfigError(name, f"must be {kind}, got {value!r}")
    return value


def save(
    state: TrainingState | Mapping[str, Any],
    step: int,
    *,
    keep: int = 3,
    directory: str | None = None,
    blocking: bool = True,
) -> str:
    """Save ``state`` as the checkpoint of ``step``; every rank must call it.

    The state is written with DCP into ``<dir>/step-<step:09d>/``: by every rank, each its own
    part, when it is sharded or larger than 32 MiB; by rank 0 alone otherwise (a replicated
    state: every rank holds it whole). Rank 0 then writes the ``COMMITTED`` marker, deletes
    committed checkpoints beyond the newest ``keep`` and uncommitted step directories older
    than the newest committed one. Returns on every rank once all of that is done, or, with
    ``blocking=False``, once the state is copied: the rest runs in the background (see the
    module docstring; :func:`wait` waits for it). A leftover uncommitted directory of the same
    step (a crash in an earlier save) is deleted first. A save still in flight is waited for
    first.

    Args:
        state: a :class:`TrainingState` or a dict (see the module docstring).
        step: the step (or epoch) this checkpoint ends; :func:`load_latest` returns it.
        keep: how many committed checkpoints to keep, at least 1.
        directory: the checkpoint directory (default: :func:`checkpoint_dir`).
        blocking: False to write in the background while training goes on.

    Returns:
        The step directory (a path, or a URL for an fsspec URL directory); with
        ``blocking=False`` it counts once the background save committed it.

    Raises:
        ConfigError: no directory is set, ``step``, ``keep`` or ``blocking`` is invalid,
            ``step`` was already committed or saved, the state is not a TrainingState or dict,
            or ``WORLD_SIZE`` > 1 without an initialized process group.
        CheckpointError: the previous save, written in the background, failed.
    """
    _check_int("step", step, 0)
    _check_int("keep", keep, 1)
    if not isinstance(blocking, bool):
        raise ConfigError("blocking", f"must be True or False, got {blocking!r}")
    wait()
    location = location_of(directory)
    converted = to_dcp(state)
    group = Group()
    known = _known_steps(location, group)
    if step in known.refused:
        raise ConfigError(
            "step",
            f"step {step} is already checkpointed (or being saved) at "
            f"{location.url(step_dir_name(step))}; save each step once (resume from "
            "load_latest()'s step + 1)",
        )
    known.refused.add(step)
    compact = _replicated(converted)
    alone = group.no_dist or compact
    name = step_dir_name(step)
    if group.rank == 0:
        with _known_lock:
            leftover = known.present.get(step) is False
            known.present[step] = False  # until its marker is written
        if leftover:
            location.remove_tree(name)  # a save of this step that never committed
    write = Write(location, step, keep, group, known, alone, compact)
    if not alone:
        group.barrier()  # no rank writes before rank 0 removed a leftover of this step
    if blocking:
        try:
            with group.quiet():
                write(converted)
        except BaseException:
            known.refused.discard(step)  # every rank failed: the step may be saved again
            raise
        return write.url
    _save_in_background(write, converted)
    return write.url


_ALONE_MAX_BYTES = 32 * 2**20
"""A replicated state up to this size is written by rank 0 alone, without a collective: for a
small state DCP's coordination of the ranks costs more than spreading its writes saves, and
the other ranks leave their training at once."""


def _replicated(converted: Mapping[str, Any]) -> bool:
    """Whether every rank holds the whole state and it is at most ``_ALONE_MAX_BYTES``: no
    part is sharded (a ``DTensor``, a ``ShardedTensor``, a module under FSDP1)."""
    import torch

    def tensors(value: Any) -> Iterator[Any]:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, Mapping):
            for inner in value.values():
                yield from tensors(inner)
        elif isinstance(value, list | tuple):
            for inner in value:
                yield from tensors(inner)

    types = sharded_types()
    total = 0
    modules: list[torch.nn.Module] = []
    for value in converted.values():
        found: Iterator[Any]
        if isinstance(value, ModuleState):
            modules.append(value.module)
            found = itertools.chain(value.module.parameters(), value.module.buffers())
        elif isinstance(value, OptimizerState):
            found = tensors(list(value.optimizer.state.values()))
        else:
            found = tensors(value)
        for tensor in found:
            total += tensor.numel() * tensor.element_size()
            if total > _ALONE_MAX_BYTES or isinstance(tensor, types):
                return False
    return not any(sharded(module) for module in modules)


class _KnownSteps:
    """One checkpoint directory's steps as this process knows them.

    Rank 0 lists the directory at the process's first save there and every rank gets the
    listing; from then on the saves keep it up to date, since one training writes a
    directory: later saves decide without listing or a collective, every rank the same way.
    """

    def __init__(self, found: Mapping[int, bool]) -> None:
        self.refused = {step for step, done in found.items() if done}
        """Committed when listed, or saved by this process since: saving them is refused."""
        self.present = dict(found)
        """Rank 0: the step directories there now, and whether each is committed."""


_known: dict[str, _KnownSteps] = {}
_known_lock = threading.Lock()  # a background save prunes while the next save starts


def _known_steps(location: Storage, group: Group) -> _KnownSteps:
    known = _known.get(location.root)
    if known is None:
        known = _KnownSteps(group.decide(lambda: steps(location)))
        _known[location.root] = known
    return known


@dataclass
class Write:
    """One save's writing and commit, in the foreground or in the background."""

    location: Storage
    step: int
    keep: int
    group: Group
    known: _KnownSteps
    alone: bool
    compact: bool

    def __post_init__(self) -> None:
        self.name = step_dir_name(self.step)
        self.url = self.location.url(self.name)
        # Rank 0's reports up to this step go with it: a resume replays what MLflow may lack.
        self.reports = reports.carried(self.group.rank)

    def __call__(self, state: Mapping[str, Any]) -> None:
        """Write ``state`` (rank 0 all of it when alone, else every rank its part) and commit
        it; every rank returns once the step is committed, or raises if any rank failed to
        write its part."""
        import torch.distributed.checkpoint as dcp

        if self.alone:
            self.write_alone(state, None)
        else:
            dcp.save(state, storage_writer=dcp_writer(self.location, self.name))
        self.commit(None)

    def write_alone(self, state: Mapping[str, Any] | None, process_group: Any) -> None:
        """Rank 0 writes (other ranks' ``state`` is unused); then every rank learns whether it
        did (which is also every rank's sign that it reached this save: a rank gone before it
        leaves the step uncommitted)."""
        import torch.distributed.checkpoint as dcp

        failure: Exception | None = None
        if self.group.rank == 0:
            try:
                if self.compact:
                    assert state is not None
                    write_state(self.location, plain_state_dict(state), self.name)
                else:
                    writer = dcp_writer(self.location, self.name)
                    dcp.save(state, storage_writer=writer, no_dist=True)
            except Exception as exc:
                failure = exc
        if self.group.world > 1:
            import torch.distributed as dist

            self._check_group()
            outcomes: list[Any] = [None] * self.group.world
            described = None if failure is None else describe(failure)
            dist.all_gather_object(outcomes, described, group=process_group)
            if failure is None and outcomes[0] is not None:
                raise RuntimeError(f"rank 0 could not write it: {outcomes[0]}")
        if failure is not None:
            raise failure

    def commit(self, process_group: Any) -> None:
        """Rank 0 commits the written step; every rank returns once it is committed."""
        self._check_group()
        if self.group.rank == 0:
            self._commit()
        self.group.barrier(process_group)

    def _check_group(self) -> None:
        """A save in flight cannot commit once its process group was destroyed: DCP would have
        gone on as a single process, so the step is left uncommitted."""
        import torch.distributed as dist

        if self.group.initialized and not dist.is_initialized():
            raise RuntimeError(
                "the process group was destroyed while the save was in flight: call "
                "sparktorch_ops.checkpoint.wait() before torch.distributed.destroy_process_group()"
            )

    def _commit(self) -> None:
        """Rank 0: the reports, the marker, then pruning."""
        location = self.location
        reports.write(location, self.name, self.reports)
        marker = {
            "step": self.step,
            "world_size": self.group.world,
            "time": datetime.datetime.now(datetime.UTC).isoformat(),
            "torch": _torch_version(),
        }
        location.write(json.dumps(marker).encode(), self.name, COMMIT_MARKER)
        with _known_lock:
            present = self.known.present
            present[self.step] = True
            committed = sorted((s for s, done in present.items() if done), reverse=True)
            doomed = committed[self.keep :] + [
                s for s, done in present.items() if not done and s < committed[0]
            ]
        for step in sorted(doomed):
            try:
                location.remove_tree(step_dir_name(step))
            except FileNotFoundError:
                pass  # deleted by someone else
            except Exception as exc:  # best effort (any store's error): a later save tries again
                announce(
                    f"could not delete {location.url(step_dir_name(step))}: {exc}",
                    None,
                    logging.WARNING,
                )
                continue
            with _known_lock:
                present.pop(step, None)


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


# -- in the background ----------------------------------------------------------------------------
_in_flight: list[Future[str]] = []  # this rank's one save in flight, committed or failed
_in_flight_lock = threading.Lock()
# (the default process group, the group of background saves created from it)
_background_groups: list[tuple[Any, Any]] = []


def wait() -> str | None:
    """Wait for this rank's save in flight (``save(..., blocking=False)``) to commit.

    Called by the next save, :func:`load_latest` and when the training function returns;
    call it where the checkpoint must exist, e.g. before reading it, and before
    ``torch.distributed.destroy_process_group()``. Only this rank waits (no collective).

    Returns:
        The step directory of the save waited for, None when none was in flight.

    Raises:
        CheckpointError: the background save failed (its error is the ``__cause__``).
    """
    with _in_flight_lock:
        pending = _in_flight.pop() if _in_flight else None
    return None if pending is None else pending.result()


def _save_in_background(write: Write, converted: Mapping[str, Any]) -> None:
    """Copy the state now; write it, then commit it, when its write completes."""
    group = write.group
    process_group = _background_group(group)
    if group.no_dist:
        # See Group.quiet; from a thread, catch_warnings races.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
    written: Future[Any]
    if write.compact:
        staged = _copied(plain_state_dict(converted)) if group.rank == 0 else None
        executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-state-file")
        written = executor.submit(write.write_alone, staged, process_group)
        executor.shutdown(wait=False)  # its thread ends after this one write
    else:
        import torch.distributed.checkpoint as dcp

        response = dcp.async_save(
            dict(converted),
            storage_writer=dcp_writer(write.location, write.name),
            process_group=process_group,
            no_dist=group.no_dist,
        )
        assert isinstance(response, Future)  # staged at once: the default stager is not async
        written = response
    committed: Future[str] = Future()

    def commit(done: Future[Any]) -> None:
        try:
            done.result()
            write.commit(process_group)
        except BaseException as exc:
            error = CheckpointError(group.rank, write.step, write.url, describe(exc))
            error.__cause__ = exc
            announce(
                f"{error}; the run fails at the next save, wait() or its end",
                None,
                logging.WARNING,
            )
            committed.set_exception(error)
        else:
            committed.set_result(write.url)

    with _in_flight_lock:
        _in_flight.append(committed)
    written.add_done_callback(commit)


def _copied(state: Any) -> Any:
    """A copy of a replicated ``state`` in CPU memory that training cannot change: a plain copy
    of each tensor (a tenth of the time of DCP's stager for a small state)."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, Mapping):
        return {key: _copied(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_copied(value) for value in state)
    return copy.deepcopy(state)


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
