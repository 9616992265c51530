"""DataFrame input: laid out over the ranks whatever its partitioning, checked before start."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from sparktorch_ops import ConfigError, TorchDistributor


def ids_seen(batch_size: int) -> dict[str, Any]:
    """Rank code: one epoch of partition_loader; every rank's ids, features and batch count."""
    import torch.distributed as dist

    from sparktorch_ops.data import partition_loader

    dist.init_process_group("gloo")
    loader = partition_loader(batch_size)
    ids: list[int] = []
    aligned = True
    batches = 0
    for batch in loader:
        batches += 1
        ids += batch["id"].tolist()
        aligned &= bool((batch["features"][:, 0] == batch["id"].double() * 2).all())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"ids": ids, "batches": batches, "aligned": aligned})
    dist.destroy_process_group()
    return {"ranks": gathered}


def _frame(spark: Any, rows: int, partitions: int) -> Any:
    from pyspark.sql import functions as F

    return (
        spark.range(rows, numPartitions=partitions)
        .withColumn("features", F.array((F.col("id") * 2).cast("double"), F.lit(1.0)))
        .withColumn("label", (F.col("id") % 3).cast("int"))
    )


@pytest.mark.parametrize("mode", ["local", "barrier"])
def test_uneven_partitions_reach_every_rank_equally(spark: Any, mode: str) -> None:
    frame = _frame(spark, 1001, 7)
    result = TorchDistributor(
        num_processes=2, local_mode=mode == "local", use_gpu=False, spark=spark
    ).launch_on_dataframe(ids_seen, frame, 64)
    ranks = result.value["ranks"]
    first, second = (set(r["ids"]) for r in ranks)
    assert first.isdisjoint(second) and first | second == set(range(1001))  # each row, one rank
    assert all(r["aligned"] for r in ranks)
    epoch = len(ranks[0]["ids"])  # the larger shard; the smaller one wraps to match it
    assert len(ranks[1]["ids"]) == epoch and epoch == max(len(first), len(second))
    assert [r["batches"] for r in ranks] == [-(-epoch // 64)] * 2
    assert sorted([len(first), len(second)]) == [500, 501]  # exact layout, whatever the input
    assert result.input == {
        "rows": 1001,
        "columns": ["id", "features", "label"],
        "source": "a DataFrame",
    }


def test_rows_that_divide_evenly_reach_exactly_one_rank_once(spark: Any) -> None:
    from pyspark.sql import functions as F

    # 1,200 rows hashed by a skewed bucket into 5 partitions of very different sizes.
    frame = _frame(spark, 1200, 3).repartition(5, (F.col("id") % 7 * F.col("id") % 5).alias("b"))
    assert len(set(frame.rdd.glom().map(len).collect())) > 1
    result = TorchDistributor(
        num_processes=2, local_mode=False, use_gpu=False, spark=spark
    ).launch_on_dataframe(ids_seen, frame, 50)
    seen = sorted(i for rank in result.value["ranks"] for i in rank["ids"])
    assert seen == list(range(1200))  # no row twice, none missing
    assert [len(rank["ids"]) for rank in result.value["ranks"]] == [600, 600]


@pytest.mark.parametrize("rows", [1000, 1001])
def test_an_input_already_laid_out_is_read_without_a_shuffle(spark: Any, rows: int) -> None:
    from sparktorch_ops.spark.dataframe import DataInput, prepare_input

    frame = _frame(spark, rows, 2)  # two partitions, one per task, within one row
    prepared = prepare_input(DataInput(dataframe=frame), spark)
    assert prepared.fits(2) and prepared.laid_out(2) is frame
    result = TorchDistributor(
        num_processes=2, local_mode=False, use_gpu=False, spark=spark
    ).launch_on_dataframe(ids_seen, frame, 64)
    ranks = result.value["ranks"]
    first, second = (set(r["ids"]) for r in ranks)
    assert first.isdisjoint(second) and first | second == set(range(rows))
    assert sorted([len(first), len(second)]) == [rows // 2, rows - rows // 2]
    assert all(r["aligned"] for r in ranks)
    assert [r["batches"] for r in ranks] == [-(-(rows - rows // 2) // 64)] * 2


def test_an_input_a_barrier_stage_cannot_read_as_it_is_is_shuffled(
    spark: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Four partitions coalesced into two are the layout's partitions, but a barrier stage
    # cannot hold RDDs of other partition counts: Spark refuses it and the layout shuffles.
    from sparktorch_ops.spark.dataframe import DataInput, prepare_input

    frame = _frame(spark, 600, 4).coalesce(2)
    assert prepare_input(DataInput(dataframe=frame), spark).fits(2)  # so read as it is first
    caplog.set_level(logging.DEBUG, logger="sparktorch_ops.launchers.barrier")
    result = TorchDistributor(
        num_processes=2, local_mode=False, use_gpu=False, spark=spark
    ).launch_on_dataframe(ids_seen, frame, 32)
    seen = sorted(i for rank in result.value["ranks"] for i in rank["ids"])
    assert seen == list(range(600))
    assert [len(rank["ids"]) for rank in result.value["ranks"]] == [300, 300]
    assert "cannot read the input as it is" in caplog.text  # refused, then shuffled


def test_fewer_partitions_than_ranks_still_give_equal_shards(spark: Any) -> None:
    result = TorchDistributor(
        num_processes=2, local_mode=False, use_gpu=False, spark=spark
    ).launch_on_dataframe(ids_seen, _frame(spark, 301, 1), 32)
    first, second = (set(r["ids"]) for r in result.value["ranks"])
    assert first.isdisjoint(second) and first | second == set(range(301))
    assert sorted([len(first), len(second)]) == [150, 151]


def test_fewer_rows_than_ranks_fail_once_the_shards_are_written(spark: Any) -> None:
    # The agents start while the shards are written; the task stops its own when a rank of
    # the run would get no rows.
    from sparktorch_ops import TrainingFailedError

    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark)
    with pytest.raises(TrainingFailedError, match="fewer rows than ranks"):
        distributor.train_on_dataframe(ids_seen, _frame(spark, 1, 1), 4)


def test_an_input_that_fails_while_the_shards_are_written_fails_the_run(spark: Any) -> None:
    # A read that fails while a task writes its shards (here: a row of a column the check
    # never evaluates) fails the run's Spark job (Spark's barrier failure does not carry the
    # task's error), with the agents already started; the session's next run is unharmed.
    from pyspark.sql import functions as F

    from sparktorch_ops import TrainingFailedError

    broken = _frame(spark, 2000, 2).withColumn(
        "label", F.when(F.col("id") == 1500, F.raise_error(F.lit("row 1500 is bad"))).otherwise(1)
    )
    distributor = TorchDistributor(
        num_processes=2, local_mode=False, use_gpu=False, spark=spark, timeout=120
    )
    with pytest.raises(TrainingFailedError, match="the Spark job failed"):
        distributor.train_on_dataframe(ids_seen, broken, 64)
    after = distributor.launch_on_dataframe(ids_seen, _frame(spark, 200, 2), 64)
    assert sorted(len(r["ids"]) for r in after.value["ranks"]) == [100, 100]


def test_pyspark_name_and_bad_input_are_typed_errors(spark: Any) -> None:
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark)
    assert distributor._train_on_dataframe == distributor.train_on_dataframe
    with pytest.raises(ConfigError, match="empty") as empty:
        distributor.train_on_dataframe(ids_seen, _frame(spark, 10, 2).limit(0), 4)
    assert empty.value.argument == "dataframe"
    with pytest.raises(ConfigError, match="'name'"):
        distributor.train_on_dataframe(
            ids_seen, spark.createDataFrame([(1, "a")], "id long, name string"), 4
        )
    with pytest.raises(ConfigError, match="different lengths"):
        distributor.train_on_dataframe(
            ids_seen, spark.createDataFrame([([1.0],), ([1.0, 2.0],)], "v array<double>"), 4
        )
    with pytest.raises(ConfigError, match="DataFrame"):
        distributor.train_on_dataframe(ids_seen, [1, 2, 3], 4)
