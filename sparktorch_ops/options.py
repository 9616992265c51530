"""Every option, defined once: its default, its doc, whether the orchestrators template it,
and its command-line flag.

Launch options (those on the ``job`` surface) reach the run's
:class:`~sparktorch_ops.spec.LaunchSpec`; the others belong to the surface that takes them:
where Spark is (a session in code, a connection in Airflow, a master or a block in Prefect, a
master on the command line), the input the wrappers read, and what a wrapper keeps of a run.

The surfaces keep explicit, typed signatures (Airflow's ``partial()/expand()`` checks keyword
names against the operator's ``__init__``), but their docs are written from here
(:func:`documented`), the CLI's flags are made from here (:func:`add_cli_flags`), the wrappers
pass the launch options through by name (:func:`values_of`), and
``tests/integration/test_options.py`` checks that every surface takes exactly its options
(:func:`taken`) with these defaults. Adding a launch option: one entry below, the parameter on
each surface's signature, the field on :class:`~sparktorch_ops.spec.LaunchSpec`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

Surface = Literal["distributor", "job", "operator", "task", "cli"]
#: Where the options are taken: ``TorchDistributor``, ``build_job`` (and ``LaunchSpec``),
#: the Airflow operator, the Prefect task, the ``sparktorch-ops run`` command.
SURFACES: tuple[Surface, ...] = ("distributor", "job", "operator", "task", "cli")
_EVERYWHERE = frozenset(SURFACES)
_IN_CODE = frozenset({"distributor", "job"})  # callables and objects: not for a wrapper's user
_WRAPPERS = frozenset({"operator", "task"})
DEFAULT_MAX_RESULT_BYTES = 1 << 30
_MARKER = "<launch options>"


@dataclass(frozen=True)
class Flag:
    """How an option appears on the command line (``argparse.add_argument`` keywords)."""

    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Option:
    """One launch option.

    Attributes:
        name: the keyword on every surface.
        doc: what it does, as each surface's docs say it.
        default: its default (the same on every surface, unless ``defaults`` says otherwise).
        templated: rendered by Airflow (in the operator's ``template_fields``).
        flag: its command-line flag (None: not on the CLI).
        surfaces: where it is taken.
        defaults: a surface's own default, where it differs.
    """

    name: str
    doc: str
    default: Any = None
    templated: bool = False
    flag: Flag | None = None
    surfaces: frozenset[str] = _EVERYWHERE
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def default_on(self, surface: Surface) -> Any:
        """This option's default on ``surface``."""
        return self.defaults.get(surface, self.default)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _ranks(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ranks like 0,1, got {text!r}") from None


OPTIONS: tuple[Option, ...] = (
    Option(
        "num_processes",
        "total number of ranks.",
        1,
        templated=True,
        flag=Flag("--num-processes", {"type": int, "help": "total ranks (default 1)"}),
    ),
    Option(
        "local_mode",
        "True runs the ranks on the driver; False runs one rank per Spark barrier task (k per "
        "task with ``spark.task.resource.gpu.amount=k``).",
        True,
        # The CLI's --local-mode / --no-local-mode pair: local unless --master is given.
        defaults={"cli": None},
    ),
    Option(
        "use_gpu",
        "give each rank its own GPU.",
        True,
        flag=Flag("--use-gpu", {"action": "store_true", "help": "give each rank a GPU"}),
        defaults={"cli": False},  # a command line asks for GPUs
    ),
    Option(
        "env",
        "extra environment variables for every rank.",
        None,
        templated=True,
        flag=Flag(
            "--env",
            {"action": "append", "type": _key_value, "metavar": "KEY=VALUE", "help": "repeatable"},
        ),
    ),
    Option(
        "max_restarts",
        "torchrun's worker-group restarts within one run.",
        0,
        flag=Flag("--max-restarts", {"type": int}),
    ),
    Option(
        "max_failures",
        "new attempts of the whole run, within the same call, after an attempt that an "
        "infrastructure failure ended (an executor, host or agent lost, a rank killed by a "
        "signal): each a fresh barrier stage that resumes from the latest checkpoint. A "
        "Python exception in the training, a cancel or a timeout is never retried.",
        0,
        flag=Flag("--max-failures", {"type": int}),
    ),
    Option(
        "min_processes",
        "barrier mode: the fewest ranks an attempt may run with when the cluster lacks the "
        "slots for ``num_processes`` (after ``start_timeout``); it then runs with as many as "
        "fit (default: ``num_processes``, never fewer).",
        None,
        templated=True,
        flag=Flag("--min-processes", {"type": int}),
    ),
    Option(
        "torchrun_args",
        "further torchrun options (not those the distributor sets itself).",
        None,
        flag=Flag(
            "--torchrun-arg",
            {"action": "append", "metavar": "ARG", "help": "repeatable: --torchrun-arg=--foo=1"},
        ),
    ),
    Option(
        "start_timeout",
        "seconds (or a timedelta) to wait for task slots, executors and the rendezvous.",
        None,
        flag=Flag("--start-timeout", {"type": float}),
    ),
    Option(
        "timeout",
        "seconds (or a timedelta) the whole run may take.",
        None,
        flag=Flag("--timeout", {"type": float}),
    ),
    Option(
        "stall_timeout",
        "seconds (or a timedelta) with no sign of progress from any rank (a ``report()``, "
        "one with no values is a heartbeat, or a line of output) after which the run fails "
        "with ``TrainingStalledError``, showing every rank's Python stacks (default: off).",
        None,
        flag=Flag("--stall-timeout", {"type": float}),
    ),
    Option(
        "log_ranks",
        "ranks whose output is forwarded to the log (default: all).",
        None,
        flag=Flag("--log-ranks", {"type": _ranks, "metavar": "0,1"}),
    ),
    Option(
        "allow_unencrypted_channel",
        "keep the rank -> driver channel plain TCP even though Spark's encryption is on (it "
        "then uses TLS with a per-run certificate; it is authenticated either way).",
        False,
        flag=Flag("--allow-unencrypted-channel", {"action": "store_true"}),
    ),
    Option(
        "max_result_bytes",
        "the largest pickled return value rank 0 may send (default 1 GiB); beyond it the run "
        "fails with ``ResultTooLargeError``.",
        DEFAULT_MAX_RESULT_BYTES,
        flag=Flag("--max-result-bytes", {"type": int}),
    ),
    Option(
        "max_local_processes",
        "the most ranks local mode may start (default 4 per CPU of the driver).",
        None,
        flag=Flag("--max-local-processes", {"type": int}),
    ),
    Option(
        "checkpoint_dir",
        "where the ranks' ``sparktorch_ops.checkpoint`` saves and resumes (env "
        "``SPARKTORCH_CHECKPOINT_DIR``): a path every rank reaches or an fsspec URL. A "
        "restarted worker group and a rerun with the same directory resume from its latest "
        "complete checkpoint.",
        None,
        templated=True,
        flag=Flag("--checkpoint-dir", {}),
    ),
    Option(
        "warm_start_from",
        "a checkpoint directory or a ``torch.save``'d model file whose weights "
        "``load_latest`` loads when ``checkpoint_dir`` has no checkpoint yet (a resume wins).",
        None,
        templated=True,
        flag=Flag("--warm-start-from", {}),
    ),
    Option(
        "mlflow_experiment",
        "track each run as one MLflow run in this experiment, logged from the driver (params, "
        "every rank 0 ``report()`` as metrics, outcome, Spark tags; nested under the caller's "
        "active MLflow run); ranks never talk to MLflow.",
        None,
        templated=True,
        flag=Flag("--mlflow-experiment", {}),
    ),
    Option(
        "mlflow_tracking_uri",
        "the MLflow tracking URI (default ``MLFLOW_TRACKING_URI``); given alone it also turns "
        "tracking on (MLflow's default experiment).",
        None,
        templated=True,
        flag=Flag("--mlflow-tracking-uri", {}),
    ),
    Option(
        "mlflow_all_ranks",
        "log every rank's ``report()`` records to MLflow (keys suffixed ``/rank<N>``), not "
        "only rank 0's.",
        False,
        flag=Flag("--mlflow-all-ranks", {"action": "store_true"}),
    ),
    Option(
        "channel_host",
        "the address barrier tasks reach this process at for logs, metrics and the result, "
        "when the default is wrong (NAT, containers).",
        None,
        templated=True,
        flag=Flag("--channel-host", {}),
    ),
    Option(
        "detached",
        "run the training's driver in a process of its own that outlives the caller (a worker "
        "slot, a notebook, a killed task process), its whole state in ``run_dir``: ``run()`` "
        "and ``launch()`` submit it and wait on it, ``submit()`` returns its ``RunHandle`` at "
        "once (docs/detached.md).",
        False,
        flag=Flag("--detached", {"action": "store_true"}),
    ),
    Option(
        "run_dir",
        "where a detached run keeps its state: a path or an fsspec URL (default "
        "``$SPARKTORCH_RUNS/<training id>``, else under ``~/.local/state/sparktorch_ops/runs``);"
        " one that holds the same training already is reattached to, not trained again.",
        None,
        templated=True,
        flag=Flag("--run-dir", {}),
    ),
    Option(
        "logger",
        "receives every rank's output (stdout at INFO, stderr at WARNING): a "
        "``logging.Logger``, an adapter, or anything with ``log(level, msg, *args)``.",
        None,
        surfaces=_IN_CODE,
    ),
    Option(
        "on_metrics",
        "called with every ``sparktorch_ops.report()`` record as it arrives.",
        None,
        surfaces=_IN_CODE,
    ),
    Option(
        "on_event",
        "called with every :class:`~sparktorch_ops.events.PhaseEvent` of a run.",
        None,
        surfaces=_IN_CODE,
    ),
    Option(
        "mlflow_tags",
        "tags for the MLflow run (the orchestrators add their run's ids).",
        None,
        surfaces=frozenset({"job"}),
    ),
    Option(
        "training",
        "this try of a durable training (:class:`~sparktorch_ops.driver.durable.TrainingTry`, "
        "made by the orchestrators): its tries share one MLflow run, and only the last sets "
        "its final status.",
        None,
        surfaces=frozenset({"job"}),
    ),
    # -- where Spark is: each surface says it its own way ----------------------------------
    Option(
        "spark",
        "the SparkSession (default: the active one; barrier mode creates one if none).",
        None,
        surfaces=frozenset({"distributor"}),
    ),
    Option(
        "conn_id",
        "Airflow ``spark`` connection with the master for barrier mode, or ``spark_connect`` "
        "connection of a Spark Connect server.",
        "spark_default",
        surfaces=frozenset({"operator"}),
    ),
    Option(
        "spark_master",
        "the Spark master URL for barrier mode, or ``sc://HOST:PORT`` for Spark Connect (on the "
        "command line it implies ``--no-local-mode`` unless ``--local-mode`` is given).",
        None,
        flag=Flag("--master", {"metavar": "URL"}),
        surfaces=frozenset({"task", "cli"}),
    ),
    Option(
        "cluster",
        "a :class:`~sparktorch_ops.prefect.SparkCluster` block (a master and its conf), or the "
        "name it was saved under; instead of ``spark_master``.",
        None,
        surfaces=frozenset({"task"}),
    ),
    Option(
        "spark_conf",
        "Spark settings for the session the run creates, over the Airflow connection's "
        "``spark.*`` extras or the cluster block's conf.",
        None,
        templated=True,
        # Parsed by the CLI itself, so that a bad one is a ConfigError naming --conf.
        flag=Flag(
            "--conf",
            {"action": "append", "metavar": "KEY=VALUE", "help": "Spark configuration, repeatable"},
        ),
        surfaces=frozenset({"operator", "task", "cli"}),
    ),
    # -- the input the wrappers read (in code: train_on_dataframe) ---------------------------
    Option(
        "dataframe",
        "a DataFrame the ranks train on (shared out as by ``train_on_dataframe``); at most one "
        "of it and the ``input_*`` options.",
        None,
        surfaces=frozenset({"task"}),
    ),
    Option(
        "input_sql",
        "a SQL query whose rows the ranks train on, run on the run's session and read with "
        ":func:`sparktorch_ops.data.partition_loader`; at most one input is given, and the "
        "summary gives its rows and columns.",
        None,
        templated=True,
        surfaces=_WRAPPERS,
    ),
    Option(
        "input_table",
        "a table whose rows the ranks train on (as ``input_sql``).",
        None,
        templated=True,
        surfaces=_WRAPPERS,
    ),
    Option(
        "input_path",
        "files in ``input_format`` whose rows the ranks train on (as ``input_sql``).",
        None,
        templated=True,
        surfaces=_WRAPPERS,
    ),
    Option(
        "input_format",
        "the format of ``input_path`` (default ``parquet``).",
        "parquet",
        surfaces=_WRAPPERS,
    ),
    # -- what a wrapper keeps of a run -----------------------------------------------------
    Option(
        "durable",
        "the tries of the task are one training (default): a retry resumes from the latest "
        "checkpoint into the same MLflow run (docs/durable.md; in Airflow from 3.3 on); False: "
        "each try trains afresh into a run of its own.",
        True,
        surfaces=_WRAPPERS,
    ),
    Option(
        "deferrable",
        "train detached while the task waits in the triggerer (docs/detached.md; default: "
        "``[operators] default_deferrable``, as the providers' operators).",
        False,
        surfaces=frozenset({"operator"}),
    ),
    Option(
        "result_location",
        "where large or non-JSON values go: a directory or an ObjectStoragePath / fsspec URL. "
        "Default: ``[sparktorch_ops] result_location``, else "
        "``$AIRFLOW_HOME/sparktorch_ops/results``. Each try writes a new object there (never an "
        "overwrite); ``load_result`` reads only from under it.",
        None,
        templated=True,
        surfaces=frozenset({"operator"}),
    ),
    Option(
        "max_xcom_value_bytes",
        "the largest JSON-safe value kept inline (default: ``[sparktorch_ops] "
        "max_xcom_value_bytes``, else 48 KB).",
        None,
        surfaces=frozenset({"operator"}),
    ),
    Option(
        "mlflow_conn_id",
        "Airflow connection holding the MLflow tracking URI, used when "
        "``mlflow_tracking_uri`` is not given (default ``mlflow_default``; optional).",
        "mlflow_default",
        surfaces=frozenset({"operator"}),
    ),
    Option(
        "artifact_key",
        "the artifacts' key prefix (lowercase, digits, dashes; default: task name).",
        None,
        surfaces=frozenset({"task"}),
    ),
    Option(
        "artifacts",
        "set False to create no artifacts.",
        True,
        surfaces=frozenset({"task"}),
    ),
)


def taken(surface: Surface) -> tuple[Option, ...]:
    """Every option ``surface`` takes, its own included, in definition order."""
    return tuple(option for option in OPTIONS if surface in option.surfaces)


def on(surface: Surface) -> tuple[Option, ...]:
    """The launch options ``surface`` takes (those it passes on to the job)."""
    return tuple(option for option in taken(surface) if "job" in option.surfaces)


def values_of(surface: Surface, source: Mapping[str, Any] | object) -> dict[str, Any]:
    """The values of ``surface``'s launch options, by name, from a mapping (a function's
    ``locals()``) or an object's attributes (an operator): what a wrapper passes on."""
    if isinstance(source, Mapping):
        return {o.name: source[o.name] for o in on(surface)}
    return {o.name: getattr(source, o.name) for o in on(surface)}


def describe(surface: Surface, indent: str) -> str:
    """Docstring ``Args:`` entries for every option ``surface`` takes."""
    import textwrap

    lines = []
    for o in taken(surface):
        text = o.doc
        if o.templated and surface == "operator":
            text += " Templated."
        if surface == "cli" and o.flag is not None:
            text = f"({o.flag.name}) {text}"
        lines.append(
            textwrap.fill(
                f"{o.name}: {text}",
                width=96,
                initial_indent=indent,
                subsequent_indent=indent + "    ",
            )
        )
    return "\n".join(lines)


_Documented = TypeVar("_Documented", bound=Callable[..., Any] | type)


def documented(surface: Surface) -> Callable[[_Documented], _Documented]:
    """Write ``surface``'s option docs into a docstring, in place of its ``<launch options>``
    line (whose indentation they take)."""

    def fill(target: _Documented) -> _Documented:
        doc = target.__doc__ or ""
        lines = doc.split("\n")
        for i, line in enumerate(lines):
            if line.strip() == _MARKER:
                indent = line[: len(line) - len(line.lstrip())]
                lines[i] = describe(surface, indent)
                target.__doc__ = "\n".join(lines)
                return target
        raise ValueError(f"{target!r}'s docstring has no {_MARKER!r} line")

    return fill


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """The CLI's flags of every option that has one."""
    for o in taken("cli"):
        if o.flag is None:
            continue
        kwargs = dict(o.flag.kwargs)
        kwargs.setdefault("help", o.doc)
        parser.add_argument(o.flag.name, dest=o.name, default=o.default_on("cli"), **kwargs)


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    """The options parsed by :func:`add_cli_flags`, as ``build_job`` takes them."""
    values = {o.name: getattr(args, o.name) for o in on("cli") if o.flag is not None}
    if values.get("env") is not None:
        values["env"] = dict(values["env"])
    return values
