"""The one job model: what to train, how to launch it, where Spark is, and how to stop it.

A :class:`TrainingJob` is validated once, at construction, with typed errors naming the
argument: the train object and its arguments (and packed for the ranks), the launch options
(:class:`~sparktorch_ops.spec.LaunchSpec`) and the Spark settings
(:class:`~sparktorch_ops.spark.session.SparkSettings`). ``TorchDistributor.run`` builds one from its
arguments; the Airflow operator and the Prefect task build one with :func:`build_job` from their
(rendered) parameters and hand it to :func:`sparktorch_ops.distributor.launch_job`. Nobody
validates twice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from sparktorch_ops import options as launch_options
from sparktorch_ops.driver.packing import WRAPPER_NAMES, ArgumentNames, prepare
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.spark.dataframe import DataInput
from sparktorch_ops.spark.session import SparkSettings
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire.payload import Payload


class CancelToken:
    """A request to stop one job, made before, during or after its launch; while the job's
    ranks run, also the way to ask where they are (:meth:`stacks`).

    A wrapper creates it first and passes it into the job, so a cancel that arrives while the
    wrapper is still templating or starting Spark is not lost; the run checks it throughout.
    ``cancel`` only sets an attribute: safe from a signal handler and from any thread.
    """

    def __init__(self) -> None:
        self._reason: str | None = None
        self.run_id: str | None = None  # while the ranks run
        self._stacks: Callable[[], dict[int, str]] | None = None

    def attach(self, run_id: str, stacks: Callable[[], dict[int, str]]) -> None:
        """The run's ranks are up: :meth:`stacks` asks them through ``stacks``."""
        self.run_id, self._stacks = run_id, stacks

    def detach(self) -> None:
        """The run's ranks are gone."""
        self.run_id, self._stacks = None, None

    def stacks(self) -> dict[int, str] | None:
        """Every rank's stacks now, by rank; None when the ranks are not running."""
        stacks = self._stacks
        return stacks() if stacks is not None else None

    def cancel(self, reason: str = "cancel() was called") -> None:
        """Ask the job to stop (the first reason is kept)."""
        if self._reason is None:
            self._reason = reason

    @property
    def reason(self) -> str | None:
        """Why the job was cancelled, or None."""
        return self._reason

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel`` was called."""
        return self._reason is not None


@dataclass(frozen=True, eq=False)
class TrainingJob:
    """One training job, validated and packed.

    Attributes:
        train: the training function, or the path of a script.
        args: the function's positional arguments, or the script's argv.
        kwargs: the function's keyword arguments (none for a script).
        options: the launch options.
        spark: where the Spark session of a barrier-mode run comes from.
        cancel_token: cancels this job whenever it is called.
        names: what the caller calls train/args/kwargs (for error messages).
        data: what the ranks train on, as shards of a DataFrame (None: no DataFrame input).
        payload: what the ranks run (packed at construction).
    """

    train: Callable[..., Any] | str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    options: LaunchSpec = field(default_factory=LaunchSpec)
    spark: SparkSettings = field(default_factory=SparkSettings)
    cancel_token: CancelToken = field(default_factory=CancelToken, compare=False)
    names: ArgumentNames = field(default_factory=ArgumentNames, repr=False)
    data: DataInput | None = None
    payload: Payload = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.options, LaunchSpec):
            raise ConfigError("options", f"must be a LaunchSpec, got {self.options!r}")
        if not isinstance(self.spark, SparkSettings):
            raise ConfigError("spark", f"must be SparkSettings, got {self.spark!r}")
        if self.data is not None and not isinstance(self.data, DataInput):
            raise ConfigError("data", f"must be a DataInput, got {self.data!r}")
        object.__setattr__(self, "payload", prepare(self.train, self.args, self.kwargs, self.names))
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "kwargs", dict(self.kwargs))

    @property
    def mode(self) -> str:
        """``"local"`` or ``"barrier"``."""
        return self.options.mode


def build_job(
    *,
    train: Callable[..., Any] | str,
    train_args: Sequence[Any] | None = None,
    train_kwargs: Mapping[str, Any] | None = None,
    spark: SparkSettings | None = None,
    cancel_token: CancelToken | None = None,
    data: DataInput | None = None,
    **options: Any,
) -> TrainingJob:
    """A job from an orchestrator's parameters, after templating.

    The one place where rendered template strings are coerced: ``num_processes`` (and the
    other counts) given as ``"2"``, a script path with blanks around it, ``env`` values that
    are numbers, and a templated option that renders to an empty string (unset: None).
    Everything else is the job's own validation; errors name the wrapper's
    parameter (``train``, ``train_args``, ``train_kwargs``, ...).

    Args:
        train: the training function, or the path of a script.
        train_args: its positional arguments, or the script's argv.
        train_kwargs: its keyword arguments.
        spark: where the session of a barrier-mode run comes from.
        cancel_token: made by the wrapper up front, so an early cancel is not lost.
        data: DataFrame input (a DataFrame, or SQL, a table or a path), or None.
        **options: :class:`~sparktorch_ops.spec.LaunchSpec` options (``num_processes``,
            ``local_mode``, ``use_gpu``, ``env``, ``logger``, ``on_metrics``, ...).

    Raises:
        ConfigError: anything the job rejects, or an unknown option, before anything starts.
    """
    if isinstance(train, str):
        train = train.strip()
    for option in launch_options.on("job"):
        if option.name not in options:
            continue
        value = options[option.name]
        if option.templated and isinstance(value, str) and not value.strip():
            options[option.name] = None  # a template that renders to nothing means "unset"
        elif option.flag is not None and option.flag.kwargs.get("type") is int:
            options[option.name] = _as_int(option.name, value)
    env = options.get("env")
    if isinstance(env, Mapping):  # rendered numbers become strings; None stays an error
        options["env"] = {
            str(k): str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
            for k, v in env.items()
        }
    unknown = sorted(set(options) - {f.name for f in fields(LaunchSpec)})
    if unknown:
        raise ConfigError(unknown[0], f"is not an option of a training job (options: {_OPTIONS})")
    return TrainingJob(
        train=train,
        args=train_args if train_args is not None else (),  # type: ignore[arg-type]
        kwargs=train_kwargs if train_kwargs is not None else {},
        options=LaunchSpec(**options),
        spark=spark if spark is not None else SparkSettings(),
        cancel_token=cancel_token if cancel_token is not None else CancelToken(),
        names=WRAPPER_NAMES,
        data=data,
    )


_OPTIONS = ", ".join(f.name for f in fields(LaunchSpec))


def _as_int(argument: str, value: object) -> object:
    """A rendered template's integer (``"2"``, ``" 2 "``, ``2.0``) as an int; other types are
    left for the job's own validation to reject by name."""
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise ConfigError(
                argument, f"must be an integer after templating, got {value!r}"
            ) from None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
