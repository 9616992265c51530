"""The shard format of DataFrame input: what the driver or a barrier task writes for the ranks
(one Arrow IPC stream file per rank, balanced to within one row, beside the Spark schema as
JSON), and the checks that a column can become a tensor.

pyarrow is imported by the functions that need it; nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any, NamedTuple

from sparktorch_ops.checkpoint.storage import replace_file
from sparktorch_ops.errors import ConfigError, SparkTorchError
from sparktorch_ops.wire.env import (
    DATA_DIR_ENV,
    DATA_FILE_ENV,
    EPOCH_ROWS_ENV,
    EPOCH_ROWS_FILE_ENV,
)

if TYPE_CHECKING:
    import pyarrow as pa

SCHEMA_FILE_NAME = "schema.json"
EPOCH_ROWS_FILE_NAME = "epoch-rows"
# What a Spark ML vector (pyspark.ml.linalg.VectorUDT.sqlType()) is in Arrow.
_VECTOR_FIELDS = ("type", "size", "indices", "values")


class DataError(SparkTorchError, RuntimeError):
    """The rank's data cannot be read as tensors: no shard, a bad file, ragged arrays, nulls."""


class ShardFile(NamedTuple):
    """One rank's shard as written by :func:`write_shards`."""

    path: str
    rows: int


# -- the writer side (barrier task on an executor, or the driver in local mode) ----------------
def shard_name(rank: int) -> str:
    """The file name of ``rank``'s shard inside the shard directory (``rank-{rank}.arrow``)."""
    return f"rank-{rank}.arrow"


def write_shards(
    batches: Iterable[pa.RecordBatch], schema: pa.Schema, directory: str, count: int
) -> list[ShardFile]:
    """Split a stream of record batches into ``count`` per-rank Arrow IPC stream files.

    Row ``i`` of the stream (counted across batches) goes to shard ``i % count``, so the shards
    differ by at most one row whatever the batch sizes. Rows move with ``RecordBatch.take``, one
    input batch at a time: memory stays bounded by a batch. Files are uncompressed Arrow IPC
    *stream* files (what pyspark's ``ArrowStreamSerializer`` reads) named by :func:`shard_name`;
    a shard that gets no rows still holds the schema.

    Args:
        batches: the input's record batches, in order.
        schema: their schema (batches that differ only in metadata or nullability are rebuilt
            with it).
        directory: where to write (created if missing).
        count: how many shards (ranks).

    Returns:
        One :class:`ShardFile` (path, rows) per rank, in rank order.

    Raises:
        ConfigError: ``count`` is not a positive integer.
        DataError: a batch whose columns do not match ``schema``.
    """
    import numpy as np
    import pyarrow as pa

    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError("count", f"must be a positive integer, got {count!r}")
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, shard_name(rank)) for rank in range(count)]
    rows = [0] * count
    sinks: list[Any] = []
    writers: list[Any] = []
    try:
        for path in paths:
            sinks.append(pa.OSFile(path, "wb"))
            writers.append(pa.ipc.new_stream(sinks[-1], schema))
        seen = 0
        for batch in batches:
            size = batch.num_rows
            if size == 0:
                continue
            if not batch.schema.equals(schema):
                batch = _conform(batch, schema)
            for rank in range(count):
                first = (rank - seen) % count
                if first >= size:
                    continue
                part = (
                    batch
                    if count == 1
                    else batch.take(pa.array(np.arange(first, size, count, dtype=np.int64)))
                )
                writers[rank].write_batch(part)
                rows[rank] += part.num_rows
            seen += size
    finally:
        for writer in writers:
            writer.close()
        for sink in sinks:
            sink.close()
    return [ShardFile(path, n) for path, n in zip(paths, rows, strict=True)]


def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    import pyarrow as pa

    if batch.schema.names != schema.names:
        raise DataError(
            f"a record batch has columns {batch.schema.names}, the input's schema has "
            f"{schema.names}"
        )
    for field, column in zip(schema, batch.columns, strict=True):
        if not column.type.equals(field.type):
            raise DataError(
                f"column {field.name!r} of a record batch is {column.type}, the input's schema "
                f"says {field.type}"
            )
    return pa.RecordBatch.from_arrays(batch.columns, schema=schema)


def write_schema_file(spark_schema_json: str, directory: str) -> str:
    """Write the Spark schema (``json.dumps(StructType.jsonValue())``) for the ranks.

    Returns:
        The path of the file (``<directory>/schema.json``), for :data:`SCHEMA_FILE_ENV`.

    Raises:
        ConfigError: ``spark_schema_json`` is not a JSON object.
    """
    try:
        parsed = json.loads(spark_schema_json)
    except (TypeError, ValueError) as exc:
        raise ConfigError("spark_schema_json", f"is not JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise ConfigError("spark_schema_json", "must be a JSON object (StructType.jsonValue())")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, SCHEMA_FILE_NAME)
    with open(path, "w", encoding="utf-8") as fp:
        fp.write(spark_schema_json)
    return path


def epoch_rows(shard_sizes: Iterable[int]) -> int:
    """The rows every rank yields per epoch: the largest shard (0 for no shards)."""
    return max(shard_sizes, default=0)


def epoch_rows_path(directory: str) -> str:
    """Where :func:`write_epoch_rows` puts the rows per epoch in a shard directory."""
    return os.path.join(directory, EPOCH_ROWS_FILE_NAME)


def write_epoch_rows(directory: str, rows: int) -> str:
    """Hand the ranks of a node the rows per epoch, once every task wrote its shards: the
    file appears whole so a rank never reads half of it."""
    path = epoch_rows_path(directory)
    replace_file(path, str(int(rows)).encode())
    return path


def wait_for_epoch_rows(environ: MutableMapping[str, str], poll_s: float = 0.005) -> None:
    """In a rank, before it connects: when the shards are still being written
    (:data:`EPOCH_ROWS_FILE_ENV`), wait for the rows per epoch and set :data:`EPOCH_ROWS_ENV`.

    There is no limit here: the task that writes the shards stops the agent (and so this
    process) when the data cannot be laid out, and the driver's ``start_timeout`` holds.
    """
    path = environ.pop(EPOCH_ROWS_FILE_ENV, None)
    if path is None:
        return
    while not os.path.exists(path):
        time.sleep(poll_s)
    with open(path, encoding="utf-8") as fp:
        environ[EPOCH_ROWS_ENV] = str(int(fp.read().strip()))


def select_rank_shard(environ: MutableMapping[str, str]) -> None:
    """In a rank before user code: point :data:`DATA_FILE_ENV` at this rank's shard."""
    directory = environ.pop(DATA_DIR_ENV, None)
    if directory is not None:
        environ[DATA_FILE_ENV] = os.path.join(directory, shard_name(int(environ["LOCAL_RANK"])))


# -- column checks (pure, on an Arrow schema; the driver calls these before anything starts) ---
def is_vector_type(arrow_type: pa.DataType) -> bool:
    """Whether ``arrow_type`` is a Spark ML vector (``VectorUDT``) as Arrow carries it.

    pyspark turns a UDT into its ``sqlType()``; for ``VectorUDT`` that is a struct of
    ``type: int8`` (0 sparse, 1 dense), ``size: int32``, ``indices: list<int32>`` and
    ``values: list<double>`` (lists may be large lists).
    """
    import pyarrow as pa

    if not pa.types.is_struct(arrow_type) or arrow_type.num_fields != len(_VECTOR_FIELDS):
        return False
    fields = [arrow_type.field(i) for i in range(arrow_type.num_fields)]
    if tuple(f.name for f in fields) != _VECTOR_FIELDS:
        return False
    kind, size, indices, values = (f.type for f in fields)
    return (
        pa.types.is_int8(kind)
        and pa.types.is_int32(size)
        and _is_list(indices)
        and pa.types.is_int32(indices.value_type)
        and _is_list(values)
        and pa.types.is_float64(values.value_type)
    )


def _is_list(arrow_type: pa.DataType) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type))


def _number_problem(arrow_type: pa.DataType) -> str | None:
    """Why a scalar type is not a tensor element, or None when it is one."""
    import pyarrow as pa

    types = pa.types
    if types.is_boolean(arrow_type) or types.is_floating(arrow_type):
        return None
    if types.is_signed_integer(arrow_type) or types.is_uint8(arrow_type):
        return None
    strings = "strings; encode them as numbers first (e.g. with StringIndexer)"
    is_string_view = getattr(types, "is_string_view", lambda _: False)
    problems: tuple[tuple[Callable[[Any], bool], str], ...] = (
        (types.is_unsigned_integer, "{} has no general torch dtype; cast it to a signed integer"),
        (types.is_decimal, "{} is a decimal; cast it to double"),
        (types.is_string, strings),
        (types.is_large_string, strings),
        (is_string_view, strings),
        (types.is_binary, "binary values"),
        (types.is_large_binary, "binary values"),
        (types.is_fixed_size_binary, "binary values"),
        (types.is_temporal, "{} is a date or time; cast it to a number (e.g. unix seconds)"),
        (types.is_null, "every value is null (no type)"),
        (types.is_dictionary, "dictionary-encoded values"),
    )
    why = next((why for check, why in problems if check(arrow_type)), "{} is not a number")
    return why.format(arrow_type)  # "{}": the type


def _type_problem(arrow_type: pa.DataType) -> str | None:
    import pyarrow as pa

    types = pa.types
    if types.is_struct(arrow_type):
        if is_vector_type(arrow_type):
            return None
        return "a struct (only Spark ML vectors become tensors); select its fields instead"
    if types.is_map(arrow_type):
        return "a map"
    if types.is_fixed_size_list(arrow_type) or _is_list(arrow_type):
        element = arrow_type.value_type
        if types.is_fixed_size_list(element) or _is_list(element):
            return "nested arrays (arrays of arrays)"
        if types.is_struct(element) or types.is_map(element):
            return f"arrays of {element}"
        why = _number_problem(element)
        return None if why is None else f"arrays of {element}: {why}"
    return _number_problem(arrow_type)


def tensor_problems(schema: pa.Schema) -> dict[str, str]:
    """The columns of ``schema`` that cannot become tensors, each with the reason.

    Tensors come from booleans, integers (signed, or uint8) and floats; fixed-size or variable
    arrays of those (variable ones must hold one length per column: checked on the data, by
    the driver's input check and the rank's loader); and Spark ML vectors
    (:func:`is_vector_type`). Refused: strings, binary, decimals, dates and times, maps, other
    structs, nested arrays, null-typed columns.

    Returns:
        ``{column: why}`` in schema order; empty when every column can become a tensor.
    """
    problems: dict[str, str] = {}
    for field in schema:
        why = _type_problem(field.type)
        if why is not None:
            problems[field.name] = why
    return problems


def batches_per_epoch(rows: int, batch_size: int, drop_last: bool) -> int:
    """How many batches ``rows`` rows make (the last one partial unless ``drop_last``)."""
    return rows // batch_size if drop_last else math.ceil(rows / batch_size)
