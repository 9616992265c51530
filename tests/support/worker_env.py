"""An executor Python with torch and pyspark (and what they require) but not sparktorch_ops.

Built in seconds without a download: a venv of this interpreter whose site-packages holds
links to this environment's installed distributions of torch and pyspark (with pyspark's
``sql`` extra: pandas, pyarrow, numpy) and everything they require, walked from their
metadata, as ``pip install torch pyspark[sql]`` would have installed them. With
``broken=True`` it also has a ``sparktorch_ops`` whose import fails, as a stale or damaged
installation on a cluster would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOTS = ("torch", "pyspark[sql]")
BROKEN_PACKAGE = "raise ImportError('a deliberately broken sparktorch_ops on the executors')\n"


def _requirements(roots: tuple[str, ...]) -> set[str]:
    """Distribution names ``roots`` need, recursively (markers evaluated here)."""
    from packaging.requirements import Requirement

    wanted, seen = list(roots), set()
    while wanted:
        requirement = Requirement(wanted.pop())
        name = requirement.name.lower().replace("_", "-")
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional platform package (CUDA wheels) not installed here
        seen.add(name)
        for line in dist.requires or []:
            child = Requirement(line)
            extras = requirement.extras or {""}
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in extras):
                wanted.append(line)
    return seen


def _top_level_entries(name: str, site: Path) -> set[str]:
    """The names directly in site-packages that distribution ``name`` installed."""
    dist = metadata.distribution(name)
    found = set()
    for file in dist.files or []:
        parts = Path(file).parts
        if parts and parts[0] not in ("..", "__pycache__") and (site / parts[0]).exists():
            found.add(parts[0])
    return found


def build(directory: Path, *, broken: bool, coverage: bool = False) -> str:
    """Create the environment under ``directory``; its python."""
    site_here = Path(metadata.distribution("torch").locate_file(""))
    subprocess.run(
        [getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip",
         str(directory)],
        check=True,
        timeout=120,
    )  # fmt: skip
    python = directory / "bin" / "python"
    lib = next((directory / "lib").glob("python3*"))
    site = lib / "site-packages"
    roots = ROOTS + (("coverage",) if coverage else ())
    for name in sorted(_requirements(roots)):
        for entry in _top_level_entries(name, site_here):
            if not (site / entry).exists():
                os.symlink(site_here / entry, site / entry)
    if coverage:  # coverage's subprocess hook: a .pth file (its package may list it too)
        for pth in site_here.glob("*coverage*.pth"):
            if not (site / pth.name).exists():
                os.symlink(pth, site / pth.name)
    if broken:
        (site / "sparktorch_ops").mkdir()
        (site / "sparktorch_ops" / "__init__.py").write_text(BROKEN_PACKAGE)
    check = subprocess.run(
        [str(python), "-c", "import torch, pyspark, pyarrow\n"
         "import importlib.util as u\n"
         "print(u.find_spec('psutil') is None, u.find_spec('cloudpickle') is None)\n"
         "import sparktorch_ops"],
        capture_output=True, text=True, timeout=120, cwd=directory,
    )  # fmt: skip
    assert check.stdout.split() == ["True", "True"], check.stdout + check.stderr
    expected = "deliberately broken" if broken else "No module named 'sparktorch_ops'"
    assert expected in check.stderr, check.stderr
    return str(python)
