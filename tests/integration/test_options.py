"""Every surface takes exactly the options ``sparktorch_ops.options`` defines for it (its own
included: where Spark is, the input, what a wrapper keeps), with their defaults and docs, and
passes each launch option on to the job.

The wrappers' pass-through is proven in real runs beside their other tests
(tests/airflow/test_operator.py, tests/prefect/test_task.py): a bad value of every option fails
the task naming that option.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from pathlib import Path
from typing import Any

import pytest

from sparktorch_ops import TorchDistributor, cli, options
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.job import CancelToken, build_job
from sparktorch_ops.spec import LaunchSpec
from tests.support.launch_options import BAD, as_validated, good

# What each surface takes besides its options: the training and its arguments.
NOT_OPTIONS = {
    "distributor": {"self"},
    "operator": {"self", "train", "train_args", "train_kwargs", "kwargs"},
    "task": {"train", "train_args", "train_kwargs"},
}


def train(x: int) -> int:
    return x


def surface_callable(surface: str) -> Any:
    if surface == "distributor":
        return TorchDistributor.__init__
    if surface == "operator":
        from sparktorch_ops.airflow import TorchDistributorOperator

        return TorchDistributorOperator.__init__
    from sparktorch_ops.prefect import run_torch_distributor

    return run_torch_distributor.fn


def surface_doc(surface: str) -> str:
    if surface == "distributor":
        return TorchDistributor.__doc__ or ""
    if surface == "operator":
        from sparktorch_ops.airflow import TorchDistributorOperator

        return TorchDistributorOperator.__doc__ or ""
    from sparktorch_ops.prefect import run_torch_distributor

    return run_torch_distributor.fn.__doc__ or ""


def flat(text: str) -> str:
    return " ".join(text.split())


def test_torch_distributor_keeps_pysparks_positional_parameters() -> None:
    parameters = list(inspect.signature(TorchDistributor.__init__).parameters.values())[1:4]
    assert [(p.name, p.default, p.kind) for p in parameters] == [
        ("num_processes", 1, inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("local_mode", True, inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("use_gpu", True, inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ]


@pytest.mark.parametrize("surface", ["distributor", "operator", "task"])
def test_each_surface_takes_its_options_with_their_defaults_and_docs(surface: Any) -> None:
    parameters = inspect.signature(surface_callable(surface)).parameters
    expected = {o.name: o.default_on(surface) for o in options.taken(surface)}
    taken = {name: p.default for name, p in parameters.items() if name in expected}
    assert taken == expected
    assert set(parameters) - set(expected) == NOT_OPTIONS[surface]
    doc = flat(surface_doc(surface))
    for option in options.taken(surface):
        assert flat(f"{option.name}: {option.doc}") in doc, (surface, option.name)
    assert "<launch options>" not in doc


def test_the_job_takes_every_option_with_the_same_defaults() -> None:
    job_options = options.on("job")
    assert {f.name for f in dataclasses.fields(LaunchSpec)} == {o.name for o in job_options}
    doc = flat(LaunchSpec.__doc__ or "")
    assert all(flat(f"{o.name}: {o.doc}") in doc for o in job_options)
    given = {o.name: o.default for o in job_options if o.default is not None}
    assert LaunchSpec(**given) == LaunchSpec()


def test_the_operator_templates_exactly_the_templated_options() -> None:
    from sparktorch_ops.airflow import TorchDistributorOperator

    fields = set(TorchDistributorOperator.template_fields)
    for option in options.taken("operator"):
        assert (option.name in fields) == option.templated, option.name


def test_the_cli_has_a_flag_for_every_option_it_takes() -> None:
    parser = cli._parser()
    run = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    parsed = vars(run.parse_args(["train.py"]))  # nothing given: every default
    for option in options.taken("cli"):
        assert parsed[option.name] == option.default_on("cli"), option.name
    helps = flat(run.format_help())
    for option in options.taken("cli"):
        if option.flag is not None:
            assert option.flag.name in helps, option.name


def test_every_option_given_to_torch_distributor_reaches_the_job(tmp_path: Path) -> None:
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"")
    values = good(str(weights))
    for option in options.on("distributor"):
        spec = TorchDistributor(**{"use_gpu": False, option.name: values[option.name]}).spec
        assert getattr(spec, option.name) == as_validated(option.name, values[option.name])
        with pytest.raises(ConfigError) as info:
            TorchDistributor(**{"use_gpu": False, option.name: BAD[option.name]})
        assert info.value.argument == option.name


def test_every_option_given_to_build_job_reaches_it(tmp_path: Path) -> None:
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"")
    values = good(str(weights))
    for option in options.on("job"):
        job = build_job(train=train, **{"use_gpu": False, option.name: values[option.name]})
        assert getattr(job.options, option.name) == as_validated(option.name, values[option.name])
        with pytest.raises(ConfigError) as info:
            build_job(train=train, **{"use_gpu": False, option.name: BAD[option.name]})
        assert info.value.argument == option.name


def test_a_templated_option_that_renders_empty_is_unset() -> None:
    for option in options.on("job"):
        if option.templated and option.name != "num_processes":
            job = build_job(train=train, use_gpu=False, **{option.name: "  "})
            assert getattr(job.options, option.name) == LaunchSpec().__getattribute__(
                option.name
            ), option.name


def test_every_cli_flag_reaches_the_job(tmp_path: Path) -> None:
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"")
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    values = good(str(weights))
    argv = ["run", "--master", "local[2]"]
    for option in options.on("cli"):
        if option.flag is None:
            continue
        value = values[option.name]
        action = option.flag.kwargs.get("action")
        if action == "store_true":
            argv.append(option.flag.name)
        elif option.name == "env":
            argv += [option.flag.name, "SPARKTORCH_TEST=1"]
        elif action == "append":
            argv += [f"{option.flag.name}={item}" for item in value]
        elif option.name == "log_ranks":
            argv += [option.flag.name, ",".join(map(str, value))]
        else:
            argv += [option.flag.name, str(value)]
    args = cli._parser().parse_args([*argv, str(script)])
    job = cli._job(args, logging.getLogger("options-test"), CancelToken())
    for option in options.on("cli"):
        if option.flag is None:
            continue
        expected = as_validated(option.name, values[option.name])
        if option.name == "use_gpu":
            expected = True  # the flag turns GPUs on (the CLI's default is off)
        assert getattr(job.options, option.name) == expected, option.name
    assert job.options.local_mode is False  # --master without --local-mode
