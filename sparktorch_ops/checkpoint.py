"""Checkpoints on the ranks: save, resume and warm start with ``torch.distributed.checkpoint``.

Every rank of a run sees ``SPARKTORCH_CHECKPOINT_DIR`` (:data:`CHECKPOINT_DIR_ENV`), a local
path or an fsspec URL (``file:///x``, ``s3://bucket/x``, ``memory://x``) that every rank can
reach (a shared file system or an object store; a plain local path only serves a single node).
Inside the training function::

    state = TrainingState(model, optimizer, epoch=0)   # or {"model": model, "optim": optimizer}
    start = load_latest(state)                         # resume (or warm start); None: fresh
    for step in range(0 if start is None else start + 1, steps):
        ...
        save(state, step)                              # every rank calls it

The layout under the directory, one checkpoint per step::

    <dir>/step-000000002/.metadata         DCP's metadata, written by rank 0 last
    <dir>/step-000000002/__0_0.distcp      rank 0's data: its shards and its share of the
    <dir>/step-000000002/__1_0.distcp      replicated values, one file per rank
    <dir>/step-000000002/reports.json      rank 0's report() records up to this step
    <dir>/step-000000002/COMMITTED         {"step": 2, "world_size": 2, "time": ..., "torch": ...}

A replicated state of at most 32 MiB (as under DDP) is one file instead of DCP's::

    <dir>/step-000000002/state.pt          torch.save of the state dict, by rank 0 alone

Guarantees:

* **A step directory counts only with its ``COMMITTED`` marker**, which rank 0 writes after
  every rank's data and DCP's metadata were written (DCP's save ends with a collective that
  waits for all ranks). A replicated state (no ``DTensor``, ``ShardedTensor`` or FSDP1 module;
  every rank holds it whole, as under DDP) of at most 32 MiB is written by rank 0 alone,
  with one ``torch.save`` and without DCP's collectives or planning: for a small state these
  cost more than the write; the marker still waits for every rank to have reached the save,
  and loading it into a sharded model (FSDP) shards it as a full state dict. A run killed in
  the middle of a save leaves a step directory without the marker: :func:`load_latest` and
  :func:`latest_step` skip it, and it is deleted by the next save of the same step or by
  pruning once a newer checkpoint is committed.
* :func:`save` returns on every rank only after the marker was written and old checkpoints
  pruned (the newest ``keep`` committed ones stay; other files under the directory are never
  touched). A step is written once: saving a committed step again, or one this process saved
  already, raises :class:`~sparktorch_ops.errors.ConfigError`.
* ``save(state, step, blocking=False)`` returns once the state is copied (to CPU memory) and
  writes, commits and prunes in a background thread while training goes on, with the same
  guarantees: its collectives run on a process group of their own (gloo), so they never
  interleave with the training's. The thread runs at the OS's idle priority (Linux's
  ``SCHED_IDLE``): it takes the CPU that training leaves. For a state rank 0 writes alone, the
  other ranks copy nothing; their thread only joins the two small collectives of the commit.
  At most one save is in flight per rank: the next :func:`save`, :func:`load_latest`,
  :func:`wait`, ``torch.distributed.destroy_process_group`` and the end of the training
  function first wait for it. A background failure is raised there as
  :class:`~sparktorch_ops.errors.CheckpointError` (naming the rank and the step), so it fails
  the run; it is also written to the rank's stderr when it happens. A rank killed while a save
  is in flight leaves that step uncommitted: a restart resumes the one before.
* Checkpoints reshard: each rank writes only its own shards (FSDP2 ``DTensor``\\ s) and the
  metadata records global shapes, so a checkpoint written by N ranks loads on M ranks, or in
  one plain process.
* Decisions (which step to resume, whether a step is already committed) are taken by rank 0
  and broadcast, so every rank does the same thing even on an eventually consistent store.
  A process lists a directory at its first save there; its later saves keep that listing up
  to date instead of listing again (one training writes a directory).
* **No metric lost to a crash**: a checkpoint carries rank 0's ``report()`` records up to its
  step (``reports.json``), and a resume sends them again, marked as replayed: the driver logs
  to MLflow those steps its run lacks (the orchestrator's process may have died before it
  sent them). Steps trained again after the resumed checkpoint are reported again.

State: a :class:`TrainingState` or a dict. In a dict, ``torch.nn.Module`` values are saved
through ``get_model_state_dict`` (no DDP ``module.`` prefix, sharded FSDP2 state) and
``torch.optim.Optimizer`` values through ``get_optimizer_state_dict``, paired with the module
of the dict whose parameters they hold; tensors are loaded in place, and other values (ints,
floats, strings, nested dicts of those) are replaced in the dict by their saved values.
Modules and optimizers must be top-level values. Every rank must pass the same keys, and
values other than sharded ones are taken to be the same on every rank (DCP writes one copy of
each, spread over the ranks): a value that differs by rank comes back as one rank's value.
Random number generator states are saved only when put in the state.

Without a process group (one plain process) save and load run in that process alone; with
``WORLD_SIZE`` > 1 they need ``torch.distributed.init_process_group`` first.

Only the standard library is imported here at import time; torch and fsspec when used.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import datetime
import itertools
import json
import logging
import os
import queue
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from sparktorch_ops.errors import CheckpointError, ConfigError
from sparktorch_ops.rank import reporting
from sparktorch_ops.wire.env import CHECKPOINT_DIR_ENV, WARM_START_ENV

if TYPE_CHECKING:
    import torch
    from fsspec import AbstractFileSystem
    from torch.distributed.checkpoint import StorageReader, StorageWriter

__all__ = [
    "CHECKPOINT_DIR_ENV",
    "COMMIT_MARKER",
    "WARM_START_ENV",
    "TrainingState",
    "checkpoint_dir",
    "latest_step",
    "load_latest",
    "save",
    "step_dir_name",
    "wait",
    "warm_start",
]

COMMIT_MARKER = "COMMITTED"
"""The file that makes a step directory a checkpoint; written last, by rank 0."""
REPORTS_FILE = "reports.json"
"""Rank 0's ``report()`` records of the last five minutes (``reporting.CARRY_S``), written
before the marker; :func:`load_latest` sends them again on a resume, so a committed
checkpoint implies its steps' metrics reach MLflow even if the driver died first."""
STATE_FILE = "state.pt"
"""A small replicated state, written whole by rank 0 with one ``torch.save`` (in place of
DCP's files): ``{key: state dict or value}``, as :meth:`TrainingState.state_dict` gives it."""

_STEP_RE = re.compile(r"^step-(\d+)$")
_DCP_METADATA = ".metadata"
_MODEL_KEY = "model"
_OPTIM_KEY = "optim"
_T = TypeVar("_T")


def step_dir_name(step: int) -> str:
    """The name of ``step``'s directory: ``step-`` and the step, zero-padded to 9 digits."""
    return f"step-{step:09d}"


def checkpoint_dir() -> str | None:
    """The run's checkpoint directory: ``SPARKTORCH_CHECKPOINT_DIR``, None when unset or empty."""
    value = os.environ.get(CHECKPOINT_DIR_ENV, "").strip()
    return value or None


# -- where checkpoints live: a local directory or an fsspec URL --------------------------------
class _Location:
    """A directory given as a local path or an fsspec URL, with the few operations we need."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.is_url = "://" in root
        self._fs: AbstractFileSystem | None = None
        self._fs_root = root
        if self.is_url:
            from fsspec.core import url_to_fs

            self._fs, self._fs_root = url_to_fs(root)

    @property
    def fs(self) -> AbstractFileSystem:
        assert self._fs is not None
        return self._fs

    def url(self, *names: str) -> str:
        """The user-facing path (or URL) of a name under the root."""
        if not names:
            return self.root
        if self.is_url:
            return "/".join([self.root.rstrip("/"), *names])
        return os.path.join(self.root, *names)

    def _path(self, *names: str) -> str:
        if self.is_url:
            return "/".join([self._fs_root.rstrip("/"), *names]) if names else self._fs_root
        return os.path.join(self.root, *names)

    def is_file(self, *names: str) -> bool:
        if self.is_url:
            return bool(self.fs.isfile(self._path(*names)))
        return os.path.isfile(self._path(*names))

    def is_dir(self, *names: str) -> bool:
        if self.is_url:
            return bool(self.fs.isdir(self._path(*names)))
        return os.path.isdir(self._path(*names))

    def exists(self, *names: str) -> bool:
        if self.is_url:
            return bool(self.fs.exists(self._path(*names)))
        return os.path.exists(self._path(*names))

    def names(self) -> list[str]:
        """The entries directly under the root (none when it does not exist)."""
        if self.is_url:
            self.fs.invalidate_cache(self._fs_root)
            try:
                entries = self.fs.ls(self._fs_root, detail=False)
            except FileNotFoundError:
                return []
            return [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries]
        try:
            return os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def steps(self) -> dict[int, bool]:
        """Every step directory under the root: step -> whether it is committed."""
        found: dict[int, bool] = {}
        for name in self.names():
            match = _STEP_RE.match(name)
            if match:
                found[int(match.group(1))] = self.is_file(name, COMMIT_MARKER)
        return found

    def write_file(self, data: bytes, *names: str) -> None:
        """Write a small file whole: a reader sees it complete or not at all."""
        path = self._path(*names)
        if self.is_url:
            self.fs.pipe_file(path, data)
            return
        temporary = f"{path}.tmp-{os.getpid()}"
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)

    def write_state(self, state: Mapping[str, Any], name: str) -> None:
        """Write a state dict with one ``torch.save`` as ``<name>/state.pt``, synced to storage
        (the step is uncommitted until its marker follows, so no temporary name is needed)."""
        import torch

        path = self._path(name, STATE_FILE)
        if self.is_url:
            self.fs.makedirs(self._path(name), exist_ok=True)
            with self.fs.open(path, "wb") as handle:
                torch.save(state, handle)
            return
        os.makedirs(self._path(name), exist_ok=True)
        with open(path, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())

    def open(self, *names: str) -> Any:
        if self.is_url:
            return self.fs.open(self._path(*names), "rb")
        return open(self._path(*names), "rb")

    def remove_tree(self, *names: str) -> None:
        path = self._path(*names)
        if self.is_url:
            self.fs.rm(path, recursive=True)
        else:
            shutil.rmtree(path)

    def writer(self, *names: str) -> StorageWriter:
        if self.is_url:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(self.url(*names))
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(self._path(*names))

    def reader(self, *names: str) -> StorageReader:
        if self.is_url:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            return FsspecReader(self.url(*names))
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(self._path(*names))


def _location(directory: str | None) -> _Location:
    root = directory if directory is not None else checkpoint_dir()
    if root is not None and not isinstance(root, str | os.PathLike):
        raise ConfigError("directory", f"must be a path or an fsspec URL, got {root!r}")
    root = os.fspath(root).strip() if root is not None else None
    if not root:
        raise ConfigError(
            "checkpoint_dir",
            f"no checkpoint directory: set checkpoint_dir= on TorchDistributor (every rank then "
            f"sees {CHECKPOINT_DIR_ENV}) or pass directory=",
        )
    return _Location(root)


# -- the process group -------------------------------------------------------------------------
class _Group:
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


def _announce(text: str, log: logging.Logger | None) -> None:
    # The rank's stderr reaches the driver's log (at WARNING); a given logger gets it at INFO.
    if log is not None:
        log.info(text)
    else:
        sys.stderr.write(f"sparktorch_ops.checkpoint: {text}\n")
        sys.stderr.flush()


# -- state: modules and optimizers as DCP Stateful objects --------------------------------------
class _ModuleState:
    """A module as DCP ``Stateful``: its ``get_model_state_dict`` (no DDP prefix, sharded)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, state_dict)

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an unsharded state dict (a :data:`STATE_FILE`'s), sharding it if need be."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, state_dict, options=_full_options(self.module))


class _OptimizerState:
    """An optimizer as DCP ``Stateful``, its state keyed by its module's parameter names."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module = module
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, state_dict)

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an unsharded state dict (a :data:`STATE_FILE`'s), sharding it if need be."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        options = _full_options(self.module)
        set_optimizer_state_dict(self.module, self.optimizer, state_dict, options=options)


def _full_options(module: torch.nn.Module) -> Any:
    """State-dict options for loading an unsharded state dict into ``module``: as the full
    state dict of a sharded one (DTensor parameters), as is into any other."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=_sharded(module))


def _sharded(module: torch.nn.Module) -> bool:
    """Whether ``module``'s state differs by rank: a ``DTensor`` or ``ShardedTensor`` in it, or
    an FSDP1 module."""
    sharded = _sharded_types()
    held = itertools.chain(module.parameters(), module.buffers())
    return any(isinstance(t, sharded) for t in held) or any(
        isinstance(m, sharded) for m in module.modules()
    )


class TrainingState:
    """A model, its optimizer and extra values, saved and loaded together.

    Equivalent to the dict ``{"model": model, "optim": optimizer, **extra}`` (without
    ``"optim"`` when there is no optimizer): checkpoints written from one load into the other.
    It also implements DCP's ``Stateful`` protocol, so it can be given to
    ``torch.distributed.checkpoint.save``/``load`` directly.

    Args:
        model: the model, plain, DDP-wrapped or sharded with FSDP2's ``fully_shard``.
        optimizer: its optimizer, or None.
        **extra: other values to checkpoint: tensors (loaded in place), ints, floats,
            strings, nested dicts of those, more modules or optimizers. After a load,
            ``extra`` holds the saved values.

    Attributes:
        model: the model.
        optimizer: the optimizer or None.
        extra: the extra values.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **extra: Any
    ) -> None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise ConfigError("model", f"must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                "optimizer", f"must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        for key in (_MODEL_KEY, _OPTIM_KEY):
            if key in extra:
                raise ConfigError(key, "is reserved for the model and its optimizer")
        self.model = model
        self.optimizer = optimizer
        self.extra: dict[str, Any] = dict(extra)

    def as_dict(self) -> dict[str, Any]:
        """The equivalent plain dict (``model``, ``optim`` when set, then the extra values)."""
        entries: dict[str, Any] = {_MODEL_KEY: self.model}
        if self.optimizer is not None:
            entries[_OPTIM_KEY] = self.optimizer
        entries.update(self.extra)
        return entries

    def state_dict(self) -> dict[str, Any]:
        """The state as DCP saves it: model and optimizer state dicts, then the extra values."""
        return _plain_state_dict(_to_dcp(self))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (from DCP) into the model, the optimizer and ``extra``."""
        converted = _to_dcp(self)
        for key in sorted(converted):
            value = converted[key]
            if isinstance(value, _ModuleState | _OptimizerState):
                value.load_state_dict(state_dict[key])
            elif key in state_dict:
                self.extra[key] = state_dict[key]


def _check_nested(value: Any, where: str) -> None:
    import torch

    if isinstance(value, torch.nn.Module | torch.optim.Optimizer):
        raise ConfigError(
            "state",
            f"{where} is a {type(value).__name__}: modules and optimizers must be "
            "top-level values of the state",
        )
    if isinstance(value, Mapping):
        for key, inner in value.items():
            _check_nested(inner, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for index, inner in enumerate(value):
            _check_nested(inner, f"{where}[{index}]")


def _to_dcp(state: TrainingState | Mapping[str, Any]) -> dict[str, Any]:
    """The dict DCP saves and loads: modules and optimizers wrapped as ``Stateful``."""
    import torch

    entries = state.as_dict() if isinstance(state, TrainingState) else state
    if not isinstance(entries, Mapping) or not entries:
        raise ConfigError(
            "state", f"must be a TrainingState or a non-empty dict, got {type(state).__name__}"
        )
    modules = {k: v for k, v in entries.items() if isinstance(v, torch.nn.Module)}
    converted: dict[str, Any] = {}
    for key, value in entries.items():
        if not isinstance(key, str) or not key or "." in key:
            raise ConfigError("state", f"keys must be non-empty str without '.', got {key!r}")
        if isinstance(value, torch.nn.Module):
            converted[key] = _ModuleState(value)
        elif isinstance(value, torch.optim.Optimizer):
            converted[key] = _OptimizerState(_owner(key, value, modules), value)
        else:
            _check_nested(value, key)
            converted[key] = value
    return converted


def _owner(
    key: str, optimizer: torch.optim.Optimizer, modules: Mapping[str, torch.nn.Module]
) -> torch.nn.Module:
    """The module of the state whose parameters ``optimizer`` holds."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = [m for m in modules.values() if held & {id(p) for p in m.parameters()}]
    if len(owners) == 1:
        return owners[0]
    problem = "no module" if not owners else "more than one module"
    raise ConfigError(
        "state",
        f"the optimizer under {key!r} holds parameters of {problem} of the state; "
        "put its model next to it (TrainingState(model, optimizer) or {'model': m, 'optim': o})",
    )


def _plain_state_dict(converted: Mapping[str, Any]) -> dict[str, Any]:
    """What DCP writes for ``converted``: modules and optimizers as their state dicts."""
    return {
        key: value.state_dict() if isinstance(value, _ModuleState | _OptimizerState) else value
        for key, value in converted.items()
    }


def _copy_back(state: TrainingState | Mapping[str, Any], converted: Mapping[str, Any]) -> None:
    """Put loaded plain values (DCP replaces them in ``converted``) back into ``state``."""
    for key, value in converted.items():
        if isinstance(value, _ModuleState | _OptimizerState):
            continue
        if isinstance(state, TrainingState):
            state.extra[key] = value
        elif isinstance(state, MutableMapping):
            state[key] = value


def _state_modules(converted: Mapping[str, Any]) -> dict[str, torch.nn.Module]:
    return {k: v.module for k, v in converted.items() if isinstance(v, _ModuleState)}


# -- public API ------------------------------------------------------------------------------
def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a non-negative int" if minimum == 0 else f"an int >= {minimum}"
        raise ConfigError(name, f"must be {kind}, got {value!r}")
    return value


def latest_step(*, directory: str | None = None) -> int | None:
    """The newest committed step under the checkpoint directory, None when there is none.

    Reads the directory only (no collective): callable from any rank or from the driver.

    Args:
        directory: the checkpoint directory (default: :func:`checkpoint_dir`).

    Raises:
        ConfigError: no directory given and ``SPARKTORCH_CHECKPOINT_DIR`` is unset.
    """
    steps = _location(directory).steps()
    committed = [step for step, done in steps.items() if done]
    return max(committed) if committed else None


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
    location = _location(directory)
    converted = _to_dcp(state)
    group = _Group()
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
    write = _Write(location, step, keep, group, known, alone, compact)
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

    sharded = _sharded_types()
    total = 0
    modules: list[torch.nn.Module] = []
    for value in converted.values():
        found: Iterator[Any]
        if isinstance(value, _ModuleState):
            modules.append(value.module)
            found = itertools.chain(value.module.parameters(), value.module.buffers())
        elif isinstance(value, _OptimizerState):
            found = tensors(list(value.optimizer.state.values()))
        else:
            found = tensors(value)
        for tensor in found:
            total += tensor.numel() * tensor.element_size()
            if total > _ALONE_MAX_BYTES or isinstance(tensor, sharded):
                return False
    return not any(_sharded(module) for module in modules)


def _sharded_types() -> tuple[type, ...]:
    """The tensor and module types whose value differs by rank."""
    import torch.distributed as dist

    if not dist.is_available():
        return ()
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    return (DTensor, ShardedTensor, FullyShardedDataParallel)


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


def _known_steps(location: _Location, group: _Group) -> _KnownSteps:
    known = _known.get(location.root)
    if known is None:
        known = _KnownSteps(group.decide(location.steps))
        _known[location.root] = known
    return known


@dataclass
class _Write:
    """One save's writing and commit, in the foreground or in the writer thread."""

    location: _Location
    step: int
    keep: int
    group: _Group
    known: _KnownSteps
    alone: bool
    compact: bool

    def __post_init__(self) -> None:
        self.name = step_dir_name(self.step)
        self.url = self.location.url(self.name)
        # Rank 0's reports up to this step go with it: a resume replays what MLflow may lack.
        self.reports = reporting.records_for_checkpoint() if self.group.rank == 0 else []

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
                    self.location.write_state(_plain_state_dict(state), self.name)
                else:
                    dcp.save(state, storage_writer=self.location.writer(self.name), no_dist=True)
            except Exception as exc:
                failure = exc
        if self.group.world > 1:
            import torch.distributed as dist

            outcomes: list[Any] = [None] * self.group.world
            described = None if failure is None else _describe(failure)
            dist.all_gather_object(outcomes, described, group=process_group)
            if failure is None and outcomes[0] is not None:
                raise RuntimeError(f"rank 0 could not write it: {outcomes[0]}")
        if failure is not None:
            raise failure

    def _commit(self) -> None:
        """Rank 0: the reports, the marker, then pruning."""
        location = self.location
        if self.reports:
            location.write_file(json.dumps(self.reports).encode(), self.name, REPORTS_FILE)
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
                _announce(f"could not delete {location.url(step_dir_name(step))}: {exc}", None)
                continue
            with _known_lock:
                present.pop(step, None)


# -- saves in the background ---------------------------------------------------------------------
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


def _save_in_background(write: _Write, converted: Mapping[str, Any]) -> None:
    """Copy the state now; the writer thread writes and commits it."""
    group = write.group
    process_group = _background_group(group)
    staged = None
    if group.rank == 0 or not write.alone:
        staged = _copied(_plain_state_dict(converted), sharded=not write.alone)
    if write.alone and group.rank == 0:
        # See _Group.quiet; from a thread, catch_warnings races.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
    pending = _BackgroundSave(group.rank, write.step, write.url)

    def job() -> None:
        try:
            write(staged, process_group)
        except BaseException as exc:
            pending.error = CheckpointError(pending.rank, write.step, write.url, _describe(exc))
            pending.error.__cause__ = exc
            _announce(f"{pending.error}; the run fails at the next save, wait() or its end", None)
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


def _describe(exc: BaseException) -> str:
    """One line per failure: DCP's CheckpointException holds every rank's error, traceback
    included, in its text."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(
            f"{type(error).__name__}: {error} (on rank {rank})"
            for rank, (error, _trace) in sorted(failures.items())
        )
    return f"{type(exc).__name__}: {exc}"


def _background_group(group: _Group) -> Any:
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


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def load_latest(
    state: TrainingState | Mapping[str, Any],
    *,
    directory: str | None = None,
    log: logging.Logger | None = None,
) -> int | None:
    """Load the newest committed checkpoint into ``state`` in place; every rank must call it.

    When there is none and ``SPARKTORCH_WARM_START_FROM`` is set, warm-starts the state's
    modules from it (see :func:`warm_start`). Resuming wins over warm starting. Rank 0 says
    what it did in one line: ``resumed from step N at <path>``, ``warm-started from <path>``
    or ``no checkpoint under <dir>: starting fresh``.

    The checkpoint may have been written by another number of ranks (DCP reshards).

    Args:
        state: a :class:`TrainingState` or a dict (see the module docstring).
        directory: the checkpoint directory (default: :func:`checkpoint_dir`).
        log: where rank 0's line goes (INFO); default: the rank's stderr.

    Returns:
        The step loaded, None when nothing was resumed (a warm start included).

    Raises:
        ConfigError: no directory is set, the state is invalid, ``WORLD_SIZE`` > 1 without an
            initialized process group, or the warm start source is unusable.
        CheckpointError: a save written in the background failed.
    """
    import torch.distributed.checkpoint as dcp

    wait()
    location = _location(directory)
    converted = _to_dcp(state)
    group = _Group()
    step, compact = group.decide(lambda: _newest(location))
    if step is not None:
        name = step_dir_name(step)
        if compact:
            _load_state_file(location, (name, STATE_FILE), converted)
        else:
            with group.quiet():
                dcp.load(converted, storage_reader=location.reader(name), no_dist=group.no_dist)
        _copy_back(state, converted)
        if group.rank == 0:
            _announce(f"resumed from step {step} at {location.url(name)}", log)
            _replay_reports(location, name, log)
        return step
    source = os.environ.get(WARM_START_ENV, "").strip()
    if source:
        warm_start(state, source, log=log)
        return None
    if group.rank == 0:
        _announce(f"no checkpoint under {location.root}: starting fresh", log)
    return None


def _newest(location: _Location) -> tuple[int | None, bool]:
    """The newest committed step, and whether it is a state file (else DCP's files)."""
    step = latest_step(directory=location.root)
    return step, step is not None and location.is_file(step_dir_name(step), STATE_FILE)


def _load_state_file(
    location: _Location, names: tuple[str, ...], converted: MutableMapping[str, Any]
) -> None:
    """Load a :data:`STATE_FILE` into ``converted`` as ``dcp.load`` would: modules and
    optimizers through their state-dict API (into sharded ones too), tensors in place, other
    values replaced; every key of the state must be in the file."""
    import torch

    with location.open(*names) as handle:
        saved = torch.load(handle, map_location="cpu", weights_only=False)
    missing = [key for key in converted if key not in saved]
    if missing:
        raise ConfigError(
            "state",
            f"has {', '.join(map(repr, missing))}, which {location.url(*names)} lacks: load a "
            "checkpoint saved from the same keys",
        )
    for key, value in converted.items():
        if isinstance(value, _ModuleState | _OptimizerState):
            value.load_full_state_dict(saved[key])
        else:
            converted[key] = _assign(value, saved[key])


def _assign(current: Any, saved: Any) -> Any:
    """``saved`` in place of ``current``: a tensor of the same shape is copied into, a dict's
    keys are assigned one by one (those the state has), anything else is replaced."""
    import torch

    if isinstance(current, torch.Tensor) and isinstance(saved, torch.Tensor):
        if current.shape == saved.shape:
            with torch.no_grad():
                current.copy_(saved)
            return current
    elif isinstance(current, MutableMapping) and isinstance(saved, Mapping):
        for key in list(current):
            if key in saved:
                current[key] = _assign(current[key], saved[key])
        return current
    return saved


def _replay_reports(location: _Location, name: str, log: logging.Logger | None) -> None:
    """Send the reports a checkpoint carries again (rank 0, on resume)."""
    if not location.is_file(name, REPORTS_FILE):
        return
    try:
        with location.open(name, REPORTS_FILE) as handle:
            records = json.loads(handle.read())
    except (OSError, ValueError) as exc:
        _announce(f"the reports saved with {location.url(name)} cannot be read: {exc}", log)
        return
    if isinstance(records, list):
        reporting.replay(record for record in records if isinstance(record, dict))


def warm_start(
    state: TrainingState | Mapping[str, Any], source: str, *, log: logging.Logger | None = None
) -> str:
    """Load model weights from ``source`` into the modules of ``state``; every rank calls it.

    Only weights are loaded (not optimizers nor extra values), and only those present in
    both the source and the model with the same shape, so a model with a new head starts from
    the rest. :func:`load_latest` calls it when there is nothing to resume.

    Args:
        state: a :class:`TrainingState` or a dict (see the module docstring).
        source: a path or fsspec URL: a checkpoint directory (a root of ``step-*``
            checkpoints: its newest committed one; or one step directory, or any DCP
            checkpoint), or a file written by ``torch.save(model.state_dict())`` (with one
            module in the state; with several, a dict of their state dicts by state key).
        log: where rank 0's line goes (INFO); default: the rank's stderr.

    Returns:
        What was loaded: the step directory or the file.

    Raises:
        ConfigError: the source does not exist, holds no checkpoint, or no weight matches.
    """
    converted = _to_dcp(state)
    modules = _state_modules(converted)
    if not modules:
        raise ConfigError("state", "has no torch.nn.Module to warm-start")
    group = _Group()
    location = _Location(source)

    def resolve() -> tuple[tuple[str, ...], tuple[str, ...] | None]:
        """The checkpoint's names under the source, and those of its state file (None: DCP)."""
        if location.is_file():
            return (), ()
        if location.is_file(STATE_FILE):
            return (), (STATE_FILE,)
        if location.is_file(_DCP_METADATA):
            return (), None
        if location.is_dir():
            steps = location.steps()
            committed = [s for s, done in steps.items() if done]
            if committed:
                name = step_dir_name(max(committed))
                return (name,), (name, STATE_FILE) if location.is_file(name, STATE_FILE) else None
            raise ConfigError(WARM_START_ENV, f"{source} holds no committed checkpoint")
        raise ConfigError(WARM_START_ENV, f"{source} does not exist")

    names, state_file = group.decide(resolve)
    if state_file is not None:
        loaded, total = _warm_from_file(location, state_file, modules)
    else:
        loaded, total = _warm_from_dcp(location, names, modules, group)
    where = location.url(*names)
    if loaded == 0:
        raise ConfigError(
            WARM_START_ENV, f"no weight of {where} matches the model (same name and shape)"
        )
    if group.rank == 0:
        _announce(f"warm-started from {where} ({loaded} of {total} tensors)", log)
    return where


def _warm_from_dcp(
    location: _Location,
    names: tuple[str, ...],
    modules: Mapping[str, torch.nn.Module],
    group: _Group,
) -> tuple[int, int]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    saved = location.reader(*names).read_metadata().state_dict_metadata
    wanted: dict[str, dict[str, Any]] = {}
    loaded = total = 0
    for key, module in modules.items():
        current = get_model_state_dict(module)
        total += len(current)
        wanted[key] = {}
        for fqn, value in current.items():
            meta = saved.get(f"{key}.{fqn}")
            if (
                isinstance(value, torch.Tensor)
                and isinstance(meta, TensorStorageMetadata)
                and tuple(meta.size) == tuple(value.shape)
            ):
                wanted[key][fqn] = value
        loaded += len(wanted[key])
    wanted = {key: weights for key, weights in wanted.items() if weights}
    if wanted:
        with group.quiet():
            dcp.load(wanted, storage_reader=location.reader(*names), no_dist=group.no_dist)
        for key, weights in wanted.items():
            set_model_state_dict(modules[key], weights, options=StateDictOptions(strict=False))
    return loaded, total


def _warm_from_file(
    location: _Location, names: tuple[str, ...], modules: Mapping[str, torch.nn.Module]
) -> tuple[int, int]:
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.tensor import DTensor

    # A user's file is read as weights only; a checkpoint's state file may hold any extra value.
    with location.open(*names) as handle:
        saved = torch.load(handle, map_location="cpu", weights_only=not names)
    if not isinstance(saved, Mapping):
        raise ConfigError(WARM_START_ENV, f"{location.url(*names)} does not hold a state dict")
    per_module: dict[str, Mapping[str, Any]] = {}
    for key in modules:
        nested = saved.get(key)
        if isinstance(nested, Mapping) and any(
            isinstance(v, torch.Tensor) for v in nested.values()
        ):
            per_module[key] = nested
    if not per_module:
        if len(modules) > 1:
            raise ConfigError(
                WARM_START_ENV,
                f"{location.url(*names)} holds one state dict but the state has {len(modules)} "
                "modules; save a dict of state dicts by state key",
            )
        per_module[next(iter(modules))] = saved
    loaded = total = 0
    for key, module in modules.items():
        current: dict[str, Any] = dict(get_model_state_dict(module))
        total += len(current)
        weights = _strip_prefix(per_module.get(key, {}), current)
        matching: dict[str, Any] = {
            fqn: value
            for fqn, value in weights.items()
            if isinstance(value, torch.Tensor)
            and fqn in current
            and tuple(value.shape) == tuple(current[fqn].shape)
        }
        if not matching:
            continue
        sharded = any(isinstance(v, DTensor) for v in current.values())
        options = StateDictOptions(full_state_dict=sharded, strict=False)
        set_model_state_dict(module, matching, options=options)
        loaded += len(matching)
    return loaded, total


def _strip_prefix(weights: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """Drop a ``module.`` (DDP) or ``_orig_mod.`` (torch.compile) prefix the model lacks."""
    result = dict(weights)
    for prefix in ("module.", "_orig_mod."):
        if (
            result
            and all(k.startswith(prefix) for k in result)
            and not any(k.startswith(prefix) for k in current)
        ):
            result = {k[len(prefix) :]: v for k, v in result.items()}
    return result
