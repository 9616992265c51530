"""Loading: :func:`latest_step` and :func:`load_latest` (resume from the newest committed
step, DCP's files or a state file; else warm start, else fresh)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from sparktorch_ops.checkpoint import reports
from sparktorch_ops.checkpoint.group import Group, announce
from sparktorch_ops.checkpoint.saving import wait
from sparktorch_ops.checkpoint.state import (
    ModuleState,
    OptimizerState,
    TrainingState,
    copy_back,
    to_dcp,
)
from sparktorch_ops.checkpoint.storage import (
    STATE_FILE,
    Storage,
    dcp_reader,
    location_of,
    newest,
    step_dir_name,
)
from sparktorch_ops.checkpoint.warm_start import warm_start
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.wire.env import WARM_START_ENV


def latest_step(*, directory: str | None = None) -> int | None:
    """The newest committed step under the checkpoint directory, None when there is none.

    Reads the directory only (no collective): callable from any rank or from the driver.

    Args:
        directory: the checkpoint directory (default: :func:`checkpoint_dir`).

    Raises:
        ConfigError: no directory given and ``SPARKTORCH_CHECKPOINT_DIR`` is unset.
    """
    return newest(location_of(directory))


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
        log: where rank 0's line goes (INFO); default: the driver's log in a run, else the
            process's stderr.

    Returns:
        The step loaded, None when nothing was resumed (a warm start included).

    Raises:
        ConfigError: no directory is set, the state is invalid, ``WORLD_SIZE`` > 1 without an
            initialized process group, or the warm start source is unusable.
        CheckpointError: a save written in the background failed.
    """
    import torch.distributed.checkpoint as dcp

    wait()
    location = location_of(directory)
    converted = to_dcp(state)
    group = Group()
    step, compact = group.decide(lambda: _newest(location))
    if step is not None:
        name = step_dir_name(step)
        if compact:
            _load_state_file(location, (name, STATE_FILE), converted)
        else:
            with group.quiet():
                reader = dcp_reader(location, name)
                dcp.load(converted, storage_reader=reader, no_dist=group.no_dist)
        copy_back(state, converted)
        if group.rank == 0:
            announce(f"resumed from step {step} at {location.url(name)}", log)
            reports.replay(location, name, log)
        return step
    source = os.environ.get(WARM_START_ENV, "").strip()
    if source:
        warm_start(state, source, log=log)
        return None
    if group.rank == 0:
        announce(f"no checkpoint under {location.root}: starting fresh", log)
    return None


def _newest(location: Storage) -> tuple[int | None, bool]:
    """The newest committed step, and whether it is a state file (else DCP's files)."""
    step = newest(location)
    return step, step is not None and location.is_file(step_dir_name(step), STATE_FILE)


def _load_state_file(
    location: Storage, names: tuple[str, ...], converted: MutableMapping[str, Any]
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
        if isinstance(value, ModuleState | OptimizerState):
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
