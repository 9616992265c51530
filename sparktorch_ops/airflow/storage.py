"""Where rank 0's return value goes when it does not belong in an XCom.

A value that is JSON-safe and small travels inline in the operator's XCom summary. Anything else
(a ``state_dict``, a large text) is written to a result location (a local directory by default,
or any ``ObjectStoragePath`` / fsspec URL: ``s3://bucket/prefix``, ``gs://...``,
``memory://...``) and the summary holds its URI and size. Nothing is ever truncated silently.

:func:`load_result` reads the value back from a summary (or a URI) in a downstream task.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import cloudpickle

DEFAULT_MAX_XCOM_VALUE_BYTES = 48 * 1024
CONFIG_SECTION = "sparktorch_ops"
_UNSAFE_PATH_CHARS = re.compile(r"[^A-Za-z0-9._=-]+")


def default_result_location() -> str:
    """``[sparktorch_ops] result_location`` from Airflow's config, else under ``AIRFLOW_HOME``."""
    from airflow.sdk import conf

    configured = conf.get(CONFIG_SECTION, "result_location", fallback=None)
    if configured:
        return str(configured)
    home = os.environ.get("AIRFLOW_HOME") or os.path.join(os.path.expanduser("~"), "airflow")
    return os.path.join(home, "sparktorch_ops", "results")


def default_max_xcom_value_bytes() -> int:
    """``[sparktorch_ops] max_xcom_value_bytes`` from Airflow's config, else 48 KB."""
    from airflow.sdk import conf

    return int(
        conf.getint(CONFIG_SECTION, "max_xcom_value_bytes", fallback=DEFAULT_MAX_XCOM_VALUE_BYTES)
    )


def json_safe_problem(value: Any, where: str = "value") -> str | None:
    """Why ``value`` cannot travel as JSON unchanged, or None when it can.

    JSON-safe means: None, bool, int, finite float, str, lists (tuples become lists) and dicts
    with string keys of those.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where} is {value!r} (not finite)"
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            problem = json_safe_problem(item, f"{where}[{index}]")
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} has a key of type {type(key).__name__} ({key!r})"
            problem = json_safe_problem(item, f"{where}[{key!r}]")
            if problem:
                return problem
        return None
    return f"{where} is a {type(value).__module__}.{type(value).__qualname__}"


def _path(uri: str) -> Any:
    """An ``ObjectStoragePath`` (Airflow connections, its registered schemes), else a UPath."""
    from airflow.sdk import ObjectStoragePath

    path = ObjectStoragePath(uri)
    try:
        path.fs  # noqa: B018 - resolves the filesystem, which fails for unknown schemes
        return path
    except ValueError:
        # A scheme without an Airflow filesystem (memory://, a plain fsspec protocol): fsspec
        # itself, through universal_pathlib, which ObjectStoragePath is built on.
        from upath import UPath

        return UPath(uri)


def _uri(path: Any) -> str:
    text = str(path)
    if "://" in text:
        return text
    return str(path.as_uri())


def result_key(dag_id: str, run_id: str, task_id: str, map_index: int, try_number: int) -> str:
    """The relative path of one task try's result: ``dag/run/task[.map]/try-N``."""
    task = task_id if map_index is None or map_index < 0 else f"{task_id}.{map_index}"
    parts = [dag_id, run_id, task, f"try-{try_number}"]
    return "/".join(_UNSAFE_PATH_CHARS.sub("_", p) or "_" for p in parts)


def store_value(value: Any, location: str, key: str) -> dict[str, Any]:
    """Write ``value`` under ``location/key``; return the summary fields that point at it.

    Text is written as UTF-8 (``result.txt``), anything else with cloudpickle (``result.pkl``).

    Returns:
        ``{"value_uri", "value_size", "value_format"}``.
    """
    if isinstance(value, str):
        data, name, fmt = value.encode("utf-8"), "result.txt", "text"
    else:
        data, name, fmt = cloudpickle.dumps(value), "result.pkl", "pickle"
    target = _path(location) / key / name
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("wb") as handle:
        handle.write(data)
    return {"value_uri": _uri(target), "value_size": len(data), "value_format": fmt}


def value_fields(
    value: Any, *, location: str, key: str, max_bytes: int | None = None
) -> dict[str, Any]:
    """The summary fields for rank 0's value: inline when JSON-safe and small, else stored.

    ``max_bytes`` None: ``[sparktorch_ops] max_xcom_value_bytes`` (48 KB by default).
    """
    if max_bytes is None:
        max_bytes = default_max_xcom_value_bytes()
    problem = json_safe_problem(value)
    if problem is None:
        size = len(json.dumps(value, allow_nan=False).encode("utf-8"))
        if size <= max_bytes:
            return {"value": value}
        problem = f"value is {size} bytes as JSON, more than max_xcom_value_bytes={max_bytes}"
    return {**store_value(value, location, key), "value_stored_because": problem}


def load_result(summary: Mapping[str, Any] | str) -> Any:
    """Rank 0's value from an operator's XCom summary (or from a stored value's URI).

    Args:
        summary: the ``TorchDistributorOperator`` XCom, or a ``value_uri`` from it.

    Returns:
        The inline ``value``, or the stored one read back (text or unpickled).
    """
    if isinstance(summary, Mapping):
        if "value_uri" not in summary:
            return summary.get("value")
        uri = str(summary["value_uri"])
        fmt = str(summary.get("value_format", "pickle"))
    else:
        uri = str(summary)
        fmt = "text" if uri.endswith(".txt") else "pickle"
    with _path(uri).open("rb") as handle:
        data = handle.read()
    if fmt == "text":
        return data.decode("utf-8")
    return cloudpickle.loads(data)
