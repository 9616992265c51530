"""What a rank runs, as it travels from the driver to where the rank runs: a pickled call or a
script with its bytes, written as a record the rank reads (packing it on the driver:
:mod:`sparktorch_ops.driver.packing`).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FunctionCall:
    """A pickled ``fn(*args, **kwargs)``.

    Attributes:
        data: the pickle.
        name: the function's qualified name (for logs and plans).
    """

    data: bytes = field(repr=False)
    name: str = "<function>"


@dataclass(frozen=True)
class Script:
    """A script and its argv, with its bytes so it can run where it does not exist."""

    driver_path: str
    source: bytes = field(repr=False)
    argv: tuple[str, ...]


Payload = FunctionCall | Script


def materialize(payload: Payload, directory: str, *, in_place: bool) -> dict[str, Any]:
    """The record a rank reads: the call's bytes, or a script path valid on this node.

    ``in_place`` (local mode) runs the script where it is, so its sibling imports and relative
    paths behave as under torchrun; otherwise (barrier mode) its bytes are written into
    ``directory`` so it runs where it does not exist.
    """
    if isinstance(payload, FunctionCall):
        return {"kind": "function", "data": payload.data}
    path = payload.driver_path
    if not in_place:
        path = os.path.join(directory, os.path.basename(payload.driver_path))
        with open(path, "wb") as handle:
            handle.write(payload.source)
    return {"kind": "script", "path": path, "argv": list(payload.argv)}


def write_rank_payload(payload: Payload, directory: str, *, in_place: bool) -> str:
    """Write the rank's record into ``directory``; return the file's path."""
    record = materialize(payload, directory, in_place=in_place)
    path = os.path.join(directory, "payload.pkl")
    with open(path, "wb") as handle:
        pickle.dump(record, handle)
    return path


def read_rank_payload(path: str) -> dict[str, Any]:
    """Read the record written by :func:`write_rank_payload`."""
    with open(path, "rb") as handle:
        record: dict[str, Any] = pickle.load(handle)
    return record
