"""The exact layout: Spark's INT hash and a key per task; when the input is read as it is."""

from __future__ import annotations

import pytest

from sparktorch_ops.spark.dataframe import (
    InputFacts,
    PreparedInput,
    barrier_refused,
    partition_keys,
    spark_hash_int,
)

pytestmark = pytest.mark.unit

# SELECT hash(CAST(v AS INT)) on Spark 4.3 for these v.
SPARK_HASHES = {
    0: 933211791,
    1: -559580957,
    2: 1765031574,
    3: -1823081949,
    -1: -1604776387,
    42: 29417773,
    123456: 1905992991,
    -2147483648: 723455942,
    2147483647: 133916647,
}


@pytest.mark.parametrize(("value", "expected"), sorted(SPARK_HASHES.items()))
def test_the_hash_is_sparks(value: int, expected: int) -> None:
    assert spark_hash_int(value) == expected


@pytest.mark.parametrize("tasks", [1, 2, 3, 7, 64, 513])
def test_each_task_gets_a_key_that_lands_in_its_partition(tasks: int) -> None:
    keys = partition_keys(tasks)
    assert len(keys) == tasks == len(set(keys))
    assert [spark_hash_int(key) % tasks for key in keys] == list(range(tasks))


def _prepared(partition_rows: list[tuple[int, int]], partitions: int | None) -> PreparedInput:
    facts = InputFacts(
        rows=sum(rows for _, rows in partition_rows),
        columns=("id",),
        schema_json="{}",
        partition_rows=tuple(partition_rows),
        partitions=partitions,
    )
    return PreparedInput(object(), facts, "a DataFrame")


@pytest.mark.parametrize(
    ("partition_rows", "partitions", "tasks", "fits"),
    [
        ([(0, 500), (1, 500)], 2, 2, True),  # already the layout: read as it is
        ([(0, 501), (1, 500)], 2, 2, True),  # within one row, as the shuffle's layout
        ([(0, 500), (1, 501), (2, 500)], 3, 3, True),
        ([(0, 502), (1, 500)], 2, 2, False),  # two rows apart: the ranks would repeat rows
        ([(0, 500), (1, 500)], 3, 2, False),  # an empty third partition: a third task
        ([(0, 500), (1, 500)], None, 2, False),  # unknown count (Connect, a shuffled plan)
        ([(0, 500), (2, 500)], 3, 2, False),  # an empty partition in between
        ([(0, 250), (1, 250), (2, 250), (3, 250)], 4, 2, False),  # more partitions than tasks
        ([(0, 1000)], 1, 2, False),  # fewer partitions than tasks
    ],
)
def test_only_an_input_already_laid_out_skips_the_shuffle(
    partition_rows: list[tuple[int, int]], partitions: int | None, tasks: int, fits: bool
) -> None:
    prepared = _prepared(partition_rows, partitions)
    assert prepared.fits(tasks) is fits
    if fits:
        assert prepared.laid_out(tasks) is prepared.dataframe


def test_a_barrier_refusal_is_told_from_other_failures() -> None:
    class Java:
        def toString(self) -> str:
            return (
                "org.apache.spark.scheduler.BarrierJobUnsupportedRDDChainException: "
                "[SPARK-24820][SPARK-24821]: Barrier execution mode does not allow the following "
                "pattern of RDD chain within a barrier stage"
            )

    refused = RuntimeError("An error occurred while calling o42.collectToPython.")
    refused.java_exception = Java()  # type: ignore[attr-defined]
    assert barrier_refused(refused)
    assert not barrier_refused(RuntimeError("Job aborted due to stage failure"))
