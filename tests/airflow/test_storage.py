"""Result storage hardening: collision-free keys, exclusive writes, SHA-256, the location fence.

Real files on the local disk and fsspec's in-memory filesystem; no Spark, no mocks.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import sparktorch_ops.airflow
from sparktorch_ops.airflow.storage import (
    ResultExistsError,
    ResultIntegrityError,
    load_result,
    result_key,
    store_value,
    value_fields,
)
from sparktorch_ops.errors import ConfigError

RAW_RUN_ID = "manual__2025-01-01T00:00:00+00:00"
CLEANED_LOOKALIKE = "manual__2025-01-01T00_00_00_00_00"


class TouchOnLoad:
    """A value whose unpickling creates ``marker``: it shows whether a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def stored(value: Any, location: str, key: str) -> dict[str, Any]:
    """The summary fields of ``value`` stored (never inline) under ``location/key``."""
    fields = value_fields(value, location=location, key=key, max_bytes=0)
    assert "value_uri" in fields
    return fields


def local_file(fields: dict[str, Any]) -> Path:
    return Path(fields["value_uri"].removeprefix("file://"))


@pytest.fixture(params=["local", "memory"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "results")
    return f"memory://sto-storage-{tmp_path.name}"


def test_run_ids_that_clean_alike_get_their_own_keys(location: str) -> None:
    key_raw = result_key("dag", RAW_RUN_ID, "train", -1, 1)
    key_lookalike = result_key("dag", CLEANED_LOOKALIKE, "train", -1, 1)
    assert key_raw != key_lookalike
    # Both stay readable: the cleaned run id is the same directory name, the hash tells them apart.
    assert key_raw.split("/")[:2] == key_lookalike.split("/")[:2] == ["dag", CLEANED_LOOKALIKE]
    assert key_raw.split("/")[2] != key_lookalike.split("/")[2]

    first = stored({"run": RAW_RUN_ID, "s": {1}}, location, key_raw)
    second = stored({"run": CLEANED_LOOKALIKE, "s": {2}}, location, key_lookalike)
    assert first["value_uri"] != second["value_uri"]
    assert load_result(first, result_location=location) == {"run": RAW_RUN_ID, "s": {1}}
    assert load_result(second, result_location=location) == {"run": CLEANED_LOOKALIKE, "s": {2}}


def test_keys_are_stable_and_tell_every_id_apart() -> None:
    key = result_key("dag", "run", "train", -1, 1)
    assert key == result_key("dag", "run", "train", None, 1)  # type: ignore[arg-type]
    assert key == result_key("dag", "run", "train", -1, 1)
    # A retry is a new key in the same task directory: it never meets the earlier try's value.
    retry = result_key("dag", "run", "train", -1, 2)
    assert retry.split("/")[:3] == key.split("/")[:3]
    assert (key.split("/")[3], retry.split("/")[3]) == ("try-1", "try-2")
    others = {
        result_key("dag", "run", "train", 0, 1),
        result_key("dag", "run", "train.0", -1, 1),  # the same readable text as map index 0
        result_key("dag", "run", "Train", -1, 1),  # apart on case-insensitive filesystems too
        result_key("dag", "run", "träin", -1, 1),  # cleans to "tr_in"
        result_key("dag", "run", "tr_in", -1, 1),
        result_key("dag.run", "", "train", -1, 1),
        result_key("dag", "run/train", "", -1, 1),
    }
    assert key not in others
    assert len({k.lower().rsplit("/", 1)[0] for k in others}) == len(others)


@pytest.mark.parametrize("run_id", ["..", ".", "", "../..", "../../escaped", "a/../../b", "/abs"])
def test_dot_and_slash_ids_stay_inside_the_location(tmp_path: Path, run_id: str) -> None:
    location = tmp_path / "deep" / "results"
    key = result_key("..", run_id, "..", -1, 1)
    assert all(part not in ("", ".", "..") for part in key.split("/")), key
    fields = stored({"run_id": run_id, "s": {0}}, str(location), key)
    target = local_file(fields).resolve()
    assert target.is_relative_to(location.resolve())
    assert load_result(fields, result_location=str(location)) == {"run_id": run_id, "s": {0}}
    # Nothing was written next to or above the location.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep"]
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["results"]


@pytest.mark.parametrize("key", ["../x", "a/../../x", "./a", "a//b", "/abs", "", "a\\..\\b"])
def test_keys_that_could_leave_the_location_are_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError, match="could leave the result location") as caught:
        store_value({1}, str(tmp_path / "results"), key)
    assert caught.value.argument == "key"
    assert not any(tmp_path.iterdir())


def test_a_second_write_to_the_same_key_raises_and_keeps_the_first(location: str) -> None:
    key = result_key("dag", "run", "train", -1, 1)
    first = stored({"first": {1}}, location, key)
    with pytest.raises(ResultExistsError, match="already stored here") as caught:
        stored({"second": {2}}, location, key)
    assert caught.value.uri == first["value_uri"]
    assert isinstance(caught.value, FileExistsError)
    # The error survives pickling (it may cross a process boundary).
    assert pickle.loads(pickle.dumps(caught.value)).uri == first["value_uri"]
    assert load_result(first, result_location=location) == {"first": {1}}
    # The next try of the same task writes its own key.
    retry = stored({"second": {2}}, location, result_key("dag", "run", "train", -1, 2))
    assert load_result(retry, result_location=location) == {"second": {2}}


def test_an_altered_pickle_fails_the_sha256_check_and_is_never_unpickled(tmp_path: Path) -> None:
    location = str(tmp_path / "results")
    honest, planted = tmp_path / "marker-a", tmp_path / "marker-b"
    fields = stored(TouchOnLoad(honest), location, result_key("dag", "run", "t", -1, 1))
    path = local_file(fields)
    data = path.read_bytes()
    assert fields["value_sha256"] == hashlib.sha256(data).hexdigest()
    tampered = data.replace(b"marker-a", b"marker-b")  # one byte flipped
    assert sum(a != b for a, b in zip(data, tampered, strict=True)) == 1
    path.write_bytes(tampered)

    with pytest.raises(ResultIntegrityError, match="does not match the recorded") as caught:
        load_result(fields, result_location=location)
    assert caught.value.uri == fields["value_uri"]
    assert fields["value_uri"] in str(caught.value)
    assert isinstance(caught.value, sparktorch_ops.airflow.ResultStorageError)
    assert not honest.exists() and not planted.exists()  # nothing was unpickled
    # By URI with the digest, the same refusal; without a digest a pickle is not read at all.
    with pytest.raises(ResultIntegrityError, match="does not match"):
        load_result(fields["value_uri"], result_location=location, sha256=fields["value_sha256"])
    with pytest.raises(ResultIntegrityError, match="no SHA-256 to check"):
        load_result(fields["value_uri"], result_location=location)
    without_digest = {k: v for k, v in fields.items() if k != "value_sha256"}
    with pytest.raises(ResultIntegrityError, match="no SHA-256 to check"):
        load_result(without_digest, result_location=location)
    assert not honest.exists() and not planted.exists()

    # The checks are what stopped it: unpickled, the altered bytes plant their marker, and the
    # honest bytes, loaded through load_result, create theirs.
    cloudpickle.loads(tampered)
    assert planted.exists()
    path.write_bytes(data)
    load_result(fields, result_location=location)
    assert honest.exists()


def test_altered_text_and_size_are_refused_too(tmp_path: Path) -> None:
    location = str(tmp_path / "results")
    fields = stored("z" * 100, location, result_key("dag", "run", "t", -1, 1))
    path = local_file(fields)
    path.write_text("y" + "z" * 99)
    with pytest.raises(ResultIntegrityError, match="does not match"):
        load_result(fields, result_location=location)
    path.write_text("z" * 101)
    with pytest.raises(ResultIntegrityError, match="101 bytes stored, 100 recorded"):
        load_result(fields, result_location=location)


def test_a_uri_outside_the_location_is_refused(tmp_path: Path) -> None:
    location = tmp_path / "results"
    other = tmp_path / "results-other"  # shares the prefix "results", not the directory
    marker = tmp_path / "marker"
    key = result_key("dag", "run", "t", -1, 1)
    fields = stored(TouchOnLoad(marker), str(other), key)

    def refused(summary: dict[str, Any] | str, where: str | None) -> ConfigError:
        with pytest.raises(ConfigError, match="Pass result_location=") as caught:
            load_result(summary, result_location=where)
        assert caught.value.argument == "result_location"
        return caught.value

    error = refused(fields, str(location))
    assert fields["value_uri"] in str(error)
    assert str(location) in str(error)
    refused(fields, location.as_uri())
    refused(fields, None)  # the default location, under AIRFLOW_HOME
    # ``..`` through the location, the location itself, a symlink out of it, other schemes.
    sneaky = f"{location.as_uri()}/../results-other/{key}/result.pkl"
    refused({**fields, "value_uri": sneaky}, str(location))
    refused({**fields, "value_uri": str(location)}, str(location))
    location.mkdir()
    (location / "link").symlink_to(other, target_is_directory=True)
    refused({**fields, "value_uri": f"{location.as_uri()}/link/{key}/result.pkl"}, str(location))
    refused({**fields, "value_uri": f"memory://{other}/{key}/result.pkl"}, str(location))
    refused(fields, "memory://results-other")
    assert not marker.exists()

    # The writer's location reads it, as a path or as a file:// URL.
    assert load_result(fields, result_location=str(other)) is None
    assert marker.exists()
    os.remove(marker)
    assert load_result(fields, result_location=other.as_uri()) is None
    assert marker.exists()


def test_memory_uris_are_fenced_by_scheme_and_prefix(tmp_path: Path) -> None:
    location = f"memory://sto-fence-{tmp_path.name}"
    key = result_key("dag", "run", "t", -1, 1)
    fields = stored({"s": {1}}, location, key)
    assert fields["value_uri"] == f"{location}/{key}/result.pkl"
    assert load_result(fields, result_location=location) == {"s": {1}}
    assert load_result(fields, result_location=f"memory:///sto-fence-{tmp_path.name}") == {"s": {1}}
    for outside in [
        f"{location}-other",
        f"{location}/dag/other",
        f"s3://sto-fence-{tmp_path.name}",
    ]:
        with pytest.raises(ConfigError, match="is not under the result location"):
            load_result(fields, result_location=outside)
    for uri in [f"{location}/{key}/../../x/result.pkl", f"{location}/{key}/%2e%2e/result.pkl"]:
        with pytest.raises(ConfigError, match="is not under the result location"):
            load_result({**fields, "value_uri": uri}, result_location=location)
