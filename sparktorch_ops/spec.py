"""The launch spec: every launch option, validated once, frozen.

Validation errors are :class:`~sparktorch_ops.errors.ConfigError` naming the offending argument.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from sparktorch_ops import options
from sparktorch_ops.driver.durable import TrainingTry
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.options import DEFAULT_MAX_RESULT_BYTES
from sparktorch_ops.wire.env import TORCHRUN_RANK_VARIABLES

# Local mode starts at most this many ranks per CPU of the driver by default
# (max_local_processes=): more is a typo or a runaway loop, not a plan.
LOCAL_PROCESSES_PER_CPU = 4

# torchrun options (by their parser's dest) that the distributor owns: the layout, the
# rendezvous and the entry point.
_OWNED_TORCHRUN_DESTS = frozenset(
    {"nnodes", "nproc_per_node", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id"}
    | {"rdzv_conf", "standalone", "master_addr", "master_port", "max_restarts", "local_addr"}
    | {"no_python", "run_path", "module"}
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def to_seconds(argument: str, value: float | datetime.timedelta | None) -> float | None:
    """Normalise a timeout given as seconds or a timedelta; ``None`` means no limit."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ConfigError(
            argument, f"must be seconds (a number) or a datetime.timedelta, got {value!r}"
        )
    if not seconds > 0:
        raise ConfigError(argument, f"must be positive, got {value!r}")
    return seconds


def _require_bool(argument: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(argument, f"must be True or False, got {value!r}")
    return value


def _require_int(argument: str, value: object, minimum: int) -> int:
    # "positive" is the word pyspark's TorchDistributor uses for num_processes < 1.
    wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(argument, f"must be {wanted}, got {value!r}")
    if value < minimum:
        raise ConfigError(argument, f"must be {wanted}, got {value}")
    return value


def _check_env(env: Mapping[str, str] | None) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ConfigError("env", f"must be a mapping of str to str, got {type(env).__name__}")
    checked: dict[str, str] = {}
    for key, value in env.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise ConfigError("env", f"{key!r} is not a valid environment variable name")
        if key in TORCHRUN_RANK_VARIABLES:
            raise ConfigError(
                "env", f"{key} is set by torchrun for each rank and cannot be overridden"
            )
        if not isinstance(value, str):
            raise ConfigError("env", f"the value of {key} must be a str, got {value!r}")
        if "\x00" in value:
            raise ConfigError("env", f"the value of {key} contains a NUL byte")
        checked[key] = value
    return checked


_SCRIPT_SLOT = "<sparktorch_ops: the entry point>"


def _torchrun_parser_error(message: str) -> NoReturn:
    raise ConfigError(
        "torchrun_args", f"torchrun cannot parse them ({message}); give options with their values"
    )


def _check_torchrun_args(args: Iterable[str] | None) -> tuple[str, ...]:
    """Check the user's torchrun options with torchrun's own parser.

    torchrun's parser takes abbreviations (``--nnode=3``) and the last value wins, so a plain
    name check is not enough: every item is parsed as torchrun would parse it, and one that
    resolves to an option the distributor owns, a positional (it would replace our entry
    point), or an option without its value is a ConfigError naming it. The parser (and torch)
    is imported only when there are arguments to check.
    """
    if args is None:
        return ()
    if isinstance(args, str):
        raise ConfigError("torchrun_args", "must be a list of arguments, not one string")
    checked = tuple(args)
    for arg in checked:
        if not isinstance(arg, str):
            raise ConfigError("torchrun_args", f"every argument must be a str, got {arg!r}")
        if "\x00" in arg:
            raise ConfigError("torchrun_args", f"{arg!r} contains a NUL byte")
    if not checked:
        return ()
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.error = _torchrun_parser_error  # type: ignore[method-assign]
    unset = object()  # the default of every owned option while the user's are parsed
    owned = {a.dest: a.option_strings for a in parser._actions if a.dest in _OWNED_TORCHRUN_DESTS}
    parser.set_defaults(**dict.fromkeys(owned, unset))
    try:
        parsed = parser.parse_args([*checked, _SCRIPT_SLOT])
    except SystemExit:  # argparse exits on some errors despite error(); never ours to exit
        _torchrun_parser_error("invalid arguments")
    for dest, option_strings in owned.items():
        if getattr(parsed, dest) is not unset:
            hint = " (use max_restarts=)" if dest == "max_restarts" else ""
            raise ConfigError(
                "torchrun_args",
                f"{checked} set {option_strings[0]}, which the distributor sets from "
                f"num_processes, local_mode and the cluster; remove it{hint}",
            )
    if parsed.training_script != _SCRIPT_SLOT or parsed.training_script_args:
        raise ConfigError(
            "torchrun_args",
            f"{checked} holds a positional argument or an option missing its value; "
            "torchrun_args takes torchrun options only (the entry point is the distributor's)",
        )
    return checked


def _check_log_ranks(log_ranks: Iterable[int] | None) -> frozenset[int] | None:
    if log_ranks is None:
        return None
    try:
        ranks = frozenset(log_ranks)
    except TypeError:
        raise ConfigError(
            "log_ranks", f"must be a collection of ranks, got {log_ranks!r}"
        ) from None
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError("log_ranks", f"ranks must be ints >= 0, got {rank!r}")
    return ranks


def _check_local_processes(num_processes: int, max_local_processes: int | None) -> None:
    cpus = os.cpu_count()
    limit = max_local_processes or LOCAL_PROCESSES_PER_CPU * (cpus or 1)
    if num_processes <= limit:
        return
    why = (
        f"max_local_processes={max_local_processes}"
        if max_local_processes is not None
        else f"the local-mode limit of {LOCAL_PROCESSES_PER_CPU} per CPU, this machine has "
        f"{cpus or 1} CPUs"
    )
    raise ConfigError(
        "num_processes",
        f"{num_processes} ranks in local mode is more than {limit} ({why}); pass "
        "max_local_processes= to allow more, or local_mode=False to run on the Spark cluster",
    )


def check_location(argument: str, value: object, *, must_exist: bool = False) -> str | None:
    """A checkpoint location: an absolute local path (made so on the driver, since executors
    have other working directories) or an fsspec URL whose protocol is installed.

    Raises:
        ConfigError: not a path or URL, an fsspec protocol without its package, or (with
            ``must_exist``) a local path that does not exist.
    """
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(argument, f"must be a path or an fsspec URL, got {value!r}")
    value = value.strip()
    if "://" in value:
        protocol = value.split("://", 1)[0]
        import fsspec

        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            raise ConfigError(
                argument,
                f"{value!r}: fsspec cannot open {protocol}:// URLs here ({exc}); install its "
                "package on the driver and every executor (s3fs, gcsfs, adlfs, ...)",
            ) from None
        return value
    path = os.path.abspath(os.path.expanduser(value))
    if must_exist and not os.path.exists(path):
        raise ConfigError(
            argument, f"{path} does not exist: give a checkpoint directory or a model file"
        )
    return path


def _check_host(argument: str, value: object) -> str | None:
    """A host name or IP address (no port, no scheme), stripped; None stays None."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(argument, f"must be a host name or IP address, got {value!r}")
    host = value.strip().strip("[]")
    if any(c in host for c in "/ \t@") or (host.count(":") == 1):
        raise ConfigError(
            argument,
            f"{value!r} is not a host name or IP address (give the host alone, without a "
            "scheme or port: the channel's port is chosen per run)",
        )
    return host


@options.documented("job")
@dataclass(frozen=True)
class LaunchSpec:
    """Every option of a launch, validated at construction.

    Attributes:
        <launch options>
    """

    num_processes: int = 1
    local_mode: bool = True
    use_gpu: bool = True
    env: Mapping[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    max_failures: int = 0
    min_processes: int | None = None
    torchrun_args: tuple[str, ...] = ()
    start_timeout: float | None = None
    timeout: float | None = None
    stall_timeout: float | None = None
    log_ranks: frozenset[int] | None = None
    logger: Any = None
    on_metrics: Callable[[Any], None] | None = None
    on_event: Callable[[Any], None] | None = None
    allow_unencrypted_channel: bool = False
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    max_local_processes: int | None = None
    checkpoint_dir: str | None = None
    warm_start_from: str | None = None
    mlflow_experiment: str | None = None
    mlflow_tracking_uri: str | None = None
    mlflow_all_ranks: bool = False
    mlflow_tags: Mapping[str, str] = field(default_factory=dict)
    channel_host: str | None = None
    detached: bool = False
    run_dir: str | None = None
    training: TrainingTry | None = None

    def __post_init__(self) -> None:
        def coerce(name: str, check: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
            object.__setattr__(self, name, check(name, getattr(self, name), *args, **kwargs))

        _require_int("num_processes", self.num_processes, 1)
        for name in ("local_mode", "use_gpu", "allow_unencrypted_channel", "detached"):
            _require_bool(name, getattr(self, name))
        _require_int("max_restarts", self.max_restarts, 0)
        _require_int("max_failures", self.max_failures, 0)
        if self.min_processes is not None:
            _require_int("min_processes", self.min_processes, 1)
            if self.min_processes > self.num_processes:
                raise ConfigError(
                    "min_processes",
                    f"{self.min_processes} is more than num_processes={self.num_processes}: "
                    "an attempt never runs with more ranks than num_processes",
                )
        _require_int("max_result_bytes", self.max_result_bytes, 1)
        if self.max_local_processes is not None:
            _require_int("max_local_processes", self.max_local_processes, 1)
        if self.local_mode:
            _check_local_processes(self.num_processes, self.max_local_processes)
        object.__setattr__(self, "env", _check_env(self.env))
        object.__setattr__(self, "torchrun_args", _check_torchrun_args(self.torchrun_args))
        for name in ("start_timeout", "timeout", "stall_timeout"):
            coerce(name, to_seconds)
        object.__setattr__(self, "log_ranks", _check_log_ranks(self.log_ranks))
        coerce("checkpoint_dir", check_location)
        for name in ("mlflow_experiment", "mlflow_tracking_uri"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(name, f"must be a non-empty string or None, got {value!r}")
        _require_bool("mlflow_all_ranks", self.mlflow_all_ranks)
        coerce("channel_host", _check_host)
        coerce("run_dir", check_location)
        if not isinstance(self.mlflow_tags, Mapping):
            raise ConfigError("mlflow_tags", f"must be a mapping, got {self.mlflow_tags!r}")
        object.__setattr__(
            self, "mlflow_tags", {str(k): str(v) for k, v in self.mlflow_tags.items()}
        )
        coerce("warm_start_from", check_location, must_exist=True)
        if self.training is not None and not isinstance(self.training, TrainingTry):
            raise ConfigError("training", f"must be a TrainingTry, got {self.training!r}")
        for name in ("on_metrics", "on_event"):
            hook = getattr(self, name)
            if hook is not None and not callable(hook):
                raise ConfigError(name, f"must be callable, got {hook!r}")
        if self.logger is not None and not callable(getattr(self.logger, "log", None)):
            raise ConfigError(
                "logger",
                "must be a logging.Logger, a LoggerAdapter or any object with a "
                f"log(level, msg, *args) method (structlog's, Airflow's), got {self.logger!r}",
            )

    @property
    def fewest_processes(self) -> int:
        """The fewest ranks an attempt may run with (``min_processes``, else all of them)."""
        return self.num_processes if self.min_processes is None else self.min_processes

    @property
    def tracked(self) -> bool:
        """Whether the run is tracked in MLflow."""
        return self.mlflow_experiment is not None or self.mlflow_tracking_uri is not None

    @property
    def mode(self) -> str:
        """``"local"`` or ``"barrier"``."""
        return "local" if self.local_mode else "barrier"
