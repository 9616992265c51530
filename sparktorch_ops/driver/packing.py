"""Code shipping on the driver: what a rank runs, checked and packed.

Functions travel with pyspark's copy of cloudpickle, which every Python that runs pyspark's
workers has, so the executors need no cloudpickle of their own
(:mod:`sparktorch_ops.rank.pickling`). A function whose module the ranks cannot import
(``__main__``, an Airflow DAG file, a Prefect flow file, a test file: anything outside
site-packages and the standard library) is pickled by value, together with the other such
modules it references. Scripts travel as their bytes, so they need not exist on the executors
(:mod:`sparktorch_ops.wire.payload`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import shlex
import sys
import sysconfig
import threading
import types
from collections import ChainMap
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparktorch_ops.errors import ConfigError
from sparktorch_ops.rank.pickling import cloudpickle_module
from sparktorch_ops.wire.payload import FunctionCall, Payload, Script

_MAX_BY_VALUE_MODULES = 64
# Registrations made here, by (pickler, module): runs in several threads share one, and the
# last to leave removes it.
_BY_VALUE_LOCK = threading.Lock()
_BY_VALUE_USERS: dict[tuple[str, str], int] = {}


@contextlib.contextmanager
def pickled_by_value(pickler: types.ModuleType, module: types.ModuleType) -> Iterator[None]:
    """Pickle ``module`` by value with ``pickler`` (cloudpickle, or pyspark's copy of it) while
    the block runs.

    The registry is process-global: concurrent runs share a registration (counted), and one
    the caller made before stays as it was.
    """
    key = (pickler.__name__, module.__name__)
    with _BY_VALUE_LOCK:
        users = _BY_VALUE_USERS.get(key, 0)
        ours = users > 0 or module.__name__ not in pickler.list_registry_pickle_by_value()
        if ours:
            if users == 0:
                pickler.register_pickle_by_value(module)
            _BY_VALUE_USERS[key] = users + 1
    try:
        yield
    finally:
        if ours:
            with _BY_VALUE_LOCK:
                _BY_VALUE_USERS[key] -= 1
                if _BY_VALUE_USERS[key] == 0:
                    del _BY_VALUE_USERS[key]
                    pickler.unregister_pickle_by_value(module)


@dataclass(frozen=True)
class ArgumentNames:
    """What the caller calls the train object and its arguments, for error messages."""

    train: str = "train_object"
    args: str = "args"
    kwargs: str = "kwargs"


#: The names of the orchestrator wrappers' parameters.
WRAPPER_NAMES = ArgumentNames("train", "train_args", "train_kwargs")


def check_train(
    train_object: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    names: ArgumentNames = ArgumentNames(),
) -> Callable[..., Any] | Path:
    """The one check of "a callable, or an existing script that takes no kwargs".

    Returns:
        The callable, or the script's resolved path.

    Raises:
        ConfigError: naming the argument: a missing script, kwargs for a script, arguments
            that are not a sequence, or an object that is neither callable nor a path.
    """
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise ConfigError(names.args, f"must be a list or tuple of arguments, got {args!r}")
    if not isinstance(kwargs, Mapping):
        raise ConfigError(names.kwargs, f"must be a mapping or None, got {kwargs!r}")
    if callable(train_object):
        return train_object
    if isinstance(train_object, (str, os.PathLike)):
        path = Path(train_object).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(
                names.train,
                f"the script {os.fspath(train_object)!r} does not exist (resolved: {path}, "
                f"working directory {os.getcwd()})",
            )
        if kwargs:
            raise ConfigError(
                names.kwargs,
                f"a script takes command-line arguments only; pass {sorted(kwargs)} as "
                f"'--name=value' strings in {names.args}",
            )
        return path
    raise ConfigError(
        names.train,
        f"must be a callable or the path of a Python script, got {type(train_object).__name__}",
    )


def prepare(
    train_object: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    names: ArgumentNames = ArgumentNames(),
) -> Payload:
    """Check and pack what the ranks will run; every problem is a ConfigError up front.

    Raises:
        ConfigError: as :func:`check_train`, or a function (or its arguments) that cannot be
            pickled.
    """
    checked = check_train(train_object, args, kwargs, names)
    if isinstance(checked, Path):
        return Script(str(checked), checked.read_bytes(), tuple(str(a) for a in args))
    target = getattr(checked, "func", checked)  # functools.partial
    name = str(getattr(target, "__qualname__", None) or type(target).__name__)
    return FunctionCall(pickle_call(checked, tuple(args), dict(kwargs), names.train), name)


def describe(payload: Payload) -> str:
    """What a run runs, in a few words: ``"train (function)"``, ``"/x/train.py (script)"``."""
    if isinstance(payload, Script):
        return f"{shlex.join([payload.driver_path, *payload.argv])} (script)"
    return f"{payload.name} (function)"


def pickle_call(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    argument: str = "train_object",
) -> bytes:
    """cloudpickle ``(fn, args, kwargs)``, shipping non-importable user modules by value."""
    cloudpickle = cloudpickle_module()
    modules = _user_modules(fn)
    try:
        with contextlib.ExitStack() as registrations:
            for module in modules:
                registrations.enter_context(pickled_by_value(cloudpickle, module))
            buffer = io.BytesIO()
            _pickler()(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((fn, args, kwargs))
            return buffer.getvalue()
    except Exception as exc:
        raise ConfigError(
            argument,
            f"{getattr(fn, '__qualname__', fn)!r} or its arguments cannot be pickled for "
            f"the ranks: {type(exc).__name__}: {exc}",
        ) from exc


@functools.cache
def _pickler() -> type[pickle.Pickler]:
    """The ranks' cloudpickle Pickler, keeping each code object's file name: cloudpickle
    blanks it, and a rank's traceback then names the real file (and shows its lines wherever
    that file exists)."""
    cloudpickle = cloudpickle_module()

    # cloudpickle 3 (pyspark 4) keeps its reducers in cloudpickle.py, 2.2 (pyspark 3.5) in
    # cloudpickle_fast.py.
    reducers = getattr(cloudpickle, "cloudpickle_fast", cloudpickle.cloudpickle)
    code_reduce = getattr(cloudpickle.cloudpickle, "_code_reduce", None) or reducers._code_reduce

    def keeping_filename(code: types.CodeType) -> Any:
        constructor, args = code_reduce(code)
        return constructor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)

    base: Any = cloudpickle.Pickler

    class Pickler(base):
        dispatch_table = ChainMap(  # noqa: RUF012 (pickle.Pickler reads it per instance)
            {types.CodeType: keeping_filename}, base.dispatch_table
        )

    return Pickler


def _installed_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    prefixes = {
        paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths
    }
    prefixes.update(p for p in sys.path if "site-packages" in p or "dist-packages" in p)
    return tuple(os.path.realpath(p) + os.sep for p in prefixes)


def _is_user_module(module: types.ModuleType, installed: tuple[str, ...]) -> bool:
    if module.__name__.split(".")[0] in ("sparktorch_ops", "cloudpickle", "pyspark"):
        return False  # the run ships our own package; pyspark is where its workers run
    file = getattr(module, "__file__", None)
    if not file:
        return False
    return not os.path.realpath(file).startswith(installed)


def _user_modules(fn: Any) -> list[types.ModuleType]:
    """Modules outside site-packages reachable from ``fn``, walking their globals.

    ``__main__`` is walked but not returned: cloudpickle ships its code by value anyway.
    """
    installed = _installed_prefixes()
    seen: set[str] = set()
    found: list[types.ModuleType] = []
    to_walk: list[types.ModuleType] = []

    def visit(obj: Any) -> None:
        if isinstance(obj, types.ModuleType):
            module: types.ModuleType | None = obj
        else:
            module = sys.modules.get(getattr(obj, "__module__", None) or "")
        if module is None or module.__name__ in seen:
            return
        seen.add(module.__name__)
        if module.__name__ == "__main__":
            to_walk.append(module)
        elif _is_user_module(module, installed):
            found.append(module)
            to_walk.append(module)

    target = getattr(fn, "func", fn)  # functools.partial
    visit(target)
    visit(type(target))
    while to_walk and len(found) < _MAX_BY_VALUE_MODULES:
        for value in list(vars(to_walk.pop()).values()):
            if isinstance(value, (types.ModuleType, types.FunctionType, type)):
                visit(value)
    return found
