"""Warm start: a new training's modules loaded from another run's checkpoint or a
``torch.save``'d state dict (weights only, those matching by name and shape)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sparktorch_ops.checkpoint.group import Group, announce
from sparktorch_ops.checkpoint.state import TrainingState, state_modules, to_dcp
from sparktorch_ops.checkpoint.storage import (
    DCP_METADATA,
    STATE_FILE,
    Storage,
    dcp_reader,
    step_dir_name,
    steps,
)
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.wire.env import WARM_START_ENV

if TYPE_CHECKING:
    import torch


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
        log: where rank 0's line goes (INFO); default: the driver's log in a run, else the
            process's stderr.

    Returns:
        What was loaded: the step directory or the file.

    Raises:
        ConfigError: the source does not exist, holds no checkpoint, or no weight matches.
    """
    converted = to_dcp(state)
    modules = state_modules(converted)
    if not modules:
        raise ConfigError("state", "has no torch.nn.Module to warm-start")
    group = Group()
    location = Storage(source)

    def resolve() -> tuple[tuple[str, ...], tuple[str, ...] | None]:
        """The checkpoint's names under the source, and those of its state file (None: DCP)."""
        if location.is_file():
            return (), ()
        if location.is_file(STATE_FILE):
            return (), (STATE_FILE,)
        if location.is_file(DCP_METADATA):
            return (), None
        if location.is_dir():
            committed = [s for s, done in steps(location).items() if done]
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
        announce(f"warm-started from {where} ({loaded} of {total} tensors)", log)
    return where


def _warm_from_dcp(
    location: Storage,
    names: tuple[str, ...],
    modules: Mapping[str, torch.nn.Module],
    group: Group,
) -> tuple[int, int]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    saved = dcp_reader(location, *names).read_metadata().state_dict_metadata
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
            dcp.load(wanted, storage_reader=dcp_reader(location, *names), no_dist=group.no_dist)
        for key, weights in wanted.items():
            set_model_state_dict(modules[key], weights, options=StateDictOptions(strict=False))
    return loaded, total


def _warm_from_file(
    location: Storage, names: tuple[str, ...], modules: Mapping[str, torch.nn.Module]
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
