"""PyTorch Lightning's real Trainer(strategy="ddp") through TorchDistributor, every launch mode."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.procs import wait_until_gone
from sparktorch_ops.distributor import TorchDistributor
from sparktorch_ops.errors import TrainingFailedError
from sparktorch_ops.lightning import lightning_trainer_kwargs

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


def test_lightning_barrier_mode(spark: Any) -> None:
    """Two barrier tasks of one rank each on the shared session: Lightning sees 2 nodes of 1
    device, as on a cluster of two executors."""
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark)
    result = distributor.launch(lightning_digits.train, epochs=2)
    assert result.mode == "barrier"
    _check_fit(result.value, {"devices": 1, "num_nodes": 2})
    assert sorted({m.rank for m in result.metrics}) == [0, 1]
    output = distributor.run(str(EXAMPLE), "--epochs=1")
    last = output.strip().splitlines()[-1]
    assert "world_size=2 layout={'devices': 1, 'num_nodes': 2}" in last, output
