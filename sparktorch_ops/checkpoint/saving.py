"""Saving: :func:`save`, which form a state is written in (rank 0 alone or every rank with
DCP), the steps a process knows of a directory, and one save's write, commit and pruning
(:class:`Write`, in the foreground or in the writer thread of :mod:`.background`)."""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparktorch_ops.checkpoint import reports
from sparktorch_ops.checkpoint.background import save_in_background, wait
from sparktorch_ops.checkpoint.group import Group, announce, describe
from sparktorch_ops.checkpoint.layout import (
    COMMIT_MARKER,
    Location,
    location_of,
    step_dir_name,
)
from sparktorch_ops.checkpoint.state import (
    ModuleState,
    OptimizerState,
    TrainingState,
    plain_state_dict,
    sharded,
    sharded_types,
    to_dcp,
)
from sparktorch_ops.errors import ConfigError

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
    save_in_background(write, converted)
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
_known_lock = threading.Lock()  # rank 0's writer thread prunes while the next save starts


def _known_steps(location: Location, group: Group) -> _KnownSteps:
    known = _known.get(location.root)
    if known is None:
        known = _KnownSteps(group.decide(location.steps))
        _known[location.root] = known
    return known


@dataclass
class Write:
    """One save's writing and commit, in the foreground or in the writer thread."""

    location: Location
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

    def __call__(self, state: Mapping[str, Any] | None, process_group: Any = None) -> None:
        """Write ``state`` (rank 0 all of it when alone, else every rank its part; other
        ranks' ``state`` is then unused) and commit it; every rank returns once the step is
        committed, or raises if any rank failed to write its part."""
        import torch.distributed.checkpoint as dcp

        if self.alone:
            self._write_alone(state, process_group)
        else:
            dcp.save(
                state, storage_writer=self.location.writer(self.name), process_group=process_group
            )
        if self.group.rank == 0:
            self._commit()
        self.group.barrier(process_group)

    def _write_alone(self, state: Mapping[str, Any] | None, process_group: Any) -> None:
        """Rank 0 writes; then every rank learns whether it did (which is also every rank's
        sign that it reached this save: a rank gone before it leaves the step uncommitted)."""
        import torch.distributed.checkpoint as dcp

        failure: Exception | None = None
        if self.group.rank == 0:
            try:
                if self.compact:
                    assert state is not None
                    self.location.write_state(plain_state_dict(state), self.name)
                else:
                    dcp.save(state, storage_writer=self.location.writer(self.name), no_dist=True)
            except Exception as exc:
                failure = exc
        if self.group.world > 1:
            import torch.distributed as dist

            outcomes: list[Any] = [None] * self.group.world
            described = None if failure is None else describe(failure)
            dist.all_gather_object(outcomes, described, group=process_group)
            if failure is None and outcomes[0] is not None:
                raise RuntimeError(f"rank 0 could not write it: {outcomes[0]}")
        if failure is not None:
            raise failure

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
        location.write_file(json.dumps(marker).encode(), self.name, COMMIT_MARKER)
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
