"""The package a run ships: its zip, keyed by content, and the copy a node unpacks from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

import sparktorch_ops
from sparktorch_ops.node import package
from sparktorch_ops.spark import shipping
from tests.support.blocking import blocker_source

PACKAGE_DIR = os.path.dirname(sparktorch_ops.__file__)


@pytest.fixture
def tiny_package(tmp_path: Path) -> Path:
    """A stand-in package directory: two modules, a data file and a bytecode cache."""
    root = tmp_path / "src" / "sparktorch_ops"
    (root / "rank").mkdir(parents=True)
    (root / "__init__.py").write_text("VALUE = 1\n")
    (root / "rank" / "bootstrap.py").write_text("print('boot')\n")
    (root / "py.typed").write_text("")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    return root


def test_the_zip_holds_the_package_without_caches_and_is_named_by_its_content(
    tiny_package: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    first = shipping.build_zip(str(tiny_package), str(out))
    with zipfile.ZipFile(first) as archive:
        assert archive.namelist() == [
            "sparktorch_ops/__init__.py",
            "sparktorch_ops/py.typed",
            "sparktorch_ops/rank/bootstrap.py",
        ]
    digest = shipping.package_digest(str(tiny_package))
    assert (
        os.path.basename(first) == f"sparktorch_ops-{sparktorch_ops.__version__}-{digest[:16]}.zip"
    )
    first_bytes = Path(first).read_bytes()
    # The same files give the same bytes; a changed file (an editable install) a new name.
    assert Path(shipping.build_zip(str(tiny_package), str(out))).read_bytes() == first_bytes
    (tiny_package / "__init__.py").write_text("VALUE = 2\n")
    second = shipping.build_zip(str(tiny_package), str(out))
    assert second != first and shipping.package_digest(str(tiny_package)) != digest
    assert sorted(p.name for p in out.iterdir()) == sorted([Path(first).name, Path(second).name])


def test_this_process_builds_its_zip_once(monkeypatch: pytest.MonkeyPatch) -> None:
    shipping.package_zip.cache_clear()
    built: list[str] = []
    real = shipping.build_zip
    monkeypatch.setattr(shipping, "build_zip", lambda *a: built.append(a[0]) or real(*a))
    try:
        path = shipping.package_zip()
        assert shipping.package_zip() == path and built == [PACKAGE_DIR]
        with zipfile.ZipFile(path) as archive:
            assert "sparktorch_ops/node/task.py" in archive.namelist()
        assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"  # private
    finally:
        shipping.package_zip.cache_clear()


def test_a_zip_is_unpacked_once_next_to_itself_even_by_tasks_at_once(
    tiny_package: Path, tmp_path: Path
) -> None:
    out = tmp_path / "files"
    out.mkdir()
    archive = shipping.build_zip(str(tiny_package), str(out))
    roots: list[str] = []
    threads = [
        threading.Thread(target=lambda: roots.append(package.runnable_root(archive)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    unpacked = archive[: -len(".zip")]
    assert roots == [unpacked] * 4
    assert (Path(unpacked) / "sparktorch_ops" / "rank" / "bootstrap.py").read_text() == (
        "print('boot')\n"
    )
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [Path(archive).name, Path(unpacked).name]
    )
    # A directory (an installed package, the driver's own copy) is used as it is.
    assert package.runnable_root(str(tmp_path / "src")) == str(tmp_path / "src")


def test_a_node_that_imported_the_shipped_zip_gives_its_copy_to_the_agent_first(
    tiny_package: Path, tmp_path: Path
) -> None:
    """In a fresh interpreter that imports the package from its zip (as Spark's Python workers
    do), the agent's PYTHONPATH starts with the unpacked copy and keeps what was there."""
    real_zip = shipping.build_zip(PACKAGE_DIR, str(tmp_path))
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import json\n"
        "from sparktorch_ops.node import package\n"
        "print(json.dumps([package.imported_root(), package.shipped_env({'PYTHONPATH': '/x'}),"
        " package.shipped_env({})]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code, real_zip],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    imported, with_path, without = json.loads(proc.stdout)
    unpacked = real_zip[: -len(".zip")]
    assert imported == real_zip
    assert with_path == {"PYTHONPATH": f"{unpacked}{os.pathsep}/x"}
    assert without == {"PYTHONPATH": unpacked}
    # An installed (or the driver's own) copy needs nothing: the agent finds it anyway.
    assert package.shipped_env({"PYTHONPATH": "/x"}) == {}


# What the executors' Python has: the standard library, torch and pyspark's worker needs;
# nothing else the package depends on.
DRIVER_ONLY = ("psutil", "cloudpickle", "pendulum", "fsspec", "cryptography", "airflow",
               "prefect", "mlflow")  # fmt: skip
NODE_AND_RANK_MODULES = (
    "sparktorch_ops.node.task",
    "sparktorch_ops.node.agent",
    "sparktorch_ops.node.forkserver",
    "sparktorch_ops.rank.bootstrap",
    "sparktorch_ops.checkpoint",
    "sparktorch_ops.data.loader",
    "sparktorch_ops.lightning",
)


def test_the_node_and_rank_modules_import_without_the_drivers_dependencies() -> None:
    code = blocker_source(DRIVER_ONLY) + "".join(f"import {m}\n" for m in NODE_AND_RANK_MODULES)
    code += "import sparktorch_ops; sparktorch_ops.report\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
