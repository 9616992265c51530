"""Code shipping: what ``prepare`` packs, what a rank unpacks, and where it runs from."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest

from sparktorch_ops.driver.packing import pickle_call, pickled_by_value, prepare
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.wire.payload import (
    FunctionCall,
    Script,
    materialize,
    read_rank_payload,
    write_rank_payload,
)


def add(a: int, b: int = 1, *, scale: int = 1) -> int:
    return (a + b) * scale


def _unpickle_call(data: bytes) -> object:
    fn, args, kwargs = cloudpickle.loads(data)
    return fn(*args, **kwargs)


def _run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with ``cwd`` as its only extra sys.path entry."""
    env = dict(os.environ)
    env.pop("PYTHONSTARTUP", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


# --- prepare: functions ------------------------------------------------------------------------


def test_a_callable_becomes_a_function_call_that_round_trips() -> None:
    payload = prepare(add, [2], {"b": 3, "scale": 10})
    assert isinstance(payload, FunctionCall)
    fn, args, kwargs = cloudpickle.loads(payload.data)
    assert args == (2,) and kwargs == {"b": 3, "scale": 10}
    assert fn(*args, **kwargs) == 50


def test_closures_lambdas_and_partials_travel() -> None:
    factor = 7
    assert _unpickle_call(prepare(lambda x: x * factor, (3,), {}).data) == 21  # type: ignore[attr-defined]
    partial = functools.partial(add, 1, scale=3)
    assert _unpickle_call(prepare(partial, [2], {}).data) == 9  # type: ignore[attr-defined]


def test_pickle_call_returns_bytes_of_fn_args_kwargs() -> None:
    data = pickle_call(add, (4,), {"b": 0})
    assert isinstance(data, bytes)
    assert _unpickle_call(data) == 4


def test_a_function_over_a_lock_is_a_config_error() -> None:
    lock = threading.Lock()

    def train() -> None:
        with lock:
            pass

    with pytest.raises(ConfigError, match="cannot be pickled") as info:
        prepare(train, [], {})
    assert info.value.argument == "train_object"
    assert "lock" in str(info.value).lower()


def test_unpicklable_arguments_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot be pickled") as info:
        prepare(add, [threading.Lock()], {})
    assert info.value.argument == "train_object"


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


# --- by-value shipping of modules the ranks cannot import ---------------------------------------


@pytest.fixture
def driver_only_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[object, Path]]:
    """Two modules in a directory on this process's sys.path only; the first uses the second."""
    suffix = uuid.uuid4().hex[:8]
    lib = tmp_path / "driver_only"
    lib.mkdir()
    helper, main = f"shiphelper_{suffix}", f"shipmain_{suffix}"
    (lib / f"{helper}.py").write_text("OFFSET = 100\ndef scale(x):\n    return x * 10\n")
    main_file = lib / f"{main}.py"
    main_file.write_text(
        f"import {helper}\n"
        "def train(x, *, extra=0):\n"
        f"    return {helper}.scale(x) + {helper}.OFFSET + extra\n"
        "def fail():\n"
        "    raise RuntimeError('failing on purpose')  # the line a traceback shows\n"
    )
    monkeypatch.syspath_prepend(str(lib))
    try:
        yield importlib.import_module(main), main_file
    finally:
        for name in (helper, main):
            sys.modules.pop(name, None)


def test_a_module_outside_site_packages_is_shipped_by_value(
    driver_only_modules: tuple[object, Path], tmp_path: Path
) -> None:
    module, main_file = driver_only_modules
    data = pickle_call(module.train, (4,), {"extra": 1})  # type: ignore[attr-defined]
    (tmp_path / "call.pkl").write_bytes(data)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _run_python(
        f"""
        import importlib.util, pickle
        assert importlib.util.find_spec({module.__name__!r}) is None, "module importable here"
        fn, args, kwargs = pickle.load(open({str(tmp_path / "call.pkl")!r}, "rb"))
        print("RESULT", fn(*args, **kwargs), fn.__code__.co_filename)
        """,
        cwd=elsewhere,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["RESULT", "141", str(main_file)]


def test_a_shipped_function_keeps_its_file_in_tracebacks(
    driver_only_modules: tuple[object, Path], tmp_path: Path
) -> None:
    module, main_file = driver_only_modules
    (tmp_path / "call.pkl").write_bytes(pickle_call(module.fail, (), {}))  # type: ignore[attr-defined]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _run_python(
        f"""
        import pickle
        fn, args, kwargs = pickle.load(open({str(tmp_path / "call.pkl")!r}, "rb"))
        fn(*args, **kwargs)
        """,
        cwd=elsewhere,
    )
    assert proc.returncode != 0
    assert "RuntimeError: failing on purpose" in proc.stderr
    assert f'File "{main_file}", line 5, in fail' in proc.stderr
    assert "the line a traceback shows" in proc.stderr  # the file exists here: its line shows


def test_co_filename_is_kept_for_functions_of_test_files() -> None:
    fn, _, _ = cloudpickle.loads(prepare(add, [1], {}).data)  # type: ignore[attr-defined]
    assert fn is not add  # shipped by value: this file is outside site-packages
    assert fn.__code__.co_filename == __file__
    assert fn(2) == 3


def test_shipping_by_value_leaves_no_registration_behind(
    driver_only_modules: tuple[object, Path],
) -> None:
    module, _ = driver_only_modules
    pickle_call(module.train, (1,), {})  # type: ignore[attr-defined]
    assert module.__name__ not in cloudpickle.list_registry_pickle_by_value()  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="not registered"):
        cloudpickle.unregister_pickle_by_value(module)  # type: ignore[arg-type]


def test_a_callers_own_by_value_registration_survives(
    driver_only_modules: tuple[object, Path],
) -> None:
    module, _ = driver_only_modules
    name = module.__name__  # type: ignore[attr-defined]
    cloudpickle.register_pickle_by_value(module)  # type: ignore[arg-type]
    try:
        pickle_call(module.train, (1,), {})  # type: ignore[attr-defined]
        assert name in cloudpickle.list_registry_pickle_by_value()
    finally:
        with contextlib.suppress(ValueError):
            cloudpickle.unregister_pickle_by_value(module)  # type: ignore[arg-type]


def test_overlapping_runs_share_a_by_value_registration_until_the_last_leaves(
    driver_only_modules: tuple[object, Path],
) -> None:
    """Two runs in two threads register the same module: the first to finish must not take
    it away from the other (the registry is process-global)."""
    module, _ = driver_only_modules
    name = module.__name__  # type: ignore[attr-defined]
    first = pickled_by_value(cloudpickle, module)  # type: ignore[arg-type]
    second = pickled_by_value(cloudpickle, module)  # type: ignore[arg-type]
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert name in cloudpickle.list_registry_pickle_by_value()
    second.__exit__(None, None, None)
    assert name not in cloudpickle.list_registry_pickle_by_value()


def test_packing_from_many_threads_at_once_leaves_every_pickle_by_value(
    driver_only_modules: tuple[object, Path],
) -> None:
    module, main_file = driver_only_modules
    pickled: list[bytes] = []
    errors: list[BaseException] = []

    def pack() -> None:
        try:
            for _ in range(20):
                pickled.append(pickle_call(module.train, (1,), {}))  # type: ignore[attr-defined]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=pack) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(pickled) == 80
    # By value every time: the bytes carry the function's code (with its file name), not a
    # reference to a module the ranks cannot import.
    assert all(str(main_file).encode() in data for data in pickled)
    assert module.__name__ not in cloudpickle.list_registry_pickle_by_value()  # type: ignore[attr-defined]


# --- what a rank reads -------------------------------------------------------------------------


def test_a_function_call_materializes_as_its_bytes(tmp_path: Path) -> None:
    payload = prepare(add, [1], {})
    for in_place in (True, False):
        record = materialize(payload, str(tmp_path), in_place=in_place)
        assert record == {"kind": "function", "data": payload.data}  # type: ignore[union-attr]
    assert list(tmp_path.iterdir()) == []


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


def test_function_rank_payload_runs_after_reading(tmp_path: Path) -> None:
    path = write_rank_payload(prepare(add, [5], {"scale": 2}), str(tmp_path), in_place=False)
    record = read_rank_payload(path)
    assert record["kind"] == "function"
    assert _unpickle_call(record["data"]) == 12
