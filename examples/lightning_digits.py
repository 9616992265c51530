"""PyTorch Lightning DDP on scikit-learn's digits: the same file is a torchrun script and a driver.

    torchrun --nproc-per-node=2 examples/lightning_digits.py --epochs 2     # plain torchrun
    python examples/lightning_digits.py                 # run(train) on 2 local ranks, no Spark
    python examples/lightning_digits.py --script        # run(this file) on 2 local ranks
    python examples/lightning_digits.py --barrier       # 2 barrier tasks on local[2] Spark

Under torchrun (``LOCAL_RANK`` is set) it trains; otherwise it is the driver and launches the
training through ``sparktorch_ops.TorchDistributor``. The Trainer is ordinary Lightning code
(``strategy="ddp"``); the one line that depends on the launch, ``devices`` and ``num_nodes``,
comes from :func:`sparktorch_ops.lightning.lightning_trainer_kwargs`, which reads torchrun's
layout (local mode: ``devices=N, num_nodes=1``; barrier mode: ranks per task x tasks).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    from sparktorch_ops import report
    from sparktorch_ops.lightning import lightning_trainer_kwargs
except ImportError:  # plain torchrun without sparktorch_ops

    def report(step: int | None = None, progress: float | None = None, **values: Any) -> None:
        """No-op stand-in."""

    def lightning_trainer_kwargs(env: Mapping[str, str] | None = None) -> dict[str, int]:
        """torchrun's layout, as sparktorch_ops reads it."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return {"devices": local, "num_nodes": int(os.environ.get("WORLD_SIZE", "1")) // local}


def load_digits(seed: int = 0) -> dict[str, torch.Tensor]:
    """scikit-learn's bundled 8x8 digits, shuffled with ``seed``, 75% train / 25% test."""
    import numpy as np
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    images = torch.from_numpy((digits.images[order] / 16.0).astype("float32")[:, None])
    labels = torch.from_numpy(digits.target[order].astype("int64"))
    split = int(0.75 * len(labels))
    return {
        "x_train": images[:split],
        "y_train": labels[:split],
        "x_test": images[split:],
        "y_test": labels[split:],
    }


class DigitsCNN(nn.Module):
    """Two conv layers and a linear head for 8x8 grey digits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


class DigitsModule(L.LightningModule):
    """The CNN as a LightningModule."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.lr = lr
        self.net = DigitsCNN()
        self.epoch_losses: list[float] = []
        self._sum = torch.zeros(2, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self._sum += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64)
        return loss

    def on_train_epoch_end(self) -> None:
        # The epoch's mean loss over every rank's samples, the same number on every rank.
        total = self.trainer.strategy.reduce(self._sum.to(self.device), reduce_op="sum")
        self.epoch_losses.append(float(total[0] / total[1]))
        self._sum.zero_()
        epochs = self.trainer.max_epochs or 1
        report(
            step=self.current_epoch,
            progress=(self.current_epoch + 1) / epochs,
            loss=self.epoch_losses[-1],
        )
        if self.trainer.is_global_zero:
            print(f"epoch {self.current_epoch}: loss {self.epoch_losses[-1]:.4f}", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def train(
    epochs: int = 3,
    lr: float = 0.01,
    batch_size: int = 64,
    seed: int = 0,
    layout: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Fit with ``Trainer(strategy="ddp")`` on every rank.

    Args:
        epochs: ``max_epochs``.
        lr: Adam's learning rate.
        batch_size: per-rank batch size.
        seed: seeds the weights and the data split.
        layout: ``devices`` and ``num_nodes`` for the Trainer (default:
            ``lightning_trainer_kwargs()``, which is what every launch mode needs).

    Returns:
        ``state_dict`` (the fitted weights), ``rank_weights`` (every rank's flattened weights,
        gathered after the fit, row r = rank r), ``losses`` (per epoch, over all ranks),
        ``test_accuracy``, ``world_size`` and ``layout`` (the devices and num_nodes used).
    """
    L.seed_everything(seed, verbose=False)
    use_cuda = torch.cuda.is_available()
    layout = dict(layout if layout is not None else lightning_trainer_kwargs())
    data = load_digits(seed)
    loader = DataLoader(
        TensorDataset(data["x_train"], data["y_train"]), batch_size=batch_size, shuffle=True
    )
    module = DigitsModule(lr)
    trainer = L.Trainer(
        accelerator="gpu" if use_cuda else "cpu",
        strategy="ddp",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        devices=layout["devices"],
        num_nodes=layout["num_nodes"],
    )
    trainer.fit(module, loader)
    # Every rank's weights after the fit, to show DDP kept them identical.
    flat = torch.nn.utils.parameters_to_vector(module.parameters()).detach()
    if use_cuda:  # Lightning moved the module back to the CPU; NCCL gathers CUDA tensors only
        flat = flat.to(torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    rank_weights = [torch.empty_like(flat) for _ in range(trainer.world_size)]
    torch.distributed.all_gather(rank_weights, flat)
    with torch.no_grad():
        logits = module.cpu()(data["x_test"])
        accuracy = float((logits.argmax(1) == data["y_test"]).float().mean())
    return {
        "state_dict": {k: v.detach().cpu().clone() for k, v in module.net.state_dict().items()},
        "rank_weights": torch.stack(rank_weights).cpu(),
        "losses": list(module.epoch_losses),
        "test_accuracy": accuracy,
        "world_size": trainer.world_size,
        "layout": layout,
    }


def _as_rank(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(description="one rank of the Lightning digits training")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="where rank 0 saves the weights")
    args = parser.parse_args(argv)
    result = train(epochs=args.epochs, lr=args.lr, seed=args.seed)
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"final_loss={result['losses'][-1]:.4f} test_accuracy={result['test_accuracy']:.4f} "
            f"world_size={result['world_size']} layout={result['layout']}"
        )
        if args.output:
            torch.save(result["state_dict"], args.output)


def _as_driver(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--barrier", action="store_true", help="run on local[2] Spark")
    parser.add_argument("--script", action="store_true", help="run this file as a script")
    parser.add_argument("--gpu", action="store_true", help="use_gpu=True (NCCL)")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from sparktorch_ops.distributor import TorchDistributor

    spark = None
    if args.barrier:
        from pyspark.sql import SparkSession

        spark = (
            SparkSession.builder.master(f"local[{args.num_processes}]")
            .config("spark.driver.host", "127.0.0.1")
            .getOrCreate()
        )
    distributor = TorchDistributor(
        num_processes=args.num_processes, local_mode=not args.barrier, use_gpu=args.gpu, spark=spark
    )
    if args.script:
        output = distributor.run(os.path.abspath(__file__), f"--epochs={args.epochs}")
        print(output.strip().splitlines()[-1])
        return
    result = distributor.launch(train, epochs=args.epochs)
    value = result.value
    same = all(torch.equal(row, value["rank_weights"][0]) for row in value["rank_weights"])
    print(f"losses: {[round(x, 4) for x in value['losses']]}; layout {value['layout']}")
    print(
        f"test accuracy: {value['test_accuracy']:.3f}; all ranks hold the same weights: {same}; "
        f"took {result.duration.total_seconds():.1f} s"
    )


def main(argv: list[str] | None = None) -> None:
    """A rank under torchrun (``LOCAL_RANK`` set), else the driver."""
    if "LOCAL_RANK" in os.environ:
        _as_rank(argv)
    else:
        _as_driver(argv)


if __name__ == "__main__":
    main()
