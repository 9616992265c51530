"""Where rank 0's return value goes when it does not belong in an XCom.

A value that is JSON-safe and small travels inline in the operator's XCom summary. Anything else
(a ``state_dict``, a large text) is written to a result location (a local directory by default,
or any ``ObjectStoragePath`` / fsspec URL: ``s3://bucket/prefix``, ``gs://...``,
``memory://...``) and the summary holds its URI, size and SHA-256. Nothing is ever truncated
silently.

Each task try writes under its own key (:func:`result_key`): readable ids plus a hash of the raw
ids, so distinct runs never share a key, and no key leaves the location. A stored value is
created exclusively: an existing object is never overwritten (:class:`ResultExistsError`).

:func:`load_result` reads the value back from a summary in a downstream task: only from under
the result location it is given, and only after the bytes match the summary's SHA-256, so an
XCom cannot make it unpickle an arbitrary or altered file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import posixpath
import re
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import cloudpickle

from sparktorch_ops.errors import ConfigError, SparkTorchError

if TYPE_CHECKING:
    from sparktorch_ops.results import RunResult

DEFAULT_MAX_XCOM_VALUE_BYTES = 48 * 1024
CONFIG_SECTION = "sparktorch_ops"
_UNSAFE_PATH_CHARS = re.compile(r"[^A-Za-z0-9._=-]+")
_KEY_HASH_CHARS = 16


class ResultStorageError(SparkTorchError):
    """A stored result could not be written or read back safely.

    Attributes:
        uri: the stored object's URI.
        message: what went wrong and what to do.
    """

    def __init__(self, uri: str, message: str) -> None:
        super().__init__(f"{uri}: {message}")
        self.uri = uri
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.uri, self.message))


class ResultExistsError(ResultStorageError, FileExistsError):
    """The object a value was to be written to already exists; it was left as it is."""


class ResultIntegrityError(ResultStorageError):
    """A stored value's bytes do not match its summary's SHA-256 (or there is none to check)."""


def default_result_location() -> str:
    """``[sparktorch_ops] result_location`` from Airflow's config, else under ``AIRFLOW_HOME``."""
    from airflow.providers.common.compat.sdk import conf

    configured = conf.get(CONFIG_SECTION, "result_location", fallback=None)
    if configured:
        return str(configured)
    home = os.environ.get("AIRFLOW_HOME") or os.path.join(os.path.expanduser("~"), "airflow")
    return os.path.join(home, "sparktorch_ops", "results")


def default_max_xcom_value_bytes() -> int:
    """``[sparktorch_ops] max_xcom_value_bytes`` from Airflow's config, else 48 KB."""
    from airflow.providers.common.compat.sdk import conf

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
    if isinstance(value, (list, tuple, dict)):
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(value, dict) and not isinstance(key, str):
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
    return text if "://" in text else str(path.as_uri())


def _local_path(location: str) -> str | None:
    """The absolute local path of a plain path or ``file://`` URL; None for other schemes."""
    if "://" not in location:
        return os.path.abspath(location)
    parts = urllib.parse.urlsplit(location)
    if parts.scheme.lower() != "file" or parts.netloc not in ("", "localhost"):
        return None
    return os.path.abspath(urllib.request.url2pathname(parts.path))


def _clean(part: str) -> str:
    """A readable path component: unsafe characters become ``_``; never empty, ``.`` or ``..``."""
    cleaned = _UNSAFE_PATH_CHARS.sub("_", part)
    return "_" if cleaned.strip(".") == "" else cleaned


def task_key(dag_id: str, run_id: str, task_id: str, map_index: int | None) -> str:
    """The relative path of one task instance (all its tries): ``dag/run/task[.map]~hash``.

    The ids are cleaned to safe, readable path components (never ``.``, ``..`` or empty);
    ``hash`` (16 hex characters of a SHA-256 of the raw ids) keeps ids that clean to the same text
    (``T00:00:00+00:00`` and ``T00_00_00_00_00``) apart.
    """
    index = -1 if map_index is None or map_index < 0 else int(map_index)
    raw = json.dumps([dag_id, run_id, task_id, index], ensure_ascii=True)
    digest = hashlib.sha256(raw.encode("ascii")).hexdigest()[:_KEY_HASH_CHARS]
    task = _clean(task_id) if index < 0 else f"{_clean(task_id)}.{index}"
    return "/".join([_clean(dag_id), _clean(run_id), f"{task}~{digest}"])


def result_key(
    dag_id: str, run_id: str, task_id: str, map_index: int | None, try_number: int
) -> str:
    """The relative path of one task try's result: ``dag/run/task[.map]~hash/try-N``
    (:func:`task_key` plus the try): each try has its own key, so a retry never meets an
    earlier try's value."""
    return f"{task_key(dag_id, run_id, task_id, map_index)}/try-{int(try_number)}"


def task_ids(ti: Any) -> tuple[str, str, str, int]:
    """A task instance's ``(dag_id, run_id, task_id, map_index)``; -1: not mapped."""
    index = getattr(ti, "map_index", -1)
    return ti.dag_id, ti.run_id, ti.task_id, -1 if index is None else int(index)


def task_location(ti: Any, location: str, area: str, training_id: str | None) -> str:
    """The task instance's own directory in ``area`` under ``location``:
    ``<location>/<area>/<task_key>`` (the default ``checkpoint_dir`` in ``checkpoints``, a
    deferred training's run directory in ``runs``); a durable training's own under it (a
    cleared task's new training starts afresh).

    Keyed by dag, run, task and map index but not the try, so a retry of the task instance
    finds its previous try's checkpoints and run, and a new DAG run starts fresh.
    """
    relative = [
        area,
        *task_key(*task_ids(ti)).split("/"),
        *([] if training_id is None else [training_id]),
    ]
    local = _local_path(location)
    if local is not None:
        return os.path.join(local, *relative)
    return "/".join([location.rstrip("/"), *relative])


def _check_key(key: str) -> None:
    parts = key.split("/")
    if "\\" in key or any(part in ("", ".", "..") for part in parts):
        raise ConfigError(
            "key",
            f"{key!r} is not a relative path of plain components (no empty, '.' or '..' parts, "
            "no backslashes): it could leave the result location; build it with result_key()",
        )


def store_value(value: Any, location: str, key: str) -> dict[str, Any]:
    """Write ``value`` under ``location/key``; return the summary fields that point at it.

    Text is written as UTF-8 (``result.txt``), anything else with cloudpickle (``result.pkl``).
    The object is created exclusively (mode ``"xb"``): an existing one is never overwritten.

    Returns:
        ``{"value_uri", "value_size", "value_format", "value_sha256"}``.

    Raises:
        ConfigError: ``key`` has an empty, ``.`` or ``..`` component.
        ResultExistsError: something is already stored under ``location/key``.
    """
    _check_key(key)
    if isinstance(value, str):
        data, name, fmt = value.encode("utf-8"), "result.txt", "text"
    else:
        data, name, fmt = cloudpickle.dumps(value), "result.pkl", "pickle"
    target = _path(location) / key / name
    uri = _uri(target)
    exists = ResultExistsError(
        uri,
        "a value is already stored here and was left as it is; every task try writes its own "
        "key, so this is another writer or a reused result_location: use a fresh one",
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # also for backends whose "xb" is not exclusive
        raise exists
    try:
        handle = target.open("xb")
    except FileExistsError as exc:
        raise exists from exc
    try:
        with handle:
            handle.write(data)
    except BaseException:
        # Ours (created above), and incomplete: remove it so it cannot pass for a value.
        with contextlib.suppress(Exception):  # the write's own error is the one to report
            target.unlink()
        raise
    return {
        "value_uri": uri,
        "value_size": len(data),
        "value_format": fmt,
        "value_sha256": hashlib.sha256(data).hexdigest(),
    }


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


def _relative_to_location(uri: str, location: str) -> str | None:
    """``uri`` below ``location`` as a local path (or the URI itself), None when outside it."""
    local_base, local_target = _local_path(location), _local_path(uri)
    if local_base is not None or local_target is not None:
        if local_base is None or local_target is None:
            return None
        # realpath: neither ``..`` nor a symlink inside the location leads out of it.
        base, target = os.path.realpath(local_base), os.path.realpath(local_target)
        if target == base or os.path.commonpath([base, target]) != base:
            return None
        return target
    parts = urllib.parse.urlsplit(uri)
    if parts.query or parts.fragment:
        return None
    names = parts.path.split("/")[1:]
    if any(p in ("", ".", "..") or urllib.parse.unquote(p) in (".", "..") for p in names):
        return None
    target_path = posixpath.normpath(parts.path)
    bases = {location}
    with contextlib.suppress(Exception):  # as store_value wrote it, where the scheme is known
        bases.add(_uri(_path(location)))
    place = (parts.scheme.lower(), parts.netloc)
    for base_parts in map(urllib.parse.urlsplit, bases):
        base_path = base_parts.path.rstrip("/")
        same_place = (base_parts.scheme.lower(), base_parts.netloc) == place
        if same_place and target_path.startswith(f"{base_path}/"):
            return uri
    return None


def load_result(
    summary: Mapping[str, Any] | str,
    *,
    result_location: str | None = None,
    sha256: str | None = None,
) -> Any:
    """Rank 0's value from an operator's XCom summary (or from a stored value's URI).

    A stored value is read only from under ``result_location`` and only used once its bytes match
    the SHA-256 the operator recorded: nothing outside the location is read, and a pickle that
    was altered (or has no digest to check) is never unpickled.

    Args:
        summary: the ``TorchDistributorOperator`` XCom, or a ``value_uri`` from it.
        result_location: the ``result_location`` of the operator that wrote the value (rendered).
            Default: ``[sparktorch_ops] result_location``, else under ``AIRFLOW_HOME``, the
            operator's own default.
        sha256: the expected SHA-256 (hex) when ``summary`` is a URI; a summary carries its own
            (``value_sha256``). Required to read a pickle by URI.

    Returns:
        The inline ``value``, or the stored one read back (text or unpickled).

    Raises:
        ConfigError: the URI is not under ``result_location`` (argument ``result_location``).
        ResultIntegrityError: the bytes do not match the SHA-256 (or size) recorded for them, or
            a pickle has no SHA-256 to check.
    """
    if isinstance(summary, Mapping):
        if "value_uri" not in summary:
            return summary.get("value")
        uri = str(summary["value_uri"])
        fmt = str(summary.get("value_format", "pickle"))
        expected = summary.get("value_sha256")
        size = summary.get("value_size")
    else:
        uri = str(summary)
        fmt = "text" if uri.endswith(".txt") else "pickle"
        expected, size = sha256, None
    location = str(result_location or default_result_location())
    inside = _relative_to_location(uri, location)
    if inside is None:
        raise ConfigError(
            "result_location",
            f"{uri} is not under the result location {location!r}: nothing was read. Pass "
            "result_location= with the (rendered) result_location of the operator that wrote it",
        )
    if expected is None and fmt != "text":
        raise ResultIntegrityError(
            uri,
            "no SHA-256 to check the stored pickle against, so it was not unpickled; pass the "
            "operator's XCom summary (it holds value_sha256), or sha256= with a URI",
        )
    with _path(inside).open("rb") if "://" in inside else open(inside, "rb") as handle:
        data = handle.read()
    if size is not None and len(data) != int(size):
        raise ResultIntegrityError(
            uri, f"{len(data)} bytes stored, {int(size)} recorded: the value was not used"
        )
    if expected is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != str(expected).lower():
            raise ResultIntegrityError(
                uri,
                f"SHA-256 {actual} does not match the recorded {expected}: the stored value was "
                "altered or damaged, and was not used",
            )
    if fmt == "text":
        return data.decode("utf-8")
    return cloudpickle.loads(data)


def xcom_summary(
    result: RunResult, ti: Any, location: str, max_bytes: int | None, log: Any
) -> dict[str, Any]:
    """The XCom of a finished training: rank 0's value inline, or stored under ``location``
    (a write that fails is a :class:`TorchTrainingError`), and the run's summary."""
    from sparktorch_ops.airflow.errors import TorchTrainingError

    try:
        fields = value_fields(
            result.value,
            location=location,
            key=result_key(*task_ids(ti), ti.try_number),
            max_bytes=max_bytes,
        )
    except Exception as exc:
        raise TorchTrainingError(
            f"training succeeded but rank 0's value could not be written to "
            f"{location!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if "value_uri" in fields:
        log.info(
            "sparktorch_ops: rank 0's value (%s) written to %s (%d bytes)",
            fields["value_stored_because"],
            fields["value_uri"],
            fields["value_size"],
        )
    return {**fields, **result.summary()}
