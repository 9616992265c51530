"""Packing a function for the ranks: pyspark's cloudpickle, user modules by value, file names
kept, the by-value registry shared by concurrent runs (pyspark's pickler: integration tier)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark import cloudpickle

from sparktorch_ops.driver.packing import pickle_call, pickled_by_value, prepare
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.job import TrainingJob
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire.payload import (
    FunctionCall,
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


def test_a_function_job_is_validated_and_packed_once() -> None:
    job = TrainingJob(add, [1], {"b": 2}, LaunchSpec(num_processes=2, use_gpu=False))
    assert isinstance(job.payload, FunctionCall) and job.payload.name == "add"
    assert job.args == (1,) and job.mode == "local"


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
        import importlib.util, pickle, sys
        sys.modules["cloudpickle"] = None  # an executor need not have cloudpickle itself
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


def test_a_function_call_materializes_as_its_bytes(tmp_path: Path) -> None:
    payload = prepare(add, [1], {})
    for in_place in (True, False):
        record = materialize(payload, str(tmp_path), in_place=in_place)
        assert record == {"kind": "function", "data": payload.data}  # type: ignore[union-attr]
    assert list(tmp_path.iterdir()) == []


def test_function_rank_payload_runs_after_reading(tmp_path: Path) -> None:
    path = write_rank_payload(prepare(add, [5], {"scale": 2}), str(tmp_path), in_place=False)
    record = read_rank_payload(path)
    assert record["kind"] == "function"
    assert _unpickle_call(record["data"]) == 12
