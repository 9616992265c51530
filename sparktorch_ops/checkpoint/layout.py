"""The layout on disk: step directories, their files and the ``COMMITTED`` marker, under a
local directory or an fsspec URL (:class:`Location`)."""

from __future__ import annotations

import os
import re
import shutil
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


def step_dir_name(step: int) -> str:
    """The name of ``step``'s directory: ``step-`` and the step, zero-padded to 9 digits."""
    return f"step-{step:09d}"


def checkpoint_dir() -> str | None:
    """The run's checkpoint directory: ``SPARKTORCH_CHECKPOINT_DIR``, None when unset or empty."""
    value = os.environ.get(CHECKPOINT_DIR_ENV, "").strip()
    return value or None


class Location:
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

    def newest(self) -> int | None:
        """The newest committed step under the root, None when there is none."""
        committed = [step for step, done in self.steps().items() if done]
        return max(committed) if committed else None

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


def location_of(directory: str | None) -> Location:
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
    return Location(root)
