"""A DeepSpeed training script (ZeRO stage 1 on CPU, or on GPUs), and its driver.

    torchrun --nproc-per-node=2 examples/deepspeed_train.py --deepspeed \\
        --deepspeed_config examples/deepspeed_config.json          # plain torchrun
    DS_ACCELERATOR=cpu python examples/deepspeed_train.py          # 2 local ranks, our distributor
    python examples/deepspeed_train.py --barrier                   # 2 barrier tasks, local[2] Spark
    python examples/deepspeed_train.py --gpu                       # 2 GPUs of this machine, NCCL

Under torchrun (``LOCAL_RANK`` set) it is an ordinary DeepSpeed script: it parses DeepSpeed's
``--deepspeed --deepspeed_config FILE`` and calls ``deepspeed.initialize``. Otherwise it is the
driver: ``DeepspeedTorchDistributor`` (pyspark's signature) runs this same file with
``deepspeedConfig`` as a dict, which reaches each rank as a temporary file. Needs the
``deepspeed`` package (not in the default environment; see the README).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:
    from sparktorch_ops import report
except ImportError:  # plain torchrun without sparktorch_ops

    def report(step: int | None = None, progress: float | None = None, **values: Any) -> None:
        """No-op stand-in."""


def default_config(use_gpu: bool = False) -> dict[str, Any]:
    """A DeepSpeed config for this example: AdamW (torch's), ZeRO stage 1, fp32 on CPU."""
    return {
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": use_gpu},
        "steps_per_print": 1000,
    }


def synthetic_data(
    seed: int = 0, samples: int = 2048, features: int = 20
) -> tuple[torch.Tensor, torch.Tensor]:
    """Four classes that a small MLP can separate, the same on every rank for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator)
    teacher = torch.randn(features, 4, generator=generator)
    return x, (x @ teacher).argmax(1)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train with ``deepspeed.initialize`` on every rank; return rank 0's view of the result."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    x, y = synthetic_data(args.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = x[rank::world], y[rank::world]
    batch = engine.train_micro_batch_size_per_gpu()
    dtype = next(engine.module.parameters()).dtype
    losses: list[float] = []
    for epoch in range(args.epochs):
        total = torch.zeros(2, dtype=torch.float64)
        for start in range(0, len(y) - batch + 1, batch):
            xb = x[start : start + batch].to(engine.device, dtype)
            yb = y[start : start + batch].to(engine.device)
            loss = F.cross_entropy(engine(xb).float(), yb)
            engine.backward(loss)
            engine.step()
            total += torch.tensor([loss.item() * len(yb), len(yb)], dtype=torch.float64)
        total = total.to(engine.device)
        dist.all_reduce(total)
        losses.append(float(total[0] / total[1]))
        report(step=epoch, progress=(epoch + 1) / args.epochs, loss=losses[-1])
        if rank == 0:
            print(f"epoch {epoch}: loss {losses[-1]:.4f}", flush=True)
    with torch.no_grad():
        accuracy = float((engine(x.to(engine.device, dtype)).argmax(1).cpu() == y).float().mean())
    return {
        "losses": losses,
        "accuracy": accuracy,
        "world_size": world,
        "zero_stage": engine.zero_optimization_stage(),
        "config_path": args.deepspeed_config,
    }


def _as_rank(argv: list[str] | None) -> None:
    import deepspeed

    parser = argparse.ArgumentParser(description="one rank of the DeepSpeed example")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=-1, help="DeepSpeed's launcher passes it")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    result = train(args)
    if int(os.environ.get("RANK", "0")) == 0:
        config_exists = bool(args.deepspeed_config) and os.path.isfile(args.deepspeed_config)
        print(
            f"final_loss={result['losses'][-1]:.4f} accuracy={result['accuracy']:.4f} "
            f"world_size={result['world_size']} zero_stage={result['zero_stage']} "
            f"config_file_present={config_exists}",
            flush=True,
        )


def _as_driver(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--barrier", action="store_true", help="run on local[2] Spark")
    parser.add_argument("--gpu", action="store_true", help="useGpu=True")
    parser.add_argument("--num-gpus", type=int, default=2, help="ranks (numGpus)")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from sparktorch_ops.deepspeed import DeepspeedTorchDistributor

    spark = None
    if args.barrier:
        from pyspark.sql import SparkSession

        spark = (
            SparkSession.builder.master(f"local[{args.num_gpus}]")
            .config("spark.driver.host", "127.0.0.1")
            .getOrCreate()
        )
    distributor = DeepspeedTorchDistributor(
        numGpus=args.num_gpus,
        nnodes=1,
        localMode=not args.barrier,
        useGpu=args.gpu,
        deepspeedConfig=default_config(args.gpu),
        spark=spark,
    )
    output = distributor.run(os.path.abspath(__file__), f"--epochs={args.epochs}")
    print(output.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """A rank under torchrun (``LOCAL_RANK`` set), else the driver."""
    if "LOCAL_RANK" in os.environ:
        _as_rank(argv)
    else:
        _as_driver(argv)


if __name__ == "__main__":
    main()
