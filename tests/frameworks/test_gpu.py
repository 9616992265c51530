"""The GPU path: local mode with ``use_gpu=True`` and NCCL (skipped without a CUDA GPU).

Runs on a GPU machine without Java or pyspark: ``pytest --noconftest -m gpu
tests/frameworks/test_gpu.py`` (what ``benchmarks/gpu_check.sh`` does). Imports nothing from
Spark, nor tests/conftest.py's fixtures. One rank per GPU: NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.procs import wait_until_gone
from sparktorch_ops.distributor import TorchDistributor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU"),
]


def _where_am_i() -> dict[str, Any]:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")
    try:
        value = torch.ones(1, device="cuda")
        torch.distributed.all_reduce(value)
        name = torch.cuda.get_device_name()
        info = {
            "rank": torch.distributed.get_rank(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device": torch.cuda.current_device(),
            "uuid": str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid),
            "name": name,
            "sum": float(value.item()),
        }
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, info)
        return {"ranks": gathered}
    finally:
        torch.distributed.destroy_process_group()


def test_each_rank_gets_its_own_gpu_and_nccl_works() -> None:
    result = TorchDistributor(num_processes=GPUS, local_mode=True, use_gpu=True).launch(_where_am_i)
    ranks = result.value["ranks"]
    assert [r["rank"] for r in ranks] == list(range(GPUS))
    assert [r["device"] for r in ranks] == list(range(GPUS))  # cuda:LOCAL_RANK
    assert len({r["uuid"] for r in ranks}) == GPUS  # distinct physical GPUs
    assert all(r["sum"] == GPUS for r in ranks)
    assert wait_until_gone(result.run_id) == []


def test_ddp_example_function_and_script_on_gpus() -> None:
    import ddp_train

    d = TorchDistributor(num_processes=GPUS, local_mode=True, use_gpu=True)
    value = d.run(ddp_train.train, epochs=3)
    assert value["world_size"] == GPUS
    assert value["test_accuracy"] > 0.8
    output = d.run(str(ROOT / "examples" / "ddp_train.py"), "--epochs=3")
    assert "test_accuracy=" in output


def test_lightning_example_on_gpus() -> None:
    import lightning_digits

    d = TorchDistributor(num_processes=GPUS, local_mode=True, use_gpu=True)
    value = d.run(lightning_digits.train, epochs=3)
    assert value["layout"] == {"devices": GPUS, "num_nodes": 1}
    returned = torch.nn.utils.parameters_to_vector(list(value["state_dict"].values()))
    assert all(torch.equal(row, returned) for row in value["rank_weights"])
    assert value["test_accuracy"] > 0.75
    output = d.run(str(ROOT / "examples" / "lightning_digits.py"), "--epochs=1")
    assert f"layout={{'devices': {GPUS}, 'num_nodes': 1}}" in output


def test_fsdp_example_on_gpus() -> None:
    import fsdp_transformer

    value = TorchDistributor(num_processes=GPUS, local_mode=True, use_gpu=True).run(
        fsdp_transformer.train, steps=20, global_batch=16 * GPUS
    )
    assert value["world_size"] == GPUS
    assert sum(value["shard_numel"]) == value["full_numel"]
    assert all(t.device.type == "cpu" for t in value["state_dict"].values())
    assert value["losses"][-1] < 0.75 * value["losses"][0]


def test_resnet50_benchmark_step_through_ours() -> None:
    output = TorchDistributor(num_processes=GPUS, local_mode=True, use_gpu=True).run(
        str(ROOT / "benchmarks" / "gpu" / "resnet_bench.py"), "--steps=5", "--warmup=2"
    )
    assert '"parameters": 25557032' in output
    assert '"images_per_s"' in output
