"""Code shipping: what ``prepare`` packs, what a rank unpacks, and where it runs from."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from sparktorch_ops.driver.packing import prepare
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.wire.payload import (
    Script,
    materialize,
    read_rank_payload,
    write_rank_payload,
)

# --- prepare: functions ------------------------------------------------------------------------


@pytest.mark.parametrize("obj", [42, None, b"train.py", ["train.py"]])
def test_neither_callable_nor_path_is_a_config_error(obj: object) -> None:
    with pytest.raises(ConfigError, match="must be a callable") as info:
        prepare(obj, [], {})
    assert info.value.argument == "train_object"
    assert type(obj).__name__ in str(info.value)


# --- prepare: scripts --------------------------------------------------------------------------


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "train.py"
    path.parent.mkdir()
    path.write_text("import sys\nprint('argv', sys.argv[1:])\n")
    return path


@pytest.mark.parametrize("as_str", [True, False])
def test_a_script_becomes_its_bytes_and_string_argv(script: Path, as_str: bool) -> None:
    payload = prepare(str(script) if as_str else script, [1, 2.5, "--lr=0.1", Path("x")], {})
    assert isinstance(payload, Script)
    assert payload.driver_path == str(script.resolve())
    assert payload.source == script.read_bytes()
    assert payload.argv == ("1", "2.5", "--lr=0.1", "x")


def test_a_relative_script_path_is_resolved(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(script.parent)
    payload = prepare("train.py", [], {})
    assert isinstance(payload, Script)
    assert payload.driver_path == str(script.resolve())


def test_the_script_bytes_are_taken_at_prepare_time(script: Path) -> None:
    original = script.read_bytes()
    payload = prepare(script, [], {})
    script.write_text("raise SystemExit('edited after prepare')\n")
    assert isinstance(payload, Script) and payload.source == original


def test_a_missing_script_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.py"
    with pytest.raises(ConfigError, match="does not exist") as info:
        prepare(str(missing), [], {})
    assert info.value.argument == "train_object"
    assert "nope.py" in str(info.value)


def test_a_directory_is_not_a_script(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        prepare(tmp_path, [], {})
    assert info.value.argument == "train_object"


def test_kwargs_with_a_script_are_a_config_error(script: Path) -> None:
    with pytest.raises(ConfigError, match="command-line arguments") as info:
        prepare(script, ["--a=1"], {"lr": 0.1, "epochs": 2})
    assert info.value.argument == "kwargs"
    assert "['epochs', 'lr']" in str(info.value)


# --- what a rank reads -------------------------------------------------------------------------


def test_a_script_in_place_runs_where_it_is(script: Path, tmp_path: Path) -> None:
    rank_dir = tmp_path / "rank"
    rank_dir.mkdir()
    record = materialize(prepare(script, ["--x=1"], {}), str(rank_dir), in_place=True)
    assert record == {"kind": "script", "path": str(script.resolve()), "argv": ["--x=1"]}
    assert list(rank_dir.iterdir()) == []


def test_a_script_not_in_place_is_written_into_the_directory(script: Path, tmp_path: Path) -> None:
    payload = prepare(script, [3], {})
    source = script.read_bytes()
    script.unlink()  # the rank's node need not have it
    rank_dir = tmp_path / "rank"
    rank_dir.mkdir()
    record = materialize(payload, str(rank_dir), in_place=False)
    assert record == {"kind": "script", "path": str(rank_dir / "train.py"), "argv": ["3"]}
    assert (rank_dir / "train.py").read_bytes() == source


@pytest.mark.parametrize("in_place", [True, False])
def test_rank_payload_file_round_trips(script: Path, tmp_path: Path, in_place: bool) -> None:
    rank_dir = tmp_path / "rank"
    rank_dir.mkdir()
    payload = prepare(script, ["a", 1], {})
    path = write_rank_payload(payload, str(rank_dir), in_place=in_place)
    assert path == str(rank_dir / "payload.pkl")
    record = read_rank_payload(path)
    assert record == materialize(payload, str(tmp_path / "unused"), in_place=True) | (
        {} if in_place else {"path": str(rank_dir / "train.py")}
    )
    written = sorted(p.name for p in rank_dir.iterdir())
    assert written == (["payload.pkl"] if in_place else ["payload.pkl", "train.py"])
    # The record is plain pickle: a rank reads it without cloudpickle.
    with open(path, "rb") as handle:
        assert pickle.load(handle) == record
