"""The exact layout's key arithmetic: Spark's INT hash and a key per task."""

from __future__ import annotations

import pytest

from sparktorch_ops.spark.dataframe import partition_keys, spark_hash_int

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
