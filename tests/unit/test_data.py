"""sparktorch_ops.data: shards written from record batches, read back as batches of tensors.

Real files in tmp_path, no mocks. The "ranks" are simulated by pointing the environment at one
shard or the other before each loader is made.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from sparktorch_ops import data
from sparktorch_ops.data import DataError
from sparktorch_ops.data import shards as shard_format
from sparktorch_ops.data.shards import ShardFile
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.wire.env import (
    DATA_FILE_ENV,
    EPOCH_ROWS_ENV,
    EPOCH_ROWS_FILE_ENV,
)
from tests.support.shards import rank_env

ROOT = Path(__file__).resolve().parents[2]
ROWS = 1001
BATCH_SIZES = (1, 299, 150, 250, 100, 200, 1)  # 7 uneven batches, 1,001 rows
VECTOR = pa.struct(
    [
        pa.field("type", pa.int8(), nullable=False),
        pa.field("size", pa.int32()),
        pa.field("indices", pa.list_(pa.field("element", pa.int32(), nullable=False))),
        pa.field("values", pa.list_(pa.field("element", pa.float64(), nullable=False))),
    ]
)
SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("x", pa.float32()),
        ("small", pa.int32()),
        ("flag", pa.bool_()),
        ("feats", pa.list_(pa.float32(), 3)),
        ("pair", pa.list_(pa.float64())),
        ("vec", VECTOR),
    ]
)


def _vector(i: int) -> dict[str, Any]:
    """Even ids: dense [i, 0, 1]; odd ids: sparse size 3 with i at index 0."""
    if i % 2 == 0:
        return {"type": 1, "size": None, "indices": None, "values": [float(i), 0.0, 1.0]}
    return {"type": 0, "size": 3, "indices": [0], "values": [float(i)]}


def _expected_vector(i: int) -> list[float]:
    return [float(i), 0.0, 1.0] if i % 2 == 0 else [float(i), 0.0, 0.0]


def make_batch(ids: range) -> pa.RecordBatch:
    idx = np.arange(ids.start, ids.stop, dtype=np.int64)
    return pa.record_batch(
        [
            pa.array(idx),
            pa.array((idx * 0.5).astype(np.float32)),
            pa.array((idx % 7).astype(np.int32)),
            pa.array(idx % 3 == 0),
            pa.FixedSizeListArray.from_arrays(
                pa.array(np.stack([idx, idx + 1, idx + 2], axis=1).ravel().astype(np.float32)), 3
            ),
            pa.array([[float(i), float(-i)] for i in idx], pa.list_(pa.float64())),
            pa.array([_vector(int(i)) for i in idx], VECTOR),
        ],
        schema=SCHEMA,
    )


def make_batches(sizes: tuple[int, ...] = BATCH_SIZES) -> list[pa.RecordBatch]:
    batches, start = [], 0
    for size in sizes:
        batches.append(make_batch(range(start, start + size)))
        start += size
    return batches


def read_ids(path: str) -> list[int]:
    with pa.ipc.open_stream(path) as reader:
        return [int(i) for batch in reader for i in batch.column("id").to_pylist()]


@pytest.fixture
def shards(tmp_path: Path) -> list[ShardFile]:
    return shard_format.write_shards(iter(make_batches()), SCHEMA, str(tmp_path / "shards"), 2)


@pytest.fixture
def as_rank(monkeypatch: pytest.MonkeyPatch, shards: list[ShardFile]) -> Any:
    rows = shard_format.epoch_rows(s.rows for s in shards)

    def point(rank: int) -> str:
        for name, value in rank_env(shards[rank].path, "", rows).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("RANK", str(rank))
        return shards[rank].path

    return point


def ids_of(loader: Any) -> list[int]:
    return [int(i) for batch in loader for i in batch["id"].tolist()]


# -- writing ------------------------------------------------------------------------------------
def test_write_shards_balances_rows_and_keeps_every_row_once(shards: list[ShardFile]) -> None:
    assert [s.rows for s in shards] == [501, 500]
    assert [os.path.basename(s.path) for s in shards] == ["rank-0.arrow", "rank-1.arrow"]
    first, second = read_ids(shards[0].path), read_ids(shards[1].path)
    assert len(first) == 501 and len(second) == 500
    assert sorted(first + second) == list(range(ROWS))  # every row exactly once
    # Row i of the stream goes to shard i % 2, across batch boundaries.
    assert all(i % 2 == 0 for i in first) and all(i % 2 == 1 for i in second)
    assert first == sorted(first)
    assert shard_format.epoch_rows([s.rows for s in shards]) == 501
    assert shard_format.epoch_rows([]) == 0


def test_write_shards_with_more_shards_than_some_batches(tmp_path: Path) -> None:
    written = shard_format.write_shards(make_batches((1, 2, 0, 4)), SCHEMA, str(tmp_path), 3)
    assert [s.rows for s in written] == [3, 2, 2]
    assert [read_ids(s.path) for s in written] == [[0, 3, 6], [1, 4], [2, 5]]


def test_write_shards_of_nothing_writes_schema_only_files(tmp_path: Path) -> None:
    written = shard_format.write_shards([], SCHEMA, str(tmp_path), 2)
    assert [s.rows for s in written] == [0, 0]
    with pa.ipc.open_stream(written[0].path) as reader:
        assert reader.schema.equals(SCHEMA)
        assert list(reader) == []


def test_write_shards_refuses_bad_count_and_mismatched_batches(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="count"):
        shard_format.write_shards([], SCHEMA, str(tmp_path), 0)
    other = pa.record_batch([pa.array([1.0])], names=["id"])
    with pytest.raises(DataError, match="columns"):
        shard_format.write_shards([other], SCHEMA, str(tmp_path), 2)
    same_names = pa.schema([("a", pa.int64())])
    with pytest.raises(DataError, match="column 'a'"):
        shard_format.write_shards(
            [pa.record_batch([pa.array([1.0])], names=["a"])], same_names, str(tmp_path), 1
        )
    # Metadata-only differences are fine.
    tagged = same_names.with_metadata({"k": "v"})
    (one,) = shard_format.write_shards(
        [pa.record_batch([pa.array([1, 2])], names=["a"])], tagged, str(tmp_path), 1
    )
    assert one.rows == 2


def test_write_schema_file(tmp_path: Path) -> None:
    schema_json = json.dumps({"type": "struct", "fields": []})
    path = shard_format.write_schema_file(schema_json, str(tmp_path))
    assert json.loads(Path(path).read_text()) == {"type": "struct", "fields": []}
    with pytest.raises(ConfigError, match="spark_schema_json"):
        shard_format.write_schema_file("{nope", str(tmp_path))


def test_a_rank_waits_for_the_rows_per_epoch_while_the_shards_are_written(
    tmp_path: Path,
) -> None:
    import threading

    environ = {EPOCH_ROWS_FILE_ENV: shard_format.epoch_rows_path(str(tmp_path))}
    waiter = threading.Thread(target=shard_format.wait_for_epoch_rows, args=(environ,))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive() and EPOCH_ROWS_ENV not in environ  # not written yet: it waits
    shard_format.write_epoch_rows(str(tmp_path), 501)
    waiter.join(10)
    assert not waiter.is_alive()
    assert environ == {EPOCH_ROWS_ENV: "501"}  # the file's variable is not left to user code
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-rows"]  # no partial file
    untouched = {"OTHER": "1"}
    shard_format.wait_for_epoch_rows(untouched)  # no file named: nothing to wait for
    assert untouched == {"OTHER": "1"}


# -- column checks ------------------------------------------------------------------------------
def test_tensor_problems_names_what_cannot_become_a_tensor() -> None:
    schema = pa.schema(
        [
            ("ok_float", pa.float32()),
            ("ok_vec", VECTOR),
            ("ok_fixed", pa.list_(pa.float64(), 4)),
            ("ok_list", pa.list_(pa.int32())),
            ("name", pa.string()),
            ("props", pa.map_(pa.string(), pa.float64())),
            ("point", pa.struct([("a", pa.float64())])),
            ("price", pa.decimal128(10, 2)),
            ("when", pa.timestamp("us", tz="UTC")),
            ("nested", pa.list_(pa.list_(pa.float32()))),
            ("tags", pa.list_(pa.string())),
            ("blob", pa.binary()),
            ("nothing", pa.null()),
        ]
    )
    problems = shard_format.tensor_problems(schema)
    assert list(problems) == [
        "name",
        "props",
        "point",
        "price",
        "when",
        "nested",
        "tags",
        "blob",
        "nothing",
    ]
    assert "string" in problems["name"] and "map" in problems["props"]
    assert "struct" in problems["point"] and "decimal" in problems["price"]
    assert "nested" in problems["nested"] and "string" in problems["tags"]
    assert shard_format.tensor_problems(SCHEMA) == {}
    assert shard_format.is_vector_type(VECTOR)
    assert not shard_format.is_vector_type(pa.struct([("type", pa.int8())]))


# -- the rank side ------------------------------------------------------------------------------
def test_loaders_outside_a_dataframe_run_say_what_to_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(DATA_FILE_ENV, raising=False)
    with pytest.raises(DataError, match=r"TorchDistributor\.train_on_dataframe"):
        data.partition_loader(8)
    with pytest.raises(DataError, match=DATA_FILE_ENV):
        data.get_spark_partition_data_loader(10, 8)
    assert issubclass(DataError, RuntimeError)


def test_bad_loader_arguments_and_environments_are_typed_errors_naming_them(
    as_rank: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    as_rank(0)
    for call, argument in [
        (lambda: data.partition_loader(8, num_workers=-1), "num_workers"),
        (lambda: data.partition_loader(8, seed="1"), "seed"),
        (lambda: data.get_spark_partition_data_loader(-1, 8), "num_samples"),
        (lambda: data.get_spark_partition_data_loader(10, 8, num_workers=-1), "num_workers"),
    ]:
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.argument == argument
    for raw, problem in [("ten", "is not an integer"), ("-3", "is negative")]:
        monkeypatch.setenv(EPOCH_ROWS_ENV, raw)
        with pytest.raises(DataError, match=f"{EPOCH_ROWS_ENV}='{raw}' {problem}"):
            data.partition_loader(8)
    monkeypatch.setenv(DATA_FILE_ENV, str(tmp_path))
    with pytest.raises(DataError, match="which is not a file"):
        data.partition_loader(8)


def test_equal_batch_counts_on_uneven_shards_and_every_row_at_least_once(as_rank: Any) -> None:
    seen: Counter[int] = Counter()
    counts = []
    for rank in (0, 1):
        as_rank(rank)
        loader = data.partition_loader(64)
        batches = list(loader)
        counts.append((len(loader), len(batches)))
        assert [len(b["id"]) for b in batches] == [64] * 7 + [501 - 7 * 64]
        seen.update(i for b in batches for i in b["id"].tolist())
    assert counts == [(8, 8), (8, 8)]
    assert set(seen) == set(range(ROWS))
    # Rank 1 (500 rows) wrapped once: its first row came twice, nothing else did.
    assert [i for i, n in seen.items() if n > 1] == [1]


def test_wrap_around_continues_from_the_shards_first_row(as_rank: Any) -> None:
    path = as_rank(1)
    shard = read_ids(path)
    assert ids_of(data.partition_loader(100)) == [*shard, shard[0]]
    os.environ[EPOCH_ROWS_ENV] = str(2 * len(shard) + 10)  # wraps more than once
    assert ids_of(data.partition_loader(7)) == shard + shard + shard[:10]


def test_drop_last_drops_the_final_partial_batch_on_every_rank(as_rank: Any) -> None:
    for rank in (0, 1):
        as_rank(rank)
        loader = data.partition_loader(64, drop_last=True)
        sizes = [len(b["id"]) for b in loader]
        assert len(loader) == 7 and sizes == [64] * 7


def test_features_stay_aligned_and_keep_their_dtypes(as_rank: Any) -> None:
    as_rank(0)
    batches = 0
    for batch in data.partition_loader(50):
        batches += 1
        ids = batch["id"]
        assert ids.dtype == torch.int64
        assert batch["x"].dtype == torch.float32 and batch["small"].dtype == torch.int32
        assert batch["flag"].dtype == torch.bool
        assert torch.equal(batch["x"], (ids.to(torch.float32) * 0.5))
        assert torch.equal(batch["small"], (ids % 7).to(torch.int32))
        assert torch.equal(batch["flag"], ids % 3 == 0)
        assert batch["feats"].shape == (len(ids), 3) and batch["feats"].dtype == torch.float32
        assert torch.equal(batch["feats"][:, 2], (ids + 2).to(torch.float32))
        assert batch["pair"].dtype == torch.float64
        assert torch.equal(batch["pair"], torch.stack([ids, -ids], 1).to(torch.float64))
    assert batches == 11  # 501 rows in batches of 50


def test_ml_vectors_dense_and_sparse_become_one_float64_matrix(as_rank: Any) -> None:
    as_rank(1)  # odd ids: sparse vectors ...
    (batch,) = list(data.partition_loader(600, columns=["vec", "id"]))
    assert list(batch) == ["vec", "id"]
    assert batch["vec"].dtype == torch.float64 and batch["vec"].shape == (501, 3)
    expected = [_expected_vector(i) for i in batch["id"].tolist()]
    assert batch["vec"].tolist() == expected
    mixed = make_batch(range(10))  # ... and dense and sparse in one record batch
    path = shard_format.write_shards([mixed], SCHEMA, os.path.dirname(os.environ[DATA_FILE_ENV]), 1)
    os.environ[DATA_FILE_ENV] = path[0].path
    os.environ[EPOCH_ROWS_ENV] = "10"
    (batch,) = list(data.partition_loader(10, columns=["vec"]))
    assert batch["vec"].tolist() == [_expected_vector(i) for i in range(10)]


def test_columns_select_and_order_and_unknown_columns_are_config_errors(as_rank: Any) -> None:
    as_rank(0)
    batch = next(iter(data.partition_loader(4, columns=["feats", "id"])))
    assert list(batch) == ["feats", "id"]
    with pytest.raises(ConfigError, match="no column 'nope'"):
        data.partition_loader(4, columns=["id", "nope"])
    with pytest.raises(ConfigError, match="columns: is empty"):
        data.partition_loader(4, columns=[])
    with pytest.raises(ConfigError, match="batch_size"):
        data.partition_loader(0)


def test_shuffle_is_the_same_for_a_seed_and_epoch_and_differs_across_epochs(
    as_rank: Any,
) -> None:
    path = as_rank(0)
    shard = read_ids(path)

    def epoch_ids(epoch: int, seed: int = 7, window: int = 2) -> list[int]:
        loader = data.partition_loader(32, shuffle=True, seed=seed, shuffle_window=window)
        loader.set_epoch(epoch)
        return ids_of(loader)

    first = epoch_ids(3)
    assert first == epoch_ids(3)  # a restart replays the order
    assert sorted(first) == shard and first != shard  # a permutation of the whole shard
    assert epoch_ids(4) != first and sorted(epoch_ids(4)) == shard
    assert epoch_ids(3, seed=8) != first
    assert epoch_ids(3, window=1) != first  # windows change the order, not the rows
    # Without set_epoch each iteration is the next epoch, starting at 0.
    loader = data.partition_loader(32, shuffle=True, seed=7, shuffle_window=2)
    assert [ids_of(loader), ids_of(loader)] == [epoch_ids(0), epoch_ids(1)]
    # Lightning reaches set_epoch through the loader's sampler.
    loader.sampler.set_epoch(3)
    assert ids_of(loader) == first and loader.epoch == 3


def test_shuffle_with_wrap_around_still_yields_every_row(as_rank: Any) -> None:
    path = as_rank(1)
    loader = data.partition_loader(64, shuffle=True, seed=1)
    ids = ids_of(loader)
    assert len(ids) == 501 and set(ids) == set(read_ids(path))
    assert len(loader) == 8


# DataLoader worker processes are forked from the test process: one that has run Airflow,
# Prefect and Spark tests before (``scripts/test.sh -m "not e2e"``) loses them at start-up, so
# the worker checks always run in a fresh interpreter of their own.
def test_dataloader_worker_processes_in_a_fresh_interpreter(tmp_path: Path) -> None:
    code = (
        "from tests.unit.test_data import worker_checks; "
        f"worker_checks({str(tmp_path)!r}); print('worker checks passed')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("worker checks passed"), proc.stdout[-3000:]


def worker_checks(scratch: str) -> None:
    """Every check that starts DataLoader worker processes, as rank 0 of two shards in
    ``scratch`` (run by the test above in a fresh interpreter)."""
    shards = shard_format.write_shards(iter(make_batches()), SCHEMA, scratch, 2)
    os.environ.update(rank_env(shards[0].path, "", shard_format.epoch_rows(s.rows for s in shards)))
    os.environ["RANK"] = "0"

    # Workers split the batches and keep their order.
    alone = ids_of(data.partition_loader(40, shuffle=True, seed=3))
    assert ids_of(data.partition_loader(40, shuffle=True, seed=3, num_workers=2)) == alone

    # The dataset survives pickling (what a spawned worker gets) and a plain DataLoader, whose
    # own conversion makes the workers' numpy batches tensors.
    loader = data.partition_loader(40, shuffle=True, seed=3)
    loader.set_epoch(2)
    expected = ids_of(loader)
    copy = pickle.loads(pickle.dumps(loader.dataset))
    assert ids_of(copy) == expected
    plain = torch.utils.data.DataLoader(loader.dataset, batch_size=None, num_workers=2)
    batches = list(plain)
    assert all(isinstance(b["feats"], torch.Tensor) for b in batches)
    assert [i for b in batches for i in b["id"].tolist()] == expected

    # pyspark's loader in worker processes yields what it yields without them.
    reference = list(data.get_spark_partition_data_loader(700, 64, num_workers=0))
    for workers in (1, 2):
        got = list(data.get_spark_partition_data_loader(700, 64, num_workers=workers))
        assert len(got) == len(reference) == 11
        for mine, theirs in zip(got, reference, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_a_string_column_is_refused_unless_left_out(tmp_path: Path, monkeypatch: Any) -> None:
    batch = pa.record_batch(
        [pa.array([1.0, 2.0, 3.0]), pa.array(["a", "b", "c"])], names=["x", "name"]
    )
    (shard,) = shard_format.write_shards([batch], batch.schema, str(tmp_path), 1)
    monkeypatch.setenv(DATA_FILE_ENV, shard.path)
    monkeypatch.setenv(EPOCH_ROWS_ENV, "3")
    with pytest.raises(DataError, match=r"'name'.*string"):
        data.partition_loader(2)
    assert ids_or_x(data.partition_loader(2, columns=["x"])) == [1.0, 2.0, 3.0]


def ids_or_x(loader: Any) -> list[float]:
    return [float(v) for batch in loader for v in batch["x"].tolist()]


def test_ragged_arrays_in_a_shard_name_the_column(tmp_path: Path, monkeypatch: Any) -> None:
    batches = [
        pa.record_batch([pa.array([[1.0, 2.0], [3.0, 4.0]])], names=["emb"]),
        pa.record_batch([pa.array([[1.0, 2.0, 3.0]])], names=["emb"]),
    ]
    (shard,) = shard_format.write_shards(batches, batches[0].schema, str(tmp_path), 1)
    monkeypatch.setenv(DATA_FILE_ENV, shard.path)
    monkeypatch.setenv(EPOCH_ROWS_ENV, "3")
    with pytest.raises(DataError, match=r"'emb'.*length 2 and 3"):
        list(data.partition_loader(2))
    inside = pa.record_batch([pa.array([[1.0], [2.0, 3.0]])], names=["emb"])
    (shard,) = shard_format.write_shards([inside], inside.schema, str(tmp_path / "b"), 1)
    monkeypatch.setenv(DATA_FILE_ENV, shard.path)
    with pytest.raises(DataError, match=r"'emb'.*different lengths"):
        list(data.partition_loader(2))


def test_nulls_become_nan_in_floats_and_an_error_elsewhere(
    tmp_path: Path, monkeypatch: Any
) -> None:
    batch = pa.record_batch(
        [pa.array([1.0, None], pa.float32()), pa.array([1, None], pa.int64())], names=["f", "i"]
    )
    (shard,) = shard_format.write_shards([batch], batch.schema, str(tmp_path), 1)
    monkeypatch.setenv(DATA_FILE_ENV, shard.path)
    monkeypatch.setenv(EPOCH_ROWS_ENV, "2")
    (got,) = list(data.partition_loader(2, columns=["f"]))
    assert got["f"][0] == 1.0 and torch.isnan(got["f"][1])
    with pytest.raises(DataError, match="'i' has 1 null"):
        list(data.partition_loader(2))


def test_an_empty_shard_in_a_nonempty_run_is_an_error(tmp_path: Path, monkeypatch: Any) -> None:
    written = shard_format.write_shards(make_batches((1,)), SCHEMA, str(tmp_path), 2)
    monkeypatch.setenv(DATA_FILE_ENV, written[1].path)
    monkeypatch.setenv(EPOCH_ROWS_ENV, "1")
    with pytest.raises(DataError, match="fewer rows than ranks"):
        data.partition_loader(4)
    monkeypatch.setenv(EPOCH_ROWS_ENV, "0")
    assert len(data.partition_loader(4)) == 0 and list(data.partition_loader(4)) == []


def test_a_file_that_is_not_an_arrow_stream_is_an_error(tmp_path: Path, monkeypatch: Any) -> None:
    bad = tmp_path / "bad.arrow"
    bad.write_bytes(b"this is not arrow at all")
    monkeypatch.setenv(DATA_FILE_ENV, str(bad))
    with pytest.raises(DataError, match="not an Arrow IPC stream"):
        data.partition_loader(4)


def test_without_epoch_rows_a_rank_yields_its_own_shard(as_rank: Any) -> None:
    path = as_rank(1)
    del os.environ[EPOCH_ROWS_ENV]
    assert ids_of(data.partition_loader(64)) == read_ids(path)


# -- pyspark's loader, rebuilt --------------------------------------------------------------------
def test_pyspark_style_loader_yields_lists_of_column_tensors(as_rank: Any) -> None:
    path = as_rank(0)
    shard = read_ids(path)
    loader = data.get_spark_partition_data_loader(10, 4, num_workers=0)
    batches = list(loader)
    assert [len(b[0]) for b in batches] == [4, 4, 2]
    first = batches[0]
    assert isinstance(first, list) and len(first) == len(SCHEMA)
    # pyspark collates Python scalars: int64, float64 and bool; arrays keep their dtype.
    assert [t.dtype for t in first] == [
        torch.int64,
        torch.float64,
        torch.int64,
        torch.bool,
        torch.float32,
        torch.float64,
        torch.float64,
    ]
    assert [int(i) for b in batches for i in b[0]] == shard[:10]  # the first num_samples rows
    wrapped = data.get_spark_partition_data_loader(len(shard) + 5, 100, num_workers=0)
    assert [int(i) for b in wrapped for i in b[0]] == shard + shard[:5]


def test_reading_a_shard_does_not_import_pandas(shards: list[ShardFile]) -> None:
    # pyarrow's to_numpy() would import pandas: ~40 MB more per rank, for nothing.
    code = (
        "import sys\n"
        "from sparktorch_ops import data\n"
        "for batch in data.partition_loader(64, shuffle=True): pass\n"
        "for batch in data.get_spark_partition_data_loader(600, 64, num_workers=0): pass\n"
        "print(sorted(m for m in ('pandas', 'pyspark') if m in sys.modules))\n"
    )
    env = dict(os.environ, **rank_env(shards[0].path, "", 501))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


# -- memory ---------------------------------------------------------------------------------------
MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np, pyarrow as pa, psutil
    from sparktorch_ops import data
    from sparktorch_ops.data import shards as shard_format
    from tests.support.shards import rank_env

    rows, width, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    schema = pa.schema([(f"f{i}", pa.float32()) for i in range(width)])

    def batches():
        rng = np.random.default_rng(0)
        for start in range(0, rows, 50_000):
            block = rng.random((min(50_000, rows - start), width), dtype=np.float32)
            yield pa.record_batch([pa.array(block[:, i]) for i in range(width)], schema=schema)

    (shard,) = shard_format.write_shards(batches(), schema, directory, 1)
    os.environ.update(rank_env(shard.path, "", shard.rows))
    process = psutil.Process()
    out = {"file_bytes": os.path.getsize(shard.path)}
    for shuffle in (False, True):
        loader = data.partition_loader(1024, shuffle=shuffle, seed=1)
        iterator = iter(loader)
        next(iterator)
        base = peak = process.memory_info().rss
        seen = 1024
        for batch in iterator:
            seen += len(batch["f0"])
            peak = max(peak, process.memory_info().rss)
        out["shuffle" if shuffle else "plain"] = {"rows": seen, "growth": peak - base}
    print(json.dumps(out))
    """
)


def test_memory_stays_bounded_by_a_few_record_batches(tmp_path: Path) -> None:
    rows = 2_000_000
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(rows), "32", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["file_bytes"] > 250_000_000  # ~256 MB of float32 on disk
    for mode in ("plain", "shuffle"):
        assert result[mode]["rows"] == rows
        assert result[mode]["growth"] < 150 * 2**20, result
