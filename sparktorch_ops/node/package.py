"""Which copy of sparktorch_ops a node's agent and ranks import: the one this process did.

A barrier task imports our package from the zip the driver shipped for the run (Spark puts
its Python files ahead of site-packages), so the executors need none installed, and one
installed there (of another version, or broken) is never what a run imports. The agent and
the ranks are new interpreters: they get the same copy first on their ``PYTHONPATH``,
unpacked once per zip next to it (torchrun runs the rank bootstrap as a file, which a zip
cannot hold).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import zipfile


def imported_root() -> str:
    """The directory or zip that holds the sparktorch_ops this process imported."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # sparktorch_ops/
    return os.path.dirname(package)


def runnable_root(root: str | None = None) -> str:
    """A directory holding ``root``'s package (default: :func:`imported_root`).

    A directory is returned as it is; a zip is unpacked next to itself once (by name:
    the driver names each zip by its content's hash), atomically, so that the tasks of
    several runs on one executor share one copy.
    """
    root = root or imported_root()
    if not os.path.isfile(root):
        return root
    unpacked = os.path.splitext(root)[0]
    if os.path.isdir(unpacked):
        return unpacked
    staging = tempfile.mkdtemp(prefix=".unpacking-", dir=os.path.dirname(root))
    try:
        with zipfile.ZipFile(root) as archive:
            archive.extractall(staging)
        with contextlib.suppress(OSError):  # another task unpacked it first: use theirs
            os.rename(staging, unpacked)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return unpacked


def shipped_env(env: dict[str, str]) -> dict[str, str]:
    """``PYTHONPATH`` for an agent started here: the unpacked copy first when this process
    imported sparktorch_ops from a shipped zip; nothing when it imported an installed one."""
    if not os.path.isfile(imported_root()):
        return {}
    rest = env.get("PYTHONPATH", "")
    return {"PYTHONPATH": runnable_root() + (os.pathsep + rest if rest else "")}
