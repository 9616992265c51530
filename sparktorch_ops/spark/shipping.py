"""The driver's own sparktorch_ops, shipped to the executors for every barrier run.

The executors need only torch (and what pyspark's workers need): the package travels as a
zip named by the hash of its files, built once per process, added to the session once
(``SparkContext.addPyFile``; over Spark Connect ``addArtifacts(..., pyfile=True)``). Spark's
Python workers put it ahead of site-packages, so a task imports the driver's copy even where
another version (or a broken one) is installed; the task then gives it to its agent and ranks
(:mod:`sparktorch_ops.node.package`).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import io
import os
import shutil
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from typing import Any

from sparktorch_ops.checkpoint.storage import replace_file
from sparktorch_ops.wire import VERSION

# A zip entry's time is part of its bytes: one fixed time keeps a zip a function of its files.
_ENTRY_TIME = (2020, 1, 1, 0, 0, 0)
_shipped_lock = threading.Lock()
# (SparkContext or Connect session id, zip name) already added: adding twice makes Spark warn.
_shipped: set[tuple[str, str]] = set()


def _package_files(directory: str) -> Iterator[tuple[str, str]]:
    """(path, name in the zip) of every file of the package, sorted, caches left out."""
    parent = os.path.dirname(directory)
    found = []
    for folder, subfolders, files in os.walk(directory):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        for name in files:
            if not name.endswith((".pyc", ".pyo")):
                path = os.path.join(folder, name)
                found.append((path, os.path.relpath(path, parent).replace(os.sep, "/")))
    yield from sorted(found, key=lambda item: item[1])


def package_digest(directory: str) -> str:
    """The SHA-256 of the package's file names and contents (an editable install that
    changed gets a new one; its version number does not change)."""
    digest = hashlib.sha256()
    for path, name in _package_files(directory):
        digest.update(name.encode() + b"\0")
        with open(path, "rb") as file:
            digest.update(hashlib.sha256(file.read()).digest())
    return digest.hexdigest()


def build_zip(directory: str, destination: str) -> str:
    """Zip the package at ``directory`` into the folder ``destination``; the zip's path,
    ``sparktorch_ops-<version>-<digest>.zip``."""
    digest = package_digest(directory)[:16]
    path = os.path.join(destination, f"sparktorch_ops-{VERSION}-{digest}.zip")
    built = io.BytesIO()
    with zipfile.ZipFile(built, "w", zipfile.ZIP_DEFLATED) as archive:
        for file, name in _package_files(directory):
            entry = zipfile.ZipInfo(name, _ENTRY_TIME)
            entry.compress_type = zipfile.ZIP_DEFLATED
            entry.external_attr = 0o644 << 16
            with open(file, "rb") as source:
                archive.writestr(entry, source.read())
    replace_file(path, built.getbuffer())
    return path


@functools.cache
def package_zip() -> str:
    """This process's zip of the sparktorch_ops it imported, in a private directory that
    lives as long as the process (Spark serves the file from there)."""
    directory = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # sparktorch_ops/
    destination = tempfile.mkdtemp(prefix="sparktorch_ops-package-")
    atexit.register(shutil.rmtree, destination, True)
    return build_zip(directory, destination)


def ship_package(session: Any) -> None:
    """Add this driver's package to a classic SparkContext or a Spark Connect session, once."""
    path = package_zip()
    if hasattr(session, "addPyFile"):  # a SparkContext
        key = (f"context-{session.applicationId}", os.path.basename(path))
        add = functools.partial(session.addPyFile, path)
    else:
        key = (f"connect-{session.session_id}", os.path.basename(path))
        add = functools.partial(session.addArtifacts, path, pyfile=True)
    with _shipped_lock:
        if key in _shipped:
            return
        add()
        _shipped.add(key)
