"""DeepspeedTorchDistributor: pyspark's DeepSpeed launcher, on top of our TorchDistributor.

A DeepSpeed training script run under torchrun expects ``--deepspeed --deepspeed_config FILE``
on its command line (``deepspeed.add_config_arguments``) and reads the JSON file itself. The
file must exist where each rank runs, which on a cluster is not the driver: the configuration
(a dict, or the text of a file read on the driver) therefore travels with the run, and a small
launch shim on every rank writes it to a private temporary file, runs the script with
``runpy`` (so ``run`` returns rank 0's stdout and a non-zero exit fails the run, as for any
script), and removes the file afterwards.

Nothing here imports DeepSpeed: the ranks do, through the user's script.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparktorch_ops.distributor import TorchDistributor
from sparktorch_ops.driver.packing import check_train
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.results import RunResult

DEEPSPEED_FLAG = "--deepspeed"
DEEPSPEED_CONFIG_FLAG = "--deepspeed_config"
SHIM_NAME = "sparktorch_deepspeed_launch.py"

DeepspeedConfig = Mapping[str, Any] | str | os.PathLike[str] | None


@dataclass(frozen=True)
class ConfigPayload:
    """The DeepSpeed configuration as it travels to the ranks.

    Attributes:
        text: the file's content (JSON, or DeepSpeed's HJSON when read from a file).
        suffix: the temporary file's suffix on the ranks (the original file's, or ``.json``).
    """

    text: str
    suffix: str


def script_argv(script_path: str, script_args: Sequence[Any], config_path: str | None) -> list[str]:
    """The ``sys.argv`` a DeepSpeed script sees on each rank: the script, the user's arguments,
    then ``--deepspeed`` and, when a configuration was given, ``--deepspeed_config`` and the
    rank's copy of it (``config_path``)."""
    argv = [script_path, *(str(arg) for arg in script_args), DEEPSPEED_FLAG]
    if config_path is not None:
        argv += [DEEPSPEED_CONFIG_FLAG, config_path]
    return argv


def load_config(config: DeepspeedConfig) -> ConfigPayload | None:
    """Read ``deepspeedConfig`` on the driver: a dict becomes JSON, a path its file's text.

    Raises:
        ConfigError: (argument ``deepspeedConfig``) a dict that is not JSON-serialisable, a
            path that is not a readable file, or any other type.
    """
    if config is None:
        return None
    if isinstance(config, Mapping):
        try:
            return ConfigPayload(json.dumps(dict(config), indent=2, sort_keys=True), ".json")
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                "deepspeedConfig", f"the dict cannot be written as JSON: {exc}"
            ) from exc
    if isinstance(config, (str, os.PathLike)):
        path = Path(config).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                "deepspeedConfig",
                f"cannot read the DeepSpeed config file {str(config)!r}: "
                f"{type(exc).__name__}: {exc}",
            ) from exc
        return ConfigPayload(text, path.suffix or ".json")
    raise ConfigError(
        "deepspeedConfig",
        f"must be a dict, the path of a JSON file, or None; got {type(config).__name__}",
    )


def run_script_on_rank(
    script_name: str,
    driver_path: str,
    source: bytes,
    script_args: Sequence[str],
    config: ConfigPayload | None,
    in_place: bool,
) -> None:
    """What every rank runs: write the config, run the script with DeepSpeed's argv, clean up.

    As TorchDistributor does with any script, local mode (``in_place``) runs the driver's file
    where it is, so its sibling imports and relative paths behave as under torchrun; barrier
    mode runs a private copy written from ``source``. The configuration file is private to the
    rank and removed when the script ends, however it ends.

    Raises:
        SystemExit: the script's own exit (the rank exits with the script's code).
    """
    workdir = tempfile.mkdtemp(prefix="sparktorch-deepspeed-")
    try:
        script = driver_path
        if not in_place:
            script = os.path.join(workdir, script_name)
            Path(script).write_bytes(source)
        config_path = None
        if config is not None:
            config_path = os.path.join(workdir, f"deepspeed_config{config.suffix}")
            Path(config_path).write_text(config.text, encoding="utf-8")
        sys.argv = script_argv(script, script_args, config_path)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def shim_source(
    script: Path,
    source: bytes,
    script_args: Sequence[str],
    config: ConfigPayload | None,
    *,
    in_place: bool,
) -> str:
    """The launch shim: a script that calls :func:`run_script_on_rank` with this run's data.

    TorchDistributor ships the shim to every rank like any script; the user's script and the
    configuration ride inside it as literals, so neither has to exist on the executors.
    """
    return (
        "# Generated by sparktorch_ops.deepspeed for one run: runs a DeepSpeed script.\n"
        "from sparktorch_ops.deepspeed import ConfigPayload, run_script_on_rank\n"
        "\n"
        "run_script_on_rank(\n"
        f"    script_name={script.name!r},\n"
        f"    driver_path={str(script)!r},\n"
        f"    source={source!r},\n"
        f"    script_args={list(script_args)!r},\n"
        f"    config={config!r},\n"  # a dataclass's repr is its constructor call
        f"    in_place={in_place!r},\n"
        ")\n"
    )


class DeepspeedTorchDistributor(TorchDistributor):
    """Run a DeepSpeed training script with torchrun, locally or on Spark.

    The signature of ``pyspark.ml.deepspeed.deepspeed_distributor.DeepspeedTorchDistributor``;
    everything else is our TorchDistributor (failures, timeouts, cancellation, logs, metrics).
    The script receives ``--deepspeed --deepspeed_config <file>`` after its own arguments, the
    file written where each rank runs and removed after. Unlike pyspark's, the flag is spelled
    ``--deepspeed`` (pyspark passes ``-deepspeed``) and a dict config also works in barrier
    mode (pyspark writes it on the driver only).

    Args:
        numGpus: ranks per node (GPUs per node with ``useGpu``).
        nnodes: nodes; the run has ``numGpus * nnodes`` ranks. As in pyspark, how ranks map
            onto barrier tasks comes from ``spark.task.resource.gpu.amount`` (one per task
            on CPU).
        localMode: run every rank on the driver.
        useGpu: one GPU per rank. With ``useGpu=False``, ``DS_ACCELERATOR=cpu`` is set for the
            ranks (unless ``env`` sets it) so DeepSpeed does not pick a GPU it sees.
        deepspeedConfig: a dict, the path of a JSON (or HJSON) file read on the driver, or
            None (the script gets ``--deepspeed`` only).
        **options: TorchDistributor's keyword options (``spark``, ``env``, ``logger``,
            ``timeout``, ...).
    """

    def __init__(
        self,
        numGpus: int = 1,
        nnodes: int = 1,
        localMode: bool = True,
        useGpu: bool = True,
        deepspeedConfig: DeepspeedConfig = None,
        **options: Any,
    ) -> None:
        for name, value in (("numGpus", numGpus), ("nnodes", nnodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        self.deepspeed_config = deepspeedConfig
        self._config = load_config(deepspeedConfig)
        env = dict(options.pop("env", None) or {})
        if not useGpu:
            env.setdefault("DS_ACCELERATOR", "cpu")
        super().__init__(numGpus * nnodes, localMode, useGpu, env=env, **options)
        self.num_gpus = numGpus
        self.nnodes = nnodes

    def launch(
        self, train_object: Callable[..., Any] | str | os.PathLike[str], *args: Any, **kwargs: Any
    ) -> RunResult:
        """Run the DeepSpeed script on every rank; see :meth:`TorchDistributor.launch`.

        Args:
            train_object: the path of a DeepSpeed script (functions are refused, as by
                pyspark's: use TorchDistributor and pass the config dict to
                ``deepspeed.initialize(config=...)``).
            *args: the script's command-line arguments, before ``--deepspeed``.
            **kwargs: not accepted for scripts.

        Raises:
            ConfigError: a function, kwargs, or a missing script; then as TorchDistributor.
        """
        if callable(train_object):
            raise ConfigError(
                "train_object",
                "DeepspeedTorchDistributor runs a DeepSpeed script (a path); for a function, "
                "use TorchDistributor and pass the config to deepspeed.initialize(config=...)",
            )
        script = check_train(train_object, args, kwargs)
        assert isinstance(script, Path)  # a callable was refused above
        source = shim_source(
            script,
            script.read_bytes(),
            [str(a) for a in args],
            self._config,
            in_place=self.local_mode,
        )
        shim_dir = tempfile.mkdtemp(prefix="sparktorch-deepspeed-shim-")
        try:
            shim = Path(shim_dir, SHIM_NAME)
            shim.write_text(source, encoding="utf-8")
            return super().launch(shim)
        finally:
            shutil.rmtree(shim_dir, ignore_errors=True)
