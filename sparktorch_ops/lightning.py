"""PyTorch Lightning under torchrun: the ``devices`` and ``num_nodes`` a Trainer must be given.

Lightning checks that ``devices * num_nodes`` equals torchrun's world size, and what those two
are depends on how the ranks were laid out: local mode runs one node with N ranks, barrier mode
one node per Spark task with the task's ranks on it. :func:`lightning_trainer_kwargs` reads the
layout torchrun put in the environment, so one training function fits every mode::

    trainer = L.Trainer(accelerator="cpu", strategy="ddp", **lightning_trainer_kwargs(), ...)

This module does not import Lightning (nor torch): it only reads environment variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def _positive_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} in the environment is not an integer") from exc
    if value < 1:
        raise ValueError(f"{name}={raw!r} in the environment is not a positive integer")
    return value


def lightning_trainer_kwargs(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """The ``devices`` and ``num_nodes`` of a Lightning ``Trainer`` for this torchrun layout.

    Under torchrun (which TorchDistributor uses in every mode), ``devices`` is the ranks on
    this node (``LOCAL_WORLD_SIZE``) and ``num_nodes`` the number of torchrun agents
    (``GROUP_WORLD_SIZE``, else ``WORLD_SIZE // LOCAL_WORLD_SIZE``): in local mode
    ``devices=N, num_nodes=1``; in barrier mode ``devices`` = ranks per Spark task and
    ``num_nodes`` = tasks. Outside torchrun it returns ``devices=1, num_nodes=1`` so the same
    code also runs as one plain process.

    Args:
        env: the environment to read (default: ``os.environ``).

    Returns:
        ``{"devices": int, "num_nodes": int}``, to pass as ``Trainer(**kwargs)``.

    Raises:
        ValueError: a layout variable is present but not a positive integer, or
            ``WORLD_SIZE`` is not a multiple of ``LOCAL_WORLD_SIZE``.
    """
    source = os.environ if env is None else env
    world = _positive_int(source, "WORLD_SIZE")
    local = _positive_int(source, "LOCAL_WORLD_SIZE")
    if world is None and local is None:
        return {"devices": 1, "num_nodes": 1}
    if local is None:
        # Launched by something that sets WORLD_SIZE only (e.g. one rank per node): one
        # device per node is the only layout consistent with it.
        assert world is not None
        return {"devices": 1, "num_nodes": world}
    nodes = _positive_int(source, "GROUP_WORLD_SIZE")
    if nodes is None:
        world = world if world is not None else local
        if world % local:
            raise ValueError(
                f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}; "
                "pass devices= and num_nodes= to the Trainer yourself"
            )
        nodes = world // local
    return {"devices": local, "num_nodes": nodes}
