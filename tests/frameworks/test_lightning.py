"""PyTorch Lightning's real Trainer(strategy="ddp") through TorchDistributor, every launch mode."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from sparktorch_ops.distributor import TorchDistributor
from sparktorch_ops.errors import TrainingFailedError
from sparktorch_ops.lightning import lightning_trainer_kwargs
from tests.support import cluster as cluster_support
from tests.support.procs import wait_until_gone

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lightning_digits.py"
sys.path.insert(0, str(ROOT / "examples"))

import lightning_digits  # noqa: E402


# -- the layout helper (pure) -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        # torchrun in local mode: one agent, N ranks.
        (
            {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "1"},
            {"devices": 4, "num_nodes": 1},
        ),
        # barrier mode on CPU: one agent per task, one rank each.
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "2"},
            {"devices": 1, "num_nodes": 2},
        ),
        # barrier mode with spark.task.resource.gpu.amount=2 on 3 tasks.
        (
            {"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "3"},
            {"devices": 2, "num_nodes": 3},
        ),
        # a launcher without GROUP_WORLD_SIZE.
        ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3"}, {"devices": 3, "num_nodes": 2}),
        ({"WORLD_SIZE": "3"}, {"devices": 1, "num_nodes": 3}),
        # not under a launcher: one plain process.
        ({}, {"devices": 1, "num_nodes": 1}),
        ({"PATH": "/bin"}, {"devices": 1, "num_nodes": 1}),
    ],
)
def test_trainer_kwargs_follow_torchrun_layout(
    env: dict[str, str], expected: dict[str, int]
) -> None:
    assert lightning_trainer_kwargs(env) == expected


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "2"}, "WORLD_SIZE=5 is not a multiple"),
        ({"WORLD_SIZE": "two", "LOCAL_WORLD_SIZE": "2"}, "WORLD_SIZE='two'"),
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0'"),
    ],
)
def test_trainer_kwargs_reject_broken_layout(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        lightning_trainer_kwargs(env)


def test_helper_does_not_import_lightning() -> None:
    code = (
        "import sys; import sparktorch_ops.lightning as m; m.lightning_trainer_kwargs();"
        "bad = [n for n in ('lightning', 'pytorch_lightning', 'torch') if n in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- real runs ----------------------------------------------------------------------------------
def _check_fit(value: dict[str, Any], layout: dict[str, int]) -> None:
    """The weights rank 0 returned are exactly what every rank held, and the model learned."""
    assert value["world_size"] == 2
    assert value["layout"] == layout
    returned = torch.nn.utils.parameters_to_vector(list(value["state_dict"].values()))
    assert value["rank_weights"].shape == (2, returned.numel())
    for rank, weights in enumerate(value["rank_weights"]):
        assert torch.equal(weights, returned), f"rank {rank} holds other weights than rank 0"
    losses = value["losses"]
    assert losses[-1] < 0.6 * losses[0], losses
    assert value["test_accuracy"] > 0.75


def test_lightning_function_local_mode() -> None:
    result = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).launch(
        lightning_digits.train, epochs=2
    )
    _check_fit(result.value, {"devices": 2, "num_nodes": 1})
    # The epoch-end report() of every rank arrived, the same mean loss on both.
    by_rank = {r: [m.values["loss"] for m in result.metrics if m.rank == r] for r in (0, 1)}
    assert by_rank[0] == by_rank[1] == result.value["losses"]
    assert result.progress == 1.0
    assert wait_until_gone(result.run_id) == []


def test_lightning_script_local_mode() -> None:
    output = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
        str(EXAMPLE), "--epochs=1"
    )
    last = output.strip().splitlines()[-1]
    assert "world_size=2 layout={'devices': 2, 'num_nodes': 1}" in last, output


def test_wrong_layout_fails_fast_with_lightnings_error() -> None:
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as caught:
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=False, timeout=300).run(
            lightning_digits.train, epochs=1, layout={"devices": 3, "num_nodes": 1}
        )
    assert time.monotonic() - started < 120
    first = caught.value.first_failure
    assert first is not None
    assert "ValueError" in first.reason
    assert "does not match the world size (2)" in first.output_tail
    assert "(3 * 1)" in first.output_tail


DRIVER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {examples!r})
    import torch
    from pyspark.sql import SparkSession
    import lightning_digits
    from sparktorch_ops.distributor import TorchDistributor

    spark = (
        SparkSession.builder.master({master!r})
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    result = distributor.launch(lightning_digits.train, epochs=2)
    value = result.value
    returned = torch.nn.utils.parameters_to_vector(list(value["state_dict"].values()))
    output = distributor.run({script!r}, "--epochs=1")
    print("RESULT " + json.dumps({{
        "mode": result.mode,
        "layout": value["layout"],
        "world_size": value["world_size"],
        "same_weights": [torch.equal(row, returned) for row in value["rank_weights"]],
        "losses": value["losses"],
        "test_accuracy": value["test_accuracy"],
        "metric_ranks": sorted({{m.rank for m in result.metrics}}),
        "script_last_line": output.strip().splitlines()[-1],
    }}))
    spark.stop()
    """
)


@pytest.mark.cluster
def test_lightning_barrier_mode_on_standalone_cluster(
    standalone_cluster: cluster_support.Cluster, tmp_path: Path
) -> None:
    driver = tmp_path / "driver.py"
    driver.write_text(
        DRIVER.format(
            examples=str(ROOT / "examples"),
            master=standalone_cluster.master_url,
            script=str(EXAMPLE),
        )
    )
    proc = subprocess.run(
        [sys.executable, str(driver)],
        cwd=tmp_path,
        env=cluster_support.cluster_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line[len("RESULT ") :])
    # Two barrier tasks of one rank each: Lightning sees 2 nodes of 1 device.
    assert got["mode"] == "barrier"
    assert got["layout"] == {"devices": 1, "num_nodes": 2}
    assert got["world_size"] == 2
    assert got["same_weights"] == [True, True]
    assert got["losses"][-1] < 0.6 * got["losses"][0]
    assert got["test_accuracy"] > 0.75
    assert got["metric_ranks"] == [0, 1]
    assert "world_size=2 layout={'devices': 1, 'num_nodes': 2}" in got["script_last_line"]
