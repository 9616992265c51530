"""The package's layout rules (DESIGN section 2), read from the imports of every module.

A folder says which process its code runs in, and so what it may import: ``wire/`` is shared
by every side and needs only the standard library; code in a Spark task, the agent or a rank
(``node/``, ``rank/``) never imports the driver's side; only the wrappers import Airflow or
Prefect; every ``SPARKTORCH_*`` environment variable is named in ``wire/env.py`` only; the
package root is imported by nothing inside it; and imports form no cycle, those
inside functions included (an import deferred to a call still runs the other module's import
in the middle of this one's work). Only imports under ``if TYPE_CHECKING:`` are left out of
the cycle rule: they never run.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sparktorch_ops"
DRIVER_SIDE = ("driver", "spark", "launchers")
WRAPPERS = ("airflow", "prefect")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. "sparktorch_ops.rank.worker"
    target: str  # what it imports: one of ours (resolved to a module) or a top-level package
    line: int
    type_checking: bool  # under ``if TYPE_CHECKING:``: read by the type checker, never run


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def ours(name: str) -> bool:
    return name == "sparktorch_ops" or name.startswith("sparktorch_ops.")


def resolve(name: str, modules: set[str]) -> str:
    """``sparktorch_ops.a.b.C`` -> the longest prefix that is one of our modules."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, modules: set[str]) -> Iterator[Import]:
    module = module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    type_checking: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            type_checking.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    for node in ast.walk(tree):
        typing_only = id(node) in type_checking
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = resolve(alias.name, modules) if ours(alias.name) else alias.name
                yield Import(
                    module,
                    target.split(".")[0] if not ours(target) else target,
                    node.lineno,
                    typing_only,
                )
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative imports are not used in this package
                base = module.rsplit(".", node.level - (path.name == "__init__.py"))[0]
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            if not ours(name):
                yield Import(module, name.split(".")[0], node.lineno, typing_only)
                continue
            for alias in node.names:  # `from pkg import submodule` imports that module
                full = f"{name}.{alias.name}"
                target = full if full in modules else resolve(name, modules)
                yield Import(module, target, node.lineno, typing_only)


def all_imports() -> list[Import]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return [imp for path in paths for imp in imports_of(path, modules)]


def folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ""


IMPORTS = all_imports()


def describe(found: list[Import]) -> str:
    return "\n".join(f"{i.module}:{i.line} imports {i.target}" for i in found)


def test_the_rules_see_every_folder() -> None:
    folders = {folder(i.module) for i in IMPORTS}
    assert {"wire", "rank", "node", "driver", "spark", "launchers", "data"} <= folders
    assert {"airflow", "prefect"} <= folders


def test_wire_imports_only_the_standard_library_and_itself() -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    found = [
        i
        for i in IMPORTS
        if folder(i.module) == "wire"
        and not (
            folder(i.target) == "wire"
            or i.target == "sparktorch_ops.errors"
            or (not ours(i.target) and i.target in stdlib)
        )
    ]
    assert found == [], describe(found)


@pytest.mark.parametrize("side", ["node", "rank"])
def test_task_agent_and_rank_code_never_imports_the_drivers_side(side: str) -> None:
    found = [i for i in IMPORTS if folder(i.module) == side and folder(i.target) in DRIVER_SIDE]
    assert found == [], describe(found)


def test_only_the_wrappers_import_airflow_or_prefect() -> None:
    found = [
        i
        for i in IMPORTS
        if folder(i.module) not in WRAPPERS
        and (i.target in WRAPPERS or folder(i.target) in WRAPPERS)
    ]
    assert found == [], describe(found)


def test_nothing_inside_the_package_imports_its_root() -> None:
    """The root imports the public names; a module importing it back closes a loop."""
    found = [i for i in IMPORTS if i.target == "sparktorch_ops" and i.module != "sparktorch_ops"]
    assert found == [], describe(found)


def test_imports_form_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for i in IMPORTS:
        if not i.type_checking and ours(i.target) and i.target != i.module:
            graph.setdefault(i.module, set()).add(i.target)
    cycles = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == [], "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_every_sparktorch_variable_is_named_in_wire_env_only() -> None:
    """One place says which variables the processes of a run pass each other (and users set):
    elsewhere they are read through its names."""
    variable = re.compile(r"SPARKTORCH_[A-Z0-9_]+")
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} names {node.value}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "wire" / "env.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and variable.fullmatch(node.value)
    ]
    assert found == [], "\n".join(found)


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The rules above fail on what they forbid (the checker reads these imports)."""
    rank = tmp_path / "sparktorch_ops" / "rank"
    rank.mkdir(parents=True)
    bad = rank / "bad.py"
    bad.write_text(
        "from typing import TYPE_CHECKING\n"
        "from sparktorch_ops.driver import planning\n"
        "if TYPE_CHECKING:\n"
        "    from sparktorch_ops.driver import run\n"
        "def later():\n"
        "    import airflow\n"
        "    import sparktorch_ops\n"
    )
    modules = {
        "sparktorch_ops",
        "sparktorch_ops.driver.planning",
        "sparktorch_ops.driver.run",
        "sparktorch_ops.rank.bad",
    }
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "sparktorch_ops"
    try:
        found = list(imports_of(bad, modules))
    finally:
        PACKAGE = saved
    assert sorted((i.target, i.type_checking) for i in found) == [
        ("airflow", False),
        ("sparktorch_ops", False),
        ("sparktorch_ops.driver.planning", False),
        ("sparktorch_ops.driver.run", True),
        ("typing", False),
    ]
