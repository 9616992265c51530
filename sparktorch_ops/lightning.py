"""PyTorch Lightning under torchrun: the ``devices`` and ``num_nodes`` a Trainer must be given.

Lightning checks that ``devices * num_nodes`` equals torchrun's world size, and what those two
are depends on how the ranks were laid out: local mode runs one node with N ranks, barrier mode
one node per Spark task with the task's ranks on it. :func:`lightning_trainer_kwargs` reads the
layout torchrun put in the environment, so one training function fits every mode::

    trainer = L.Trainer(accelerator="cpu", strategy="ddp", **lightning_trainer_kwargs(), ...)

This module does not import Lightning (nor torch): it reads environment variables, and lists
a checkpoint directory through fsspec.
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


def latest_ckpt_path(directory: str | None = None) -> str | None:
    """The newest Lightning ``.ckpt`` file directly under ``directory``, for ``ckpt_path=``.

    Lightning's ``ModelCheckpoint(dirpath=directory)`` names files ``epoch=E-step=S.ckpt``
    (and ``last.ckpt`` with ``save_last=True``). The newest is the one with the highest step
    (then epoch, then modification time; names without them rank below those with them), unless
    a ``last*.ckpt`` file was written at the same time or later (Lightning writes ``last.ckpt``
    after the top-k file of the same save). Use it to resume a run that torchrun restarted or
    that a pipeline retried::

        checkpoints = ModelCheckpoint(dirpath=checkpoint_dir(), save_last=True)
        trainer.fit(model, ckpt_path=latest_ckpt_path())

    Args:
        directory: a local directory or an fsspec URL (default:
            :func:`sparktorch_ops.checkpoint.checkpoint_dir`, the run's ``checkpoint_dir``).

    Returns:
        The file's path (a URL for a URL directory), or None when no directory is set, it does
        not exist, or it holds no ``.ckpt`` file (``ckpt_path=None`` starts fresh).
    """
    import re

    from sparktorch_ops.checkpoint.storage import Storage, checkpoint_dir

    root = directory if directory is not None else checkpoint_dir()
    if not root:
        return None
    storage = Storage(root)
    entries: list[tuple[str, float]] = []  # (name, mtime)
    for name, info in storage.listing():
        if info.get("type") == "file" and name.endswith(".ckpt"):
            try:
                mtime = storage.fs.modified(info["name"]).timestamp()
            except (NotImplementedError, OSError, AttributeError):
                mtime = 0.0
            entries.append((name, mtime))

    def number(name: str, key: str) -> int:
        match = re.search(rf"(?:^|[-_]){key}=(\d+)", name)
        return int(match.group(1)) if match else -1

    lasts = [e for e in entries if e[0].startswith("last")]
    others = [e for e in entries if not e[0].startswith("last")]
    best = max(
        others, key=lambda e: (number(e[0], "step"), number(e[0], "epoch"), e[1]), default=None
    )
    last = max(lasts, key=lambda e: e[1], default=None)
    if last is not None and (best is None or last[1] >= best[1]):
        best = last
    if best is None:
        return None
    return storage.url(best[0])
