"""What is saved: :class:`TrainingState` or a dict, converted for DCP (modules and optimizers
as DCP ``Stateful`` objects) and back, and whether a state differs by rank."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from sparktorch_ops.errors import ConfigError

if TYPE_CHECKING:
    import torch

_MODEL_KEY = "model"
_OPTIM_KEY = "optim"


class ModuleState:
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


class OptimizerState:
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

    return StateDictOptions(full_state_dict=sharded(module))


def sharded(module: torch.nn.Module) -> bool:
    """Whether ``module``'s state differs by rank: a ``DTensor`` or ``ShardedTensor`` in it, or
    an FSDP1 module."""
    types = sharded_types()
    held = itertools.chain(module.parameters(), module.buffers())
    return any(isinstance(t, types) for t in held) or any(
        isinstance(m, types) for m in module.modules()
    )


def sharded_types() -> tuple[type, ...]:
    """The tensor and module types whose value differs by rank."""
    import torch.distributed as dist

    if not dist.is_available():
        return ()
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    return (DTensor, ShardedTensor, FullyShardedDataParallel)


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
        return plain_state_dict(to_dcp(self))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (from DCP) into the model, the optimizer and ``extra``."""
        converted = to_dcp(self)
        for key in sorted(converted):
            value = converted[key]
            if isinstance(value, ModuleState | OptimizerState):
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


def to_dcp(state: TrainingState | Mapping[str, Any]) -> dict[str, Any]:
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
            converted[key] = ModuleState(value)
        elif isinstance(value, torch.optim.Optimizer):
            converted[key] = OptimizerState(_owner(key, value, modules), value)
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


def plain_state_dict(converted: Mapping[str, Any]) -> dict[str, Any]:
    """What DCP writes for ``converted``: modules and optimizers as their state dicts."""
    return {
        key: value.state_dict() if isinstance(value, ModuleState | OptimizerState) else value
        for key, value in converted.items()
    }


def copy_back(state: TrainingState | Mapping[str, Any], converted: Mapping[str, Any]) -> None:
    """Put loaded plain values (DCP replaces them in ``converted``) back into ``state``."""
    for key, value in converted.items():
        if isinstance(value, ModuleState | OptimizerState):
            continue
        if isinstance(state, TrainingState):
            state.extra[key] = value
        elif isinstance(state, MutableMapping):
            state[key] = value


def state_modules(converted: Mapping[str, Any]) -> dict[str, torch.nn.Module]:
    """The modules of ``converted``, by state key."""
    return {k: v.module for k, v in converted.items() if isinstance(v, ModuleState)}
