"""FSDP2 (torch's fully_shard) through TorchDistributor on CPU with gloo."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from harness.procs import wait_until_gone
from sparktorch_ops.distributor import TorchDistributor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import fsdp_transformer  # noqa: E402

STEPS = 20


def test_fsdp_full_state_dict_reaches_driver_and_matches_one_process() -> None:
    result = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).launch(
        fsdp_transformer.train, steps=STEPS
    )
    value = result.value
    assert value["world_size"] == 2
    # Sharded for real: each rank held half the parameters, not a replica.
    assert sum(value["shard_numel"]) == value["full_numel"]
    assert max(value["shard_numel"]) < 0.6 * value["full_numel"]

    reference = fsdp_transformer.reference_train(steps=STEPS)
    expected = reference["state_dict"]
    got = value["state_dict"]
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert type(got[name]) is torch.Tensor, f"{name} came back as {type(got[name]).__name__}"
        assert got[name].shape == tensor.shape, name
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-4, msg=name)
    torch.testing.assert_close(value["losses"], reference["losses"], rtol=1e-4, atol=1e-4)
    assert value["losses"][-1] < 0.75 * value["losses"][0]
    assert [m.step for m in result.metrics if m.rank == 1] == list(range(STEPS))
    assert wait_until_gone(result.run_id) == []
