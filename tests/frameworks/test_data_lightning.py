"""Lightning trains on ``partition_loader`` as is: no sampler swapped in, set_epoch each epoch.

One process, no distributed run: the shard and the environment are what a rank would see.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from sparktorch_ops import data
from sparktorch_ops.data import shards as shard_format
from tests.support.shards import rank_env


def test_lightning_fits_on_partition_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lightning = pytest.importorskip("lightning")

    class Model(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.seen_ids: list[int] = []

        def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
            self.seen_ids += batch["id"].tolist()
            prediction = self.layer(batch["x"]).squeeze(1)
            return torch.nn.functional.mse_loss(prediction, batch["y"])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    rng = np.random.default_rng(0)
    rows = 300
    x = rng.random((rows, 4), dtype=np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32)).astype(np.float32)
    batch = pa.record_batch(
        [
            pa.array(np.arange(rows)),
            pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4),
            pa.array(y),
        ],
        names=["id", "x", "y"],
    )
    (shard,) = shard_format.write_shards([batch], batch.schema, str(tmp_path), 1)
    for name, value in rank_env(shard.path, "", shard.rows).items():
        monkeypatch.setenv(name, value)

    loader = data.partition_loader(32, shuffle=True, seed=5)
    epochs: list[int] = []
    original = loader.set_epoch
    monkeypatch.setattr(loader, "set_epoch", lambda e: (epochs.append(e), original(e))[1])
    model = Model()
    trainer = lightning.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, train_dataloaders=loader)

    assert trainer.num_training_batches == len(loader) == 10
    assert epochs == [0, 1]  # Lightning's epoch reached the loader through its sampler
    first, second = model.seen_ids[:rows], model.seen_ids[rows:]
    assert sorted(first) == sorted(second) == list(range(rows))
    assert first != second  # a new order each epoch
    assert trainer.train_dataloader is loader  # not rebuilt with another sampler
