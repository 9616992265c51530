"""Validation of the launch options: typed errors that name the argument."""

from __future__ import annotations

import datetime
import logging
import pickle
from pathlib import Path

import pytest

from sparktorch_ops import ConfigError, TorchDistributor
from sparktorch_ops.spec import LaunchSpec


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"num_processes": 0}, "num_processes"),
        ({"num_processes": -2}, "num_processes"),
        ({"num_processes": 2.0}, "num_processes"),
        ({"num_processes": "2"}, "num_processes"),
        ({"num_processes": True}, "num_processes"),
        ({"local_mode": "yes"}, "local_mode"),
        ({"use_gpu": 1}, "use_gpu"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": "10"}, "timeout"),
        ({"start_timeout": -5}, "start_timeout"),
        ({"env": {"RANK": "1"}}, "env"),
        ({"env": {"A": 1}}, "env"),
        ({"env": {"bad name": "1"}}, "env"),
        ({"torchrun_args": "--nnodes=2"}, "torchrun_args"),
        ({"torchrun_args": ["--nproc-per-node=4"]}, "torchrun_args"),
        ({"torchrun_args": ["--max-restarts", "3"]}, "torchrun_args"),
        ({"log_ranks": [-1]}, "log_ranks"),
        ({"logger": "log"}, "logger"),
        ({"on_metrics": 3}, "on_metrics"),
    ],
)
def test_bad_options_raise_config_error_naming_the_argument(kwargs: dict, argument: str) -> None:
    with pytest.raises(ConfigError) as info:
        TorchDistributor(**kwargs)
    assert info.value.argument == argument
    assert str(info.value).startswith(f"{argument}: ")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("num_processes", [0, -1])
def test_a_non_positive_num_processes_is_a_value_error_saying_positive(num_processes: int) -> None:
    # pyspark's TorchDistributor raises ValueError("... positive ..."); callers match on both.
    with pytest.raises(ValueError, match="positive"):
        TorchDistributor(num_processes=num_processes)


def test_defaults_match_pyspark() -> None:
    distributor = TorchDistributor()
    assert (distributor.num_processes, distributor.local_mode, distributor.use_gpu) == (
        1,
        True,
        True,
    )


def test_timeouts_accept_timedelta_and_numbers() -> None:
    spec = LaunchSpec(timeout=datetime.timedelta(minutes=2), start_timeout=5)
    assert spec.timeout == 120.0
    assert spec.start_timeout == 5.0


def test_spec_normalises_collections() -> None:
    spec = LaunchSpec(
        log_ranks=[0, 2], torchrun_args=["--monitor-interval=1"], logger=logging.getLogger("x")
    )
    assert spec.log_ranks == frozenset({0, 2})
    assert spec.torchrun_args == ("--monitor-interval=1",)


def test_config_error_survives_pickling() -> None:
    error = pickle.loads(pickle.dumps(ConfigError("num_processes", "must be >= 1")))
    assert error.argument == "num_processes"
    assert str(error) == "num_processes: must be >= 1"


def test_any_logger_with_a_log_method_is_accepted() -> None:
    class StructlogLike:
        def log(self, level: int, msg: str, *args: object) -> None:
            pass

    assert isinstance(LaunchSpec(logger=StructlogLike()).logger, StructlogLike)


@pytest.mark.parametrize(
    "args",
    [
        ["--nnode=3"],
        ["--rdzv-endp=evil:29400"],
        ["--master-add=10.0.0.9"],
        ["--max-restart=9"],
        ["--nproc_per_node", "2"],
        ["--local-ad=x"],
        ["--no-pyth"],
        ["--standalone"],
        ["evil.py"],
        ["--log-dir"],
        ["--monitor-interval=1", "extra"],
        ["--bogus-option"],
    ],
)
def test_torchrun_args_are_read_by_torchruns_own_parser(args: list[str]) -> None:
    """Abbreviations, positionals and options without values cannot take over the launch."""
    with pytest.raises(ConfigError) as info:
        LaunchSpec(torchrun_args=args)
    assert info.value.argument == "torchrun_args"


def test_torchrun_options_we_do_not_own_pass() -> None:
    args = ("--monitor-interval=1", "--start-method=spawn", "--log-dir", "/tmp/logs")
    assert LaunchSpec(torchrun_args=args).torchrun_args == args


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"env": {"A": "x\x00y"}}, "env"), ({"torchrun_args": ["--log-dir=/t\x00"]}, "torchrun_args")],
)
def test_nul_bytes_are_config_errors_before_anything_starts(kwargs: dict, argument: str) -> None:
    with pytest.raises(ConfigError, match="NUL") as info:
        LaunchSpec(**kwargs)
    assert info.value.argument == argument


def test_checkpoint_locations_are_checked_and_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.pt").write_bytes(b"")
    spec = LaunchSpec(checkpoint_dir="ck", warm_start_from="model.pt")
    assert spec.checkpoint_dir == str(tmp_path / "ck")  # executors have other working dirs
    assert spec.warm_start_from == str(tmp_path / "model.pt")
    assert LaunchSpec(checkpoint_dir="file:///shared/ck").checkpoint_dir == "file:///shared/ck"
    with pytest.raises(ConfigError, match="install its package") as info:
        LaunchSpec(checkpoint_dir="nosuchproto://bucket/ck")
    assert info.value.argument == "checkpoint_dir"
    with pytest.raises(ConfigError, match="does not exist") as info:
        LaunchSpec(warm_start_from=tmp_path / "missing.pt")
    assert info.value.argument == "warm_start_from"
    with pytest.raises(ConfigError) as info:
        LaunchSpec(checkpoint_dir=3)  # type: ignore[arg-type]
    assert info.value.argument == "checkpoint_dir"
