"""What a probe task checks on an executor. Shipped by value: it must import nothing of ours."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


def probe_executor(_: Iterable[Any]) -> Iterator[dict[str, Any]]:
    """Report the executor's Python and whether it can import what the ranks need (the run
    ships sparktorch_ops itself, and pyspark's workers bring cloudpickle)."""
    import importlib
    import socket
    import sys

    found: dict[str, Any] = {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "executable": sys.executable,
        "host": socket.gethostname(),
        "missing": {},
    }
    for name in ("torch",):
        try:
            importlib.import_module(name)
        except Exception as exc:  # any import failure is the finding itself
            found["missing"][name] = f"{type(exc).__name__}: {exc}"
    yield found
