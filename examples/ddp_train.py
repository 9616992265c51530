"""DDP training of a small CNN on scikit-learn's digits: an ordinary torchrun script.

    torchrun --nproc-per-node=2 examples/ddp_train.py --epochs 5
    sparktorch-ops run --num-processes 2 examples/ddp_train.py -- --epochs 5

gloo on CPU, NCCL when a GPU is there. Rank 0 prints the final loss and accuracy (and saves the
weights with --output). It reports metrics through sparktorch_ops when that is installed and
runs the same without it.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

try:
    from sparktorch_ops import report
except ImportError:  # plain torchrun without sparktorch_ops

    def report(step: int | None = None, progress: float | None = None, **values: Any) -> None:
        """No-op stand-in."""


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


def load_digits(seed: int = 0, data_path: str | None = None) -> dict[str, torch.Tensor]:
    """Train/test tensors: from ``data_path`` (an .npz) or scikit-learn's bundled digits."""
    import numpy as np

    if data_path:
        arrays = dict(np.load(data_path))
    else:
        from sklearn.datasets import load_digits as sklearn_digits

        digits = sklearn_digits()
        order = np.random.default_rng(seed).permutation(len(digits.target))
        images = (digits.images[order] / 16.0).astype("float32")[:, None]
        labels = digits.target[order].astype("int64")
        split = int(0.75 * len(labels))
        arrays = {
            "x_train": images[:split],
            "y_train": labels[:split],
            "x_test": images[split:],
            "y_test": labels[split:],
        }
    return {key: torch.from_numpy(value) for key, value in arrays.items()}


def _device() -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _fit(
    batches: Any,
    epochs: int,
    lr: float,
    seed: int,
    device: torch.device,
    test: tuple[torch.Tensor, torch.Tensor] | None,
) -> dict[str, Any]:
    """The DDP training loop both entry points share: ``batches(epoch)`` yields ``(x, y)``.

    With a ``checkpoint_dir`` (``SPARKTORCH_CHECKPOINT_DIR``), the model, optimizer and losses
    are saved after every epoch, and a restarted or retried run resumes after the latest
    complete one (or, when there is none yet, starts from ``warm_start_from``'s weights).
    """
    torch.manual_seed(seed)
    model = DistributedDataParallel(
        DigitsCNN().to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses: list[float] = []
    checkpoints = None
    first_epoch = 0
    if os.environ.get("SPARKTORCH_CHECKPOINT_DIR"):
        from sparktorch_ops import checkpoint as checkpoints

        state = checkpoints.TrainingState(model, optimizer, losses=losses)
        resumed = checkpoints.load_latest(state)
        if resumed is not None:
            first_epoch, losses = resumed + 1, state.extra["losses"]
    for epoch in range(first_epoch, epochs):
        total, count = 0.0, 0
        for x, y in batches(epoch):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            total, count = total + loss.item() * len(y), count + len(y)
        epoch_loss = torch.tensor([total, count], dtype=torch.float64, device=device)
        dist.all_reduce(epoch_loss)
        losses.append(float(epoch_loss[0] / epoch_loss[1]))
        report(step=epoch, progress=(epoch + 1) / epochs, loss=losses[-1])
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {losses[-1]:.4f}", flush=True)
        if checkpoints is not None:
            # Written in the background while the next epoch trains.
            checkpoints.save(
                checkpoints.TrainingState(model, optimizer, losses=losses),
                epoch,
                blocking=False,
            )
    if checkpoints is not None:
        checkpoints.wait()  # the last one commits before the caller destroys the process group
    accuracy = None
    if test is not None:
        with torch.no_grad():
            logits = model.module(test[0].to(device))
            accuracy = float((logits.argmax(1).cpu() == test[1]).float().mean())
    state_dict = {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}
    return {
        "state_dict": state_dict,
        "losses": losses,
        "test_accuracy": accuracy,
        "world_size": dist.get_world_size(),
        "first_epoch": first_epoch,
    }


def train(
    epochs: int = 5,
    lr: float = 0.05,
    batch_size: int = 64,
    seed: int = 0,
    data_path: str | None = None,
) -> dict[str, Any]:
    """Train with DDP on every rank; every rank returns the same weights and its losses."""
    device = _device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        data = load_digits(seed, data_path)
        dataset = TensorDataset(data["x_train"], data["y_train"])
        sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)

        def batches(epoch: int) -> Any:
            sampler.set_epoch(epoch)
            return loader

        return _fit(batches, epochs, lr, seed, device, (data["x_test"], data["y_test"]))
    finally:
        dist.destroy_process_group()


def train_on_partition(
    epochs: int = 5, lr: float = 0.05, batch_size: int = 64, seed: int = 0
) -> dict[str, Any]:
    """Train with DDP on the rows Spark gave this rank (``TorchDistributor.train_on_dataframe``
    or an ``input_sql``): columns ``pixels`` (64 floats) and ``label``, shuffled per epoch.
    Every rank gets the same number of batches, so DDP's all-reduces never wait on a rank
    that ran out of data."""
    from sparktorch_ops.data import partition_loader

    device = _device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        loader = partition_loader(batch_size, columns=["pixels", "label"], shuffle=True, seed=seed)

        def batches(epoch: int) -> Any:
            loader.set_epoch(epoch)
            return ((b["pixels"].view(-1, 1, 8, 8), b["label"].long()) for b in loader)

        return _fit(batches, epochs, lr, seed, device, None)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Command line: train, then rank 0 prints the results and saves the weights."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None, help="an .npz with x_train/y_train/x_test/y_test")
    parser.add_argument("--output", default=None, help="where rank 0 saves the weights")
    args = parser.parse_args(argv)
    result = train(args.epochs, args.lr, args.batch_size, args.seed, args.data)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"final_loss={result['losses'][-1]:.4f} test_accuracy={result['test_accuracy']:.4f}")
        if args.output:
            torch.save(result["state_dict"], args.output)
            print(f"saved {args.output}")


if __name__ == "__main__":
    main()
