"""Our shards are pyspark's: pyspark's own partition loader reads them, and ours matches it.

A real DataFrame (every type pyspark's loader supports, ML vectors dense and sparse) goes through
``toArrow()`` into our writer; pyspark's ``_get_spark_partition_data_loader`` and
``sparktorch_ops.data.get_spark_partition_data_loader`` then read the same shard and must yield
equal batches (values, dtypes and shapes), including when ``num_samples`` wraps around.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from sparktorch_ops import data
from sparktorch_ops.data import shards as shard_format
from tests.support.shards import rank_env


@pytest.fixture(scope="module")
def frame(spark: Any) -> Any:
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql import types as T

    schema = T.StructType(
        [
            T.StructField("id", T.LongType()),
            T.StructField("f", T.FloatType()),
            T.StructField("d", T.DoubleType()),
            T.StructField("i", T.IntegerType()),
            T.StructField("s", T.ShortType()),
            T.StructField("af", T.ArrayType(T.FloatType())),
            T.StructField("ad", T.ArrayType(T.DoubleType())),
            T.StructField("ai", T.ArrayType(T.IntegerType())),
            T.StructField("al", T.ArrayType(T.LongType())),
            T.StructField("vec", VectorUDT()),
        ]
    )
    rows = [
        (
            n,
            n * 0.25,
            n / 3.0,
            n % 11,
            n % 5,
            [float(n), 1.5],
            [n / 7.0, -1.0],
            [n, n + 1],
            [n * 10, 7],
            Vectors.dense([n, 0.5, 2.0]) if n % 2 else Vectors.sparse(3, [1], [float(n)]),
        )
        for n in range(1001)
    ]
    return spark.createDataFrame(rows, schema).repartition(7)


def _shard(frame: Any, directory: Path) -> tuple[shard_format.ShardFile, str]:
    table = frame.toArrow()
    (shard,) = shard_format.write_shards(table.to_batches(), table.schema, str(directory), 1)
    schema_path = shard_format.write_schema_file(frame.schema.json(), str(directory))
    return shard, schema_path


@pytest.mark.parametrize(("num_samples", "batch_size"), [(300, 64), (1001, 128), (2500, 100)])
def test_pyspark_loader_and_ours_yield_equal_batches(
    frame: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    num_samples: int,
    batch_size: int,
) -> None:
    from pyspark.ml.torch.distributor import _get_spark_partition_data_loader

    shard, schema_path = _shard(frame, tmp_path)
    assert shard.rows == 1001
    for name, value in rank_env(shard.path, schema_path, shard.rows).items():
        monkeypatch.setenv(name, value)
    assert os.environ["SPARK_PARTITION_ARROW_DATA_FILE"] == shard.path

    theirs = list(_get_spark_partition_data_loader(num_samples, batch_size, num_workers=0))
    in_process = list(data.get_spark_partition_data_loader(num_samples, batch_size, num_workers=0))
    in_a_worker = list(data.get_spark_partition_data_loader(num_samples, batch_size))  # 1 worker
    for ours in (in_process, in_a_worker):
        assert len(ours) == len(theirs) == -(-num_samples // batch_size)
        for mine, reference in zip(ours, theirs, strict=True):
            assert isinstance(mine, list) and len(mine) == len(reference) == 10
            for got, want in zip(mine, reference, strict=True):
                assert got.dtype == want.dtype and got.shape == want.shape
                assert torch.equal(got, want)


def test_pyspark_loader_reads_our_shards_of_a_multi_rank_layout(
    frame: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pyspark.ml.torch.distributor import _get_spark_partition_data_loader

    table = frame.toArrow()
    shards = shard_format.write_shards(table.to_batches(), table.schema, str(tmp_path), 2)
    schema_path = shard_format.write_schema_file(frame.schema.json(), str(tmp_path))
    rows = shard_format.epoch_rows(s.rows for s in shards)
    ids: list[int] = []
    for shard in shards:
        for name, value in rank_env(shard.path, schema_path, rows).items():
            monkeypatch.setenv(name, value)
        loader = _get_spark_partition_data_loader(shard.rows, 50, num_workers=0)
        ids += [int(i) for batch in loader for i in batch[0]]
        ours = data.partition_loader(50)
        assert len(ours) == -(-rows // 50)
    assert sorted(ids) == list(range(1001))
