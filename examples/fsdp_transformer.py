"""FSDP2 (``fully_shard``) training of a small transformer LM: a torchrun script and its driver.

    torchrun --nproc-per-node=2 examples/fsdp_transformer.py --steps 30   # plain torchrun
    python examples/fsdp_transformer.py            # run(train) on 2 local ranks, no Spark
    python examples/fsdp_transformer.py --barrier  # 2 barrier tasks on local[2] Spark

Every transformer block and then the whole model are wrapped with
``torch.distributed.fsdp.fully_shard``, so each rank holds only its shard of every parameter
(gloo on CPU, NCCL on GPUs). After training, ``get_model_state_dict`` with
``full_state_dict=True, cpu_offload=True`` gathers the full weights onto rank 0, which returns
them. :func:`reference_train` trains the same model in one process on the same global batches:
FSDP's averaged gradients make both end with the same weights (up to float rounding).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

try:
    from sparktorch_ops import report
except ImportError:  # plain torchrun without sparktorch_ops

    def report(step: int | None = None, progress: float | None = None, **values: Any) -> None:
        """No-op stand-in."""


VOCAB = 32
SEQ_LEN = 16


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        # No attention biases (as in LLaMA): the key bias gets no gradient, so Adam would
        # only amplify rounding noise in it and the comparison with one process would be moot.
        self.attn = nn.MultiheadAttention(dim, heads, bias=False, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A GPT-style language model small enough to train on CPU in seconds."""

    def __init__(self, dim: int = 64, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(SEQ_LEN, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        mask = torch.triu(
            torch.full((length, length), float("-inf"), device=tokens.device), diagonal=1
        )
        x = self.tok(tokens) + self.pos[:length]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def batches(seed: int, steps: int, global_batch: int) -> torch.Tensor:
    """``[steps, global_batch, SEQ_LEN + 1]`` arithmetic sequences mod VOCAB (random start and
    stride): the next token is predictable from the previous two."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (steps, global_batch, 1), generator=generator)
    stride = torch.randint(1, 6, (steps, global_batch, 1), generator=generator)
    return (start + stride * torch.arange(SEQ_LEN + 1)) % VOCAB


def _loss(model: nn.Module, seq: torch.Tensor) -> torch.Tensor:
    logits = model(seq[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))


def train(
    steps: int = 30, lr: float = 3e-3, global_batch: int = 16, seed: int = 0
) -> dict[str, Any] | None:
    """Train with FSDP2 on every rank; rank 0 returns the gathered full state dict.

    Args:
        steps: optimizer steps.
        lr: AdamW's learning rate.
        global_batch: sequences per step over all ranks (a multiple of the world size).
        seed: seeds the weights and the data.

    Returns:
        On rank 0: ``state_dict`` (full, unsharded, on CPU), ``losses`` (per step, averaged over
        ranks), ``world_size``, ``full_numel`` (parameters of the model) and ``shard_numel``
        (parameters each rank held, by rank). None on the other ranks.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if global_batch % world:
            raise ValueError(f"global_batch={global_batch} is not a multiple of {world} ranks")
        mesh = init_device_mesh(device.type, (world,))
        torch.manual_seed(seed)
        model = TinyLM().to(device)
        full_numel = sum(p.numel() for p in model.parameters())
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        held = sum(
            p.to_local().numel() if isinstance(p, DTensor) else p.numel()
            for p in model.parameters()
        )
        shard = torch.tensor([held], device=device)
        shards = [torch.zeros_like(shard) for _ in range(world)]
        dist.all_gather(shards, shard)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        data = batches(seed, steps, global_batch)
        per_rank = global_batch // world
        losses: list[float] = []
        for step in range(steps):
            seq = data[step, rank * per_rank : (rank + 1) * per_rank].to(device)
            loss = _loss(model, seq)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
            report(step=step, progress=(step + 1) / steps, loss=losses[-1])
            if rank == 0 and (step % 10 == 9 or step == steps - 1):
                print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
        full = cast(
            dict[str, torch.Tensor],
            get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            ),
        )
        if rank != 0:
            return None
        return {
            "state_dict": {k: v.detach().clone() for k, v in full.items()},
            "losses": losses,
            "world_size": world,
            "full_numel": full_numel,
            "shard_numel": [int(s.item()) for s in shards],
        }
    finally:
        dist.destroy_process_group()


def reference_train(
    steps: int = 30, lr: float = 3e-3, global_batch: int = 16, seed: int = 0
) -> dict[str, Any]:
    """The same training in one process on whole global batches (what FSDP must reproduce)."""
    torch.manual_seed(seed)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    data = batches(seed, steps, global_batch)
    losses = []
    for step in range(steps):
        loss = _loss(model, data[step])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"state_dict": model.state_dict(), "losses": losses}


def _as_rank(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(description="one rank of the FSDP example")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--output", default=None, help="where rank 0 saves the full weights")
    args = parser.parse_args(argv)
    result = train(steps=args.steps, lr=args.lr)
    if result is not None:
        print(
            f"final_loss={result['losses'][-1]:.4f} world_size={result['world_size']} "
            f"params={result['full_numel']} per_rank={result['shard_numel']}"
        )
        if args.output:
            torch.save(result["state_dict"], args.output)


def _as_driver(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--barrier", action="store_true", help="run on local[2] Spark")
    parser.add_argument("--gpu", action="store_true", help="use_gpu=True (NCCL)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from sparktorch_ops.distributor import TorchDistributor

    spark = None
    if args.barrier:
        from pyspark.sql import SparkSession

        spark = (
            SparkSession.builder.master("local[2]")
            .config("spark.driver.host", "127.0.0.1")
            .getOrCreate()
        )
    distributor = TorchDistributor(
        num_processes=2, local_mode=not args.barrier, use_gpu=args.gpu, spark=spark
    )
    result = distributor.launch(train, steps=args.steps)
    value = result.value
    print(
        f"loss {value['losses'][0]:.3f} -> {value['losses'][-1]:.3f}; full state dict of "
        f"{len(value['state_dict'])} tensors ({value['full_numel']} parameters) on the driver; "
        f"each rank held {value['shard_numel']}; took {result.duration.total_seconds():.1f} s"
    )


def main(argv: list[str] | None = None) -> None:
    """A rank under torchrun (``LOCAL_RANK`` set), else the driver."""
    if "LOCAL_RANK" in os.environ:
        _as_rank(argv)
    else:
        _as_driver(argv)


if __name__ == "__main__":
    main()
