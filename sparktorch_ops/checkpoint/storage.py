"""Files under a directory named by a local path or an fsspec URL, written atomically, and the
checkpoints' layout on them (step directories, their files, the ``COMMITTED`` marker).

Checkpoints, detached runs' directories and Lightning's checkpoint lookup all go through
:class:`Storage`: ``fsspec.core.url_to_fs`` gives the filesystem (fsspec's own local one for a
plain path or a ``file://`` URL), so no caller tells a path from a URL. The one part written
here by hand is :func:`replace_file`, the atomic write on a local disk: fsspec's local
filesystem writes a file in place, where a reader could see half of it; an object store
writes an object whole, so there ``pipe_file`` is the atomic write.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sparktorch_ops.errors import ConfigError
from sparktorch_ops.wire.env import CHECKPOINT_DIR_ENV

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem
    from torch.distributed.checkpoint import StorageReader, StorageWriter

COMMIT_MARKER = "COMMITTED"
"""The file that makes a step directory a checkpoint; written last, by rank 0."""
STATE_FILE = "state.pt"
"""A small replicated state, written whole by rank 0 with one ``torch.save`` (in place of
DCP's files): ``{key: state dict or value}``, as :meth:`TrainingState.state_dict` gives it."""
DCP_METADATA = ".metadata"
"""DCP's metadata file: a directory that holds it is a DCP checkpoint."""

_STEP_RE = re.compile(r"^step-(\d+)$")


def replace_file(path: str, data: bytes | memoryview) -> None:
    """Write a local file whole: beside it first (``.writing-*``), synced, then renamed over
    it, so a reader sees the old file or the new one, and a crash leaves no half file."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=folder, prefix=".writing-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise


class Storage:
    """A directory given as a local path or an fsspec URL, with the few operations we need.

    Attributes:
        root: the directory as given; :meth:`url` names files under it the same way.
        fs: its fsspec filesystem.
        local: whether it is on this machine's file system (a path or a ``file://`` URL).
    """

    def __init__(self, root: str) -> None:
        from fsspec.core import url_to_fs
        from fsspec.implementations.local import LocalFileSystem

        self.root = root
        self.fs: AbstractFileSystem
        self.fs, self._base = url_to_fs(root)
        self.local = isinstance(self.fs, LocalFileSystem)

    def url(self, *names: str) -> str:
        """The user-facing path (or URL) of a name under the root."""
        return "/".join([self.root.rstrip("/"), *names]) if names else self.root

    def path(self, *names: str) -> str:
        """The filesystem's path of a name under the root (absolute for a local one)."""
        return "/".join([self._base.rstrip("/"), *names]) if names else self._base

    def is_file(self, *names: str) -> bool:
        return bool(self.fs.isfile(self.path(*names)))

    def is_dir(self, *names: str) -> bool:
        return bool(self.fs.isdir(self.path(*names)))

    def exists(self, *names: str) -> bool:
        return bool(self.fs.exists(self.path(*names)))

    def listing(self, *names: str) -> list[tuple[str, dict[str, Any]]]:
        """(name, fsspec's details) of the entries directly under a directory, none when it
        does not exist; listed afresh (another process may have written there)."""
        path = self.path(*names)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = [(str(entry["name"]).rstrip("/").rsplit("/", 1)[-1], entry) for entry in entries]
        return [(name, entry) for name, entry in found if entry["name"].rstrip("/") != path]

    def names(self, *names: str) -> list[str]:
        """The names directly under a directory (none when it does not exist)."""
        return [name for name, _ in self.listing(*names)]

    def read(self, *names: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(*names)))

    def open(self, *names: str) -> Any:
        return self.fs.open(self.path(*names), "rb")

    def write(self, data: bytes | memoryview, *names: str) -> None:
        """Write a file whole: a reader sees it complete or not at all."""
        if self.local:
            replace_file(self.path(*names), data)
        else:
            self.fs.pipe_file(self.path(*names), bytes(data))

    def remove_tree(self, *names: str) -> None:
        """Delete a directory and all it holds (FileNotFoundError when there is none)."""
        self.fs.rm(self.path(*names), recursive=True)


# -- the checkpoints' layout ----------------------------------------------------------------------
def step_dir_name(step: int) -> str:
    """The name of ``step``'s directory: ``step-`` and the step, zero-padded to 9 digits."""
    return f"step-{step:09d}"


def checkpoint_dir() -> str | None:
    """The run's checkpoint directory: ``SPARKTORCH_CHECKPOINT_DIR``, None when unset or empty."""
    value = os.environ.get(CHECKPOINT_DIR_ENV, "").strip()
    return value or None


def steps(storage: Storage) -> dict[int, bool]:
    """Every step directory under the root: step -> whether it is committed."""
    found: dict[int, bool] = {}
    for name in storage.names():
        match = _STEP_RE.match(name)
        if match:
            found[int(match.group(1))] = storage.is_file(name, COMMIT_MARKER)
    return found


def newest(storage: Storage) -> int | None:
    """The newest committed step under the root, None when there is none."""
    committed = [step for step, done in steps(storage).items() if done]
    return max(committed) if committed else None


def write_state(storage: Storage, state: Mapping[str, Any], name: str) -> None:
    """Write a state dict with one ``torch.save`` as ``<name>/state.pt``."""
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    storage.fs.makedirs(storage.path(name), exist_ok=True)
    storage.write(buffer.getbuffer(), name, STATE_FILE)


def dcp_writer(storage: Storage, *names: str) -> StorageWriter:
    """DCP's writer for a directory: its file-system one on local disk, fsspec's elsewhere."""
    if storage.local:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(storage.path(*names))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(storage.url(*names))


def dcp_reader(storage: Storage, *names: str) -> StorageReader:
    """DCP's reader for a directory (as :func:`dcp_writer`)."""
    if storage.local:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(storage.path(*names))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(storage.url(*names))


def location_of(directory: str | None) -> Storage:
    """The checkpoint directory given, or the run's (:func:`checkpoint_dir`)."""
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
    return Storage(root)
