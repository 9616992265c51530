"""DataFrame input on the ranks: one Arrow shard per rank, read as batches of tensors.

The library lays a DataFrame out before the ranks start (:mod:`sparktorch_ops.spark.dataframe`):
the record batches of the input go round robin, row by row, into one Arrow IPC **stream** file
per rank, balanced to within one row, next to a JSON file holding the Spark schema (the format:
:mod:`sparktorch_ops.data.shards`). Every rank then sees three variables:

``SPARK_PARTITION_ARROW_DATA_FILE`` (:data:`DATA_FILE_ENV`)
    its own shard (pyspark's name and format, so pyspark's own
    ``pyspark.ml.torch.distributor._get_spark_partition_data_loader`` also works on our ranks);
``SPARK_DATAFRAME_SCHEMA_FILE`` (:data:`SCHEMA_FILE_ENV`)
    the Spark schema, ``StructType.jsonValue()`` as JSON (what pyspark writes and reads);
``SPARKTORCH_OPS_DATA_EPOCH_ROWS`` (:data:`EPOCH_ROWS_ENV`)
    the rows every rank yields per epoch: the largest shard, the same number on every rank.

Inside the train function, a rank reads its shard with either

* :func:`get_spark_partition_data_loader`: pyspark's loader, same arguments and batches (a list
  of column tensors, ``num_samples`` wrapping around the shard), converted straight from Arrow
  instead of row by row through pandas; or
* :func:`partition_loader`: batches as ``dict[str, torch.Tensor]``, the same number of batches on
  every rank (a smaller shard wraps around to fill the epoch), optional per-epoch shuffling that a
  restart reproduces, and memory bounded by a few record batches (see :func:`partition_loader`).

Only the standard library is imported here at import time: pyarrow and numpy are imported by the
functions that need them, torch only by the loaders (:mod:`sparktorch_ops.data.loader`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from sparktorch_ops.data.shards import DataError
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.wire.env import DATA_FILE_ENV, EPOCH_ROWS_ENV, SCHEMA_FILE_ENV

if TYPE_CHECKING:
    from sparktorch_ops.data.loader import PartitionLoader

__all__ = [
    "DATA_FILE_ENV",
    "EPOCH_ROWS_ENV",
    "SCHEMA_FILE_ENV",
    "DataError",
    "PartitionDataset",
    "PartitionLoader",
    "get_spark_partition_data_loader",
    "partition_loader",
]


# -- the rank side ------------------------------------------------------------------------------
def _shard_path(environ: Mapping[str, str]) -> str:
    path = environ.get(DATA_FILE_ENV)
    if not path:
        raise DataError(
            f"no DataFrame shard for this process: {DATA_FILE_ENV} is not set. The data loaders "
            "work inside a train function started with "
            "TorchDistributor.train_on_dataframe(train_function, dataframe, ...)"
        )
    if not os.path.isfile(path):
        raise DataError(f"{DATA_FILE_ENV} names {path!r}, which is not a file")
    return path


def _check_int(name: str, value: object, minimum: int | None) -> None:
    """Refuse what is not an int of at least ``minimum`` (None: any int)."""
    wanted = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}[minimum]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be {wanted}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(name, f"must be {wanted}, got {value!r}")


def partition_loader(
    batch_size: int,
    *,
    columns: Iterable[str] | None = None,
    shuffle: bool = False,
    seed: int = 0,
    drop_last: bool = False,
    num_workers: int = 0,
    shuffle_window: int = 8,
) -> PartitionLoader:
    """This rank's shard as batches of tensors, the same number of batches on every rank.

    Each batch is a ``dict[str, torch.Tensor]`` keyed by column (in ``columns`` order, else the
    schema's): number columns become 1-D tensors of their own dtype (float32 stays float32,
    int32 stays int32, booleans are ``torch.bool``), fixed-length numeric arrays and Spark ML
    vectors (float64, sparse ones made dense) become 2-D tensors.

    An epoch is :data:`EPOCH_ROWS_ENV` rows on every rank: a shard smaller than that wraps
    around to its own first rows to fill it, so every rank yields ``ceil(epoch rows / batch_size)``
    batches (``floor`` with ``drop_last=True``, which drops the final partial batch) and no
    collective waits on a rank that ran out. Every row of the shard comes at least once per epoch.

    Memory stays bounded by a few record batches whatever the shard's size: the file is
    memory-mapped, record batches are read from it without copying, converted to column arrays
    straight from Arrow (no pandas, no per-row Python) and copied once into each batch's tensors;
    pages already consumed are handed back to the OS (``madvise(MADV_DONTNEED)``; they are
    clean file pages, read again from the file if needed).

    With ``shuffle=True`` the order is a two-level shuffle that never holds the shard: the order
    of the record batches is permuted, then rows are permuted within windows of
    ``shuffle_window`` consecutive (permuted) record batches. The order depends only on
    ``(seed, epoch, RANK)`` and the shard, so a restart replays it.

    The result is a ``torch.utils.data.DataLoader`` over an ``IterableDataset`` that yields whole
    batches (``batch_size=None``), so Lightning uses it as is (it never replaces the sampler of
    an iterable dataset) and calls ``set_epoch`` on it each epoch. ``len(loader)`` is the
    batches per epoch. Without an explicit :meth:`~PartitionLoader.set_epoch`, each new
    iteration starts the next epoch (0, 1, 2, ...); call ``set_epoch(epoch)`` in a plain loop to
    make a restarted run resume the same order.

    Args:
        batch_size: rows per batch.
        columns: the columns to load, in this order (default: all).
        shuffle: shuffle rows per epoch (two-level, see above).
        seed: the shuffle's seed.
        drop_last: drop the last, partial batch of each epoch.
        num_workers: DataLoader worker processes; each converts every ``num_workers``-th batch
            and the batches arrive in the same order as without workers.
        shuffle_window: record batches whose rows are shuffled together.

    Raises:
        DataError: not inside a DataFrame run (no :data:`DATA_FILE_ENV`), an unreadable shard,
            or a selected column that cannot become a tensor.
        ConfigError: a bad argument, e.g. a column the shard does not have.
    """
    _check_int("batch_size", batch_size, 1)
    _check_int("shuffle_window", shuffle_window, 1)
    _check_int("num_workers", num_workers, 0)
    _check_int("seed", seed, None)
    environ = os.environ
    path = _shard_path(environ)
    from sparktorch_ops.data import loader as _loader

    dataset = _loader.PartitionDataset(
        path,
        batch_size=batch_size,
        columns=None if columns is None else list(columns),
        shuffle=bool(shuffle),
        seed=seed,
        drop_last=bool(drop_last),
        epoch_rows=_epoch_rows_from(environ),
        rank=_int_env(environ, "RANK", 0),
        shuffle_window=shuffle_window,
        style="dict",
    )
    return _loader.PartitionLoader(dataset, num_workers=num_workers)


def _int_env(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "")
    try:
        return int(raw) if raw.strip() else default
    except ValueError as exc:
        raise DataError(f"{name}={raw!r} is not an integer") from exc


def _epoch_rows_from(environ: Mapping[str, str]) -> int | None:
    """:data:`EPOCH_ROWS_ENV`, or None (the shard's own rows: not a sparktorch_ops run)."""
    raw = environ.get(EPOCH_ROWS_ENV, "")
    if not raw.strip():
        return None
    value = _int_env(environ, EPOCH_ROWS_ENV, 0)
    if value < 0:
        raise DataError(f"{EPOCH_ROWS_ENV}={raw!r} is negative")
    return value


def get_spark_partition_data_loader(
    num_samples: int, batch_size: int, num_workers: int = 1, prefetch_factor: int = 2
) -> PartitionLoader:
    """pyspark's ``_get_spark_partition_data_loader``, read straight from Arrow.

    Same arguments and batches as pyspark's: each batch is a list of tensors, one per column in
    schema order, collated the way pyspark's rows collate (number columns as int64, float64 or
    bool tensors; arrays keep their element dtype; ML vectors as float64, sparse ones dense).
    An epoch yields ``num_samples`` rows: the first ``num_samples`` rows of the shard, or the
    whole shard wrapping around to its start until ``num_samples`` rows came out; the last batch
    may be smaller. Unlike pyspark's, it needs no pandas, converts whole record batches at once,
    and splits the work when ``num_workers > 1`` (batches still arrive in order).

    Args:
        num_samples: rows per epoch.
        batch_size: rows per batch.
        num_workers: DataLoader worker processes (0: load in this process).
        prefetch_factor: batches loaded in advance by each worker.

    Raises:
        DataError: not inside a DataFrame run, an unreadable shard, or a column that cannot
            become a tensor.
    """
    _check_int("num_samples", num_samples, 0)
    _check_int("batch_size", batch_size, 1)
    _check_int("num_workers", num_workers, 0)
    path = _shard_path(os.environ)
    from sparktorch_ops.data import loader as _loader

    dataset = _loader.PartitionDataset(
        path,
        batch_size=batch_size,
        columns=None,
        shuffle=False,
        seed=0,
        drop_last=False,
        epoch_rows=num_samples,
        rank=0,
        shuffle_window=1,
        style="pyspark",
    )
    return _loader.PartitionLoader(
        dataset,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )


def __getattr__(name: str) -> Any:
    # The loader classes need torch: import them only when asked for.
    if name in ("PartitionLoader", "PartitionDataset"):
        from sparktorch_ops.data import loader as _loader

        return getattr(_loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
