"""DeepspeedTorchDistributor: pyspark's signature, DeepSpeed's argv, the config file's life.

The argv and config-file tests run everywhere. The real DeepSpeed run needs the ``deepspeed``
package, which the default environment does not have (see the README): it is skipped there.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from sparktorch_ops.deepspeed import (
    ConfigPayload,
    DeepspeedTorchDistributor,
    load_config,
    run_script_on_rank,
    script_argv,
    shim_source,
)
from sparktorch_ops.errors import ConfigError, TrainingFailedError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "deepspeed_train.py"


# -- argv planning (pure, exact) --------------------------------------------------------------
def test_script_argv_appends_deepspeed_flags_after_user_args() -> None:
    assert script_argv("/w/train.py", ["--epochs=3", 5, "--lr", 0.1], "/tmp/x/ds.json") == [
        "/w/train.py",
        "--epochs=3",
        "5",
        "--lr",
        "0.1",
        "--deepspeed",
        "--deepspeed_config",
        "/tmp/x/ds.json",
    ]


def test_script_argv_without_config_passes_only_the_flag() -> None:
    assert script_argv("train.py", [], None) == ["train.py", "--deepspeed"]


def test_dict_config_becomes_json() -> None:
    payload = load_config({"zero_optimization": {"stage": 2}, "train_batch_size": 8})
    assert payload is not None
    assert payload.suffix == ".json"
    assert json.loads(payload.text) == {"zero_optimization": {"stage": 2}, "train_batch_size": 8}


def test_file_config_travels_verbatim(tmp_path: Path) -> None:
    # DeepSpeed reads its config with hjson: keep the user's file byte for byte.
    path = tmp_path / "ds.hjson"
    path.write_text("{\n  # comment\n  train_batch_size: 8\n}\n")
    assert load_config(str(path)) == ConfigPayload(path.read_text(), ".hjson")
    assert load_config(path) == ConfigPayload(path.read_text(), ".hjson")
    assert load_config(None) is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("/nonexistent/ds.json", "cannot read the DeepSpeed config file '/nonexistent/ds.json'"),
        ({"x": object()}, "cannot be written as JSON"),
        (42, "got int"),
    ],
)
def test_bad_config_is_a_config_error_naming_the_argument(config: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        DeepspeedTorchDistributor(numGpus=1, localMode=True, useGpu=False, deepspeedConfig=config)
    assert caught.value.argument == "deepspeedConfig"


# -- the distributor's contract ---------------------------------------------------------------
def test_signature_matches_pyspark() -> None:
    from pyspark.ml.deepspeed.deepspeed_distributor import (
        DeepspeedTorchDistributor as PysparkDeepspeed,
    )

    ours = inspect.signature(DeepspeedTorchDistributor.__init__).parameters
    theirs = inspect.signature(PysparkDeepspeed.__init__).parameters
    for name, param in theirs.items():
        assert name in ours
        assert ours[name].default == param.default, name
    assert list(ours)[: len(theirs)] == list(theirs)


def test_ranks_cpu_accelerator_and_options() -> None:
    d = DeepspeedTorchDistributor(numGpus=2, nnodes=3, localMode=False, useGpu=False, timeout=60)
    assert (d.num_processes, d.local_mode, d.use_gpu) == (6, False, False)
    assert d.spec.env == {"DS_ACCELERATOR": "cpu"}
    assert d.spec.timeout == 60
    assert d.deepspeed_config is None
    user = DeepspeedTorchDistributor(useGpu=False, env={"DS_ACCELERATOR": "xpu", "A": "1"})
    assert user.spec.env == {"DS_ACCELERATOR": "xpu", "A": "1"}
    assert DeepspeedTorchDistributor(useGpu=True).spec.env == {}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_counts_are_config_errors(bad: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        DeepspeedTorchDistributor(numGpus=bad, useGpu=False)
    assert caught.value.argument == "numGpus"


def test_functions_kwargs_and_missing_scripts_are_refused(tmp_path: Path) -> None:
    d = DeepspeedTorchDistributor(numGpus=2, useGpu=False, deepspeedConfig={"a": 1})
    with pytest.raises(ConfigError, match=r"deepspeed\.initialize") as caught:
        d.run(len)
    assert caught.value.argument == "train_object"
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    with pytest.raises(ConfigError) as caught:
        d.run(str(script), lr=1)
    assert caught.value.argument == "kwargs"
    with pytest.raises(ConfigError, match="does not exist") as caught:
        d.run(str(tmp_path / "missing.py"))
    assert caught.value.argument == "train_object"


# -- what runs on each rank (in this process) -------------------------------------------------
PROBE = textwrap.dedent(
    """
    import json, os, sys
    config = sys.argv[sys.argv.index("--deepspeed_config") + 1]
    record = {
        "argv": sys.argv,
        "file": __file__,
        "config_path": config,
        "config": open(config).read(),
        "rank": os.environ.get("RANK"),
        "ds_accelerator": os.environ.get("DS_ACCELERATOR"),
    }
    print("PROBE " + json.dumps(record), flush=True)
    if "--fail" in sys.argv:
        sys.exit(3)
    """
)


def _probe_records(text: str) -> list[dict[str, Any]]:
    marker = "PROBE "
    return [
        json.loads(line[line.index(marker) + len(marker) :])
        for line in text.splitlines()
        if marker + "{" in line
    ]


def test_rank_side_runs_a_private_copy_and_removes_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    source = PROBE.encode()
    missing = str(tmp_path / "not-on-this-node" / "train.py")  # as on an executor
    with pytest.raises(SystemExit) as caught:
        run_script_on_rank(
            "train.py",
            missing,
            source,
            ["--epochs=1", "--fail"],
            ConfigPayload('{"train_batch_size": 4}', ".json"),
            in_place=False,
        )
    assert caught.value.code == 3
    (record,) = _probe_records(capsys.readouterr().out)
    assert record["file"] != missing and record["file"].endswith("/train.py")
    expected = script_argv(record["file"], ["--epochs=1", "--fail"], record["config_path"])
    assert record["argv"] == expected
    assert record["config"] == '{"train_batch_size": 4}'
    assert not os.path.exists(record["config_path"])
    assert not os.path.exists(record["file"])


def test_shim_is_a_script_that_calls_the_rank_side(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_bytes(b"print('hi')\n")
    text = shim_source(
        script, b"print('hi')\n", ["--a=1"], ConfigPayload("{}", ".json"), in_place=False
    )
    compile(text, "shim", "exec")
    assert "run_script_on_rank(" in text
    assert "script_args=['--a=1']" in text
    assert f"driver_path={str(script)!r}" in text
    assert "in_place=False" in text


# -- real torchrun runs: local mode and barrier mode -------------------------------------------
@pytest.fixture()
def probe_script(tmp_path: Path) -> Path:
    path = tmp_path / "probe_train.py"
    path.write_text(PROBE)
    return path


def _check_probe_run(output: str, script: Path, config: dict[str, Any], *, in_place: bool) -> None:
    records = _probe_records(output)
    # run() returns rank 0's stdout, as for any script.
    assert [r["rank"] for r in records] == ["0"]
    (record,) = records
    # Local mode runs the driver's file in place; barrier mode a shipped copy (as the core does).
    assert (record["file"] == str(script)) is in_place
    assert os.path.basename(record["file"]) == script.name
    assert record["argv"] == script_argv(record["file"], ["--epochs=2"], record["config_path"])
    assert json.loads(record["config"]) == config
    assert record["ds_accelerator"] == "cpu"
    assert not os.path.exists(record["config_path"]), "the config file outlived the run"


def test_local_run_gives_every_rank_deepspeed_argv_and_removes_config(probe_script: Path) -> None:
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
    d = DeepspeedTorchDistributor(numGpus=2, localMode=True, useGpu=False, deepspeedConfig=config)
    result = d.launch(str(probe_script), "--epochs=2")
    _check_probe_run(result.value, probe_script, config, in_place=True)
    rank1 = _probe_records(result.outputs[1])
    assert [r["rank"] for r in rank1] == ["1"]
    assert rank1[0]["config_path"] != _probe_records(result.value)[0]["config_path"]
    assert not os.path.exists(rank1[0]["config_path"])


def test_barrier_run_writes_the_config_where_each_rank_runs(
    spark: Any, probe_script: Path, tmp_path: Path
) -> None:
    config_file = tmp_path / "ds_config.json"
    config = {"train_micro_batch_size_per_gpu": 2}
    config_file.write_text(json.dumps(config))
    d = DeepspeedTorchDistributor(
        numGpus=1,
        nnodes=2,
        localMode=False,
        useGpu=False,
        deepspeedConfig=str(config_file),
        spark=spark,
    )
    result = d.launch(str(probe_script), "--epochs=2")
    assert result.mode == "barrier"
    _check_probe_run(result.value, probe_script, config, in_place=False)
    assert config_file.exists()  # the user's own file is only read


def test_script_exit_code_fails_the_run(probe_script: Path) -> None:
    d = DeepspeedTorchDistributor(numGpus=2, useGpu=False, deepspeedConfig={"a": 1})
    with pytest.raises(TrainingFailedError) as caught:
        d.run(str(probe_script), "--fail")
    first = caught.value.first_failure
    assert first is not None and first.exit_code == 3


# -- DeepSpeed itself (needs the deepspeed package) -------------------------------------------
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (kept out of the default environment; see the README)",
)


@needs_deepspeed
@pytest.mark.parametrize("local_mode", [True, False], ids=["local", "barrier"])
def test_real_deepspeed_zero1_on_cpu(local_mode: bool, request: pytest.FixtureRequest) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import deepspeed_train

    d = DeepspeedTorchDistributor(
        numGpus=2,
        localMode=local_mode,
        useGpu=False,
        deepspeedConfig=deepspeed_train.default_config(),
        spark=None if local_mode else request.getfixturevalue("spark"),
    )
    result = d.launch(str(EXAMPLE), "--epochs=3")
    last = result.value.strip().splitlines()[-1]
    assert "world_size=2 zero_stage=1 config_file_present=True" in last, result.value
    losses = [m.values["loss"] for m in result.metrics if m.rank == 0]
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0], losses
