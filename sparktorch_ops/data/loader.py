"""The torch side of :mod:`sparktorch_ops.data`: a memory-mapped shard read as batches of tensors.

Private: use :func:`sparktorch_ops.data.partition_loader` and
:func:`sparktorch_ops.data.get_spark_partition_data_loader`. This module imports torch, numpy and
pyarrow at import time; :mod:`sparktorch_ops.data` imports it only when a loader is made.

How a shard is read (one process, one epoch):

1. :class:`_Shard` memory-maps the Arrow IPC stream file and indexes it once: the byte range and
   row count of every record batch (a few numbers per batch; the batches themselves are not
   kept).
2. The epoch is a list of *sources*: one per record batch, or with ``shuffle`` one per window of
   ``shuffle_window`` record batches taken in a permuted order, rows permuted inside the window.
   The list is walked again from its start until the epoch's rows are out (the wrap-around).
3. Row ranges of the sources are cut into batches of ``batch_size`` rows. A source is converted
   (Arrow -> numpy, zero-copy for plain numbers) only when a batch this process yields needs it,
   and dropped, its pages handed back to the OS, as soon as the walk is past it. Each batch's
   columns are copied once into new arrays that become the tensors.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, get_worker_info
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from sparktorch_ops.data.shards import (
    DataError,
    _is_list,
    batches_per_epoch,
    is_vector_type,
    tensor_problems,
)
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.wire.env import DATA_FILE_ENV, EPOCH_ROWS_ENV

Style = Literal["dict", "pyspark"]
Arrays = dict[str, np.ndarray]
_PAGE = mmap.PAGESIZE
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


class _Shard:
    """A shard file, memory-mapped: its schema and the byte range and rows of each record batch.

    Batches are read on demand, without copying, from the map; :meth:`release` hands the pages
    of a range back to the OS. The map is read-only and shared, so a released page is simply
    read again from the file if anything still looks at it.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size == 0:
                    raise DataError(f"the shard {path!r} is empty, not an Arrow IPC stream")
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise DataError(f"cannot open the shard {path!r}: {exc}") from exc
        self._buffer = pa.py_buffer(self._map)
        self._size = size
        schema: pa.Schema | None = None
        starts: list[int] = []
        ends: list[int] = []
        rows: list[int] = []
        source = pa.BufferReader(self._buffer)
        try:
            messages = pa.ipc.MessageReader.open_stream(source)
            position = source.tell()
            while True:
                try:
                    message = messages.read_next_message()
                except StopIteration:
                    break
                end = source.tell()
                if message.type == "schema" and schema is None:
                    schema = pa.ipc.read_schema(message)
                elif message.type == "record batch" and schema is not None:
                    count = pa.ipc.read_record_batch(message, schema).num_rows
                    if count:
                        starts.append(position)
                        ends.append(end)
                        rows.append(count)
                else:
                    raise DataError(
                        f"the shard {path!r} holds an unexpected {message.type!r} message "
                        "(dictionary-encoded columns are not supported)"
                    )
                position = end
        except pa.ArrowException as exc:
            raise DataError(f"the shard {path!r} is not an Arrow IPC stream file: {exc}") from exc
        if schema is None:
            raise DataError(f"the shard {path!r} has no schema: not an Arrow IPC stream file")
        self.schema = schema
        self.starts = np.asarray(starts, dtype=np.int64)
        self.ends = np.asarray(ends, dtype=np.int64)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.total_rows = int(self.rows.sum())
        self.release(0, size)  # the index touched a page or two of every batch

    def batch(self, index: int) -> pa.RecordBatch:
        """Record batch ``index`` (zero-copy: its buffers point into the map)."""
        start, end = int(self.starts[index]), int(self.ends[index])
        message = pa.ipc.read_message(self._buffer.slice(start, end - start))
        return pa.ipc.read_record_batch(message, self.schema)

    def release_batch(self, index: int) -> None:
        """Hand the pages of record batch ``index`` back to the OS."""
        self.release(int(self.starts[index]), int(self.ends[index]))

    def release(self, start: int, end: int) -> None:
        """Hand the pages of bytes ``[start, end)`` back (a no-op where madvise is missing)."""
        if _DONTNEED is None or not hasattr(self._map, "madvise"):
            return
        first = start - start % _PAGE
        last = min(self._size, end)
        if last > first:
            try:
                self._map.madvise(_DONTNEED, first, last - first)
            except (OSError, ValueError):  # pragma: no cover - a hint only
                pass


@dataclass(frozen=True)
class _Column:
    """How one column becomes arrays: ``kind`` and the dtype of the batch (None: its own)."""

    name: str
    index: int
    kind: Literal["number", "fixed", "list", "vector"]
    floating: bool
    cast: Any = None


def _columns(schema: pa.Schema, names: list[str] | None, style: Style) -> list[_Column]:
    if names is None:
        names = list(schema.names)
    elif not names:
        raise ConfigError("columns", "is empty: name at least one column, or pass None for all")
    else:
        missing = [name for name in names if schema.get_field_index(name) < 0]
        if missing:
            raise ConfigError(
                "columns",
                f"the shard has no column {', '.join(repr(m) for m in missing)} "
                f"(it has {', '.join(repr(n) for n in schema.names)})",
            )
        if len(set(names)) != len(names):
            raise ConfigError("columns", f"names a column twice: {names}")
    problems = tensor_problems(pa.schema([schema.field(name) for name in names]))
    if problems:
        detail = "; ".join(f"column {name!r}: {why}" for name, why in problems.items())
        raise DataError(
            f"{detail}. Select the columns that can become tensors"
            + (" with partition_loader(columns=[...])" if style == "dict" else "")
        )
    columns = []
    for name in names:
        index = schema.get_field_index(name)
        arrow_type = schema.field(index).type
        cast: Any = None
        if is_vector_type(arrow_type):
            kind: Any = "vector"
            floating = True
        elif pa.types.is_fixed_size_list(arrow_type) or _is_list(arrow_type):
            kind = "fixed" if pa.types.is_fixed_size_list(arrow_type) else "list"
            floating = pa.types.is_floating(arrow_type.value_type)
        else:
            kind = "number"
            floating = pa.types.is_floating(arrow_type)
            if style == "pyspark":  # pyspark collates Python scalars: int64, float64 or bool
                cast = (
                    np.float64
                    if floating
                    else np.bool_
                    if pa.types.is_boolean(arrow_type)
                    else np.int64
                )
        columns.append(_Column(name, index, kind, floating, cast))
    return columns


def _values(array: pa.Array) -> np.ndarray:
    """A primitive array's values as numpy: a read-only view over DLPack (booleans: a copy).

    Null slots hold whatever the buffer holds there. Not ``to_numpy()``: it imports pandas
    (~40 MB and ~1 s per rank and loader worker), as does any Python value handed to pyarrow
    (a fill scalar, ``to_pandas_dtype``); DLPack, ``is_valid`` and ``cast`` do not.
    """
    if pa.types.is_boolean(array.type):  # bit-packed, which DLPack cannot carry
        return _values(array.cast(pa.uint8())).view(np.bool_)
    if array.null_count:  # DLPack refuses a validity bitmap: the same values without it
        array = pa.Array.from_buffers(
            array.type, len(array), [None, array.buffers()[1]], offset=array.offset
        )
    return np.from_dlpack(array)


def _numbers(array: pa.Array, name: str, floating: bool) -> np.ndarray:
    """A numeric or boolean Arrow array as numpy (a read-only view when there is nothing to do)."""
    values = _values(array)
    if array.null_count:
        if not floating:
            raise DataError(
                f"column {name!r} has {array.null_count} null values in this shard: a tensor "
                "needs a number in every row; fill or filter them"
            )
        values = values.copy()  # nulls become NaN, as with pandas
        values[~_values(array.is_valid())] = np.nan
    return values


class _Converter:
    """Record batch -> ``{column: numpy array}``, checking one array length per column."""

    def __init__(self, columns: list[_Column]) -> None:
        self.columns = columns
        self.widths: dict[str, int] = {}

    def __call__(self, batch: pa.RecordBatch) -> Arrays:
        out: Arrays = {}
        for column in self.columns:
            array = batch.column(column.index)
            if column.kind == "number":
                out[column.name] = _numbers(array, column.name, column.floating)
                continue
            if array.null_count:
                raise DataError(
                    f"column {column.name!r} has {array.null_count} null arrays in this shard: "
                    "a tensor needs a value in every row; fill or filter them"
                )
            if column.kind == "fixed":
                width = array.type.list_size
                flat = _numbers(array.flatten(), column.name, column.floating)
            elif column.kind == "list":
                lengths = np.diff(_values(array.offsets))
                width = self._uniform(column.name, lengths)
                flat = _numbers(array.flatten(), column.name, column.floating)
            else:
                out[column.name] = self._vectors(column.name, array)
                continue
            self._check(column.name, width)
            out[column.name] = flat.reshape(len(array), width)
        return out

    def _uniform(self, name: str, lengths: np.ndarray) -> int:
        shortest, longest = int(lengths.min()), int(lengths.max())
        if shortest != longest:
            raise DataError(
                f"column {name!r} holds arrays of different lengths ({shortest} to {longest}): "
                "a batch needs one length per column; pad or filter them"
            )
        return shortest

    def _check(self, name: str, width: int) -> None:
        known = self.widths.setdefault(name, width)
        if known != width:
            raise DataError(
                f"column {name!r} holds arrays of length {known} and {width} in this shard: a "
                "batch needs one length per column; pad or filter them"
            )

    def _vectors(self, name: str, array: pa.StructArray) -> np.ndarray:
        """Spark ML vectors as a float64 matrix (sparse ones made dense)."""
        kind = _values(array.field("type"))
        values = array.field("values")
        value_offsets = _values(values.offsets)
        value_counts = np.diff(value_offsets)
        dense = kind == 1
        if dense.all():
            width = self._uniform(name, value_counts)
            self._check(name, width)
            flat = _values(values.flatten())
            return flat.reshape(len(array), width)
        sizes = _values(array.field("size"))  # null (garbage) for dense rows: unused
        width = self._uniform(name, np.where(dense, value_counts, sizes))
        self._check(name, width)
        out = np.zeros((len(array), width), dtype=np.float64)
        all_values = _values(values.values)
        rows = np.flatnonzero(dense)
        if rows.size:
            out[rows] = all_values[value_offsets[rows][:, None] + np.arange(width)]
        rows = np.flatnonzero(~dense)
        indices = array.field("indices")
        index_offsets = _values(indices.offsets)
        counts = np.diff(index_offsets)[rows]
        if not np.array_equal(counts, value_counts[rows]):
            raise DataError(f"column {name!r} holds sparse vectors with unequal indices/values")
        total = int(counts.sum())
        if total:
            skip = np.repeat(np.cumsum(counts) - counts, counts)
            within = np.arange(total) - skip
            positions = np.repeat(index_offsets[rows], counts) + within
            where = _values(indices.values)[positions]
            if where.min() < 0 or where.max() >= width:
                raise DataError(f"column {name!r} holds a sparse vector index out of its size")
            out[np.repeat(rows, counts), where] = all_values[
                np.repeat(value_offsets[rows], counts) + within
            ]
        return out


class _Source:
    """Rows of the epoch in one piece: a record batch, or a shuffled window of them."""

    def __init__(
        self,
        shard: _Shard,
        convert: _Converter,
        members: list[int],
        permutation_seed: np.random.SeedSequence | None = None,
    ) -> None:
        self.shard = shard
        self.convert = convert
        self.members = members
        self.seed = permutation_seed
        self.rows = int(shard.rows[members].sum())
        self._arrays: Arrays | None = None

    def arrays(self) -> Arrays:
        if self._arrays is None:
            if self.seed is None:
                (index,) = self.members
                self._arrays = self.convert(self.shard.batch(index))
            else:
                self._arrays = self._shuffled()
        return self._arrays

    def _shuffled(self) -> Arrays:
        """The window's rows in a permuted order: each record batch is scattered straight to
        its rows' new places (one window in memory, not two) and its pages released."""
        order = np.random.default_rng(self.seed).permutation(self.rows)
        place = np.empty_like(order)
        place[order] = np.arange(self.rows)  # row i of the window goes to place[i]
        out: Arrays = {}
        offset = 0
        for index in self.members:
            part = self.convert(self.shard.batch(index))
            count = int(self.shard.rows[index])
            where = place[offset : offset + count]
            for name, array in part.items():
                if name not in out:
                    out[name] = np.empty((self.rows, *array.shape[1:]), dtype=array.dtype)
                out[name][where] = array
            del part
            self.shard.release_batch(index)
            offset += count
        return out

    def release(self) -> None:
        self._arrays = None
        for index in self.members:
            self.shard.release_batch(index)


class PartitionDataset(IterableDataset):
    """A rank's shard as an ``IterableDataset`` of whole batches (see ``partition_loader``).

    Iterate it through :class:`PartitionLoader`, which yields its items as they are
    (``batch_size=None``) and moves its epoch.
    """

    def __init__(
        self,
        path: str,
        *,
        batch_size: int,
        columns: list[str] | None,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        epoch_rows: int | None,
        rank: int,
        shuffle_window: int,
        style: Style,
    ) -> None:
        self.path = path
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.shuffle_window = shuffle_window
        self.style = style
        self.epoch = 0
        self._shard: _Shard | None = _Shard(path)
        self.columns = _columns(self._shard.schema, columns, style)
        self.shard_rows = self._shard.total_rows
        # Outside a sparktorch_ops run (e.g. under pyspark's own distributor) there is no common
        # epoch length: each rank then yields its own shard once per epoch.
        self.epoch_rows = self.shard_rows if epoch_rows is None else epoch_rows
        if self.epoch_rows > 0 and self.shard_rows == 0:
            raise DataError(
                f"this rank's shard ({DATA_FILE_ENV}={path}) has no rows while an epoch has "
                f"{self.epoch_rows} ({EPOCH_ROWS_ENV}): the input has fewer rows than ranks; "
                "train with fewer processes or on more data"
            )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_shard"] = None  # a worker started by spawn maps the file itself
        return state

    def __len__(self) -> int:
        """Batches per epoch."""
        return batches_per_epoch(self.epoch_rows, self.batch_size, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next iteration (it picks the shuffle order)."""
        self.epoch = _epoch(epoch)

    def _sources(self, shard: _Shard, convert: _Converter) -> list[_Source]:
        count = len(shard.rows)
        if not self.shuffle:
            return [_Source(shard, convert, [index]) for index in range(count)]
        entropy = [self.seed % 2**64, self.epoch, self.rank]
        order = np.random.default_rng(np.random.SeedSequence(entropy)).permutation(count)
        window = self.shuffle_window
        return [
            _Source(
                shard,
                convert,
                [int(i) for i in order[start : start + window]],
                np.random.SeedSequence(entropy, spawn_key=(start // window,)),
            )
            for start in range(0, count, window)
        ]

    def __iter__(self) -> Iterator[Any]:
        if self._shard is None:
            self._shard = _Shard(self.path)
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        yield from self._batches(self._shard, worker, workers, in_worker=info is not None)

    def _batches(self, shard: _Shard, worker: int, workers: int, in_worker: bool) -> Iterator[Any]:
        total = self.epoch_rows
        if total == 0:
            return
        convert = _Converter(self.columns)
        sources = self._sources(shard, convert)
        size = self.batch_size
        pending: list[tuple[_Source, int, int]] = []
        filled = index = taken = 0
        finished: list[_Source] = []
        try:
            while taken < total:  # one pass over the shard; more passes wrap around
                for source in sources:
                    start, stop = 0, min(source.rows, total - taken)
                    taken += stop
                    while start < stop:
                        step = min(stop - start, size - filled)
                        pending.append((source, start, start + step))
                        start += step
                        filled += step
                        if filled == size:
                            if index % workers == worker:
                                yield self._assemble(pending, in_worker)
                            index += 1
                            pending, filled = [], 0
                            for done in finished:
                                done.release()
                            finished = []
                    if pending:
                        finished.append(source)
                    else:
                        source.release()
                    if taken >= total:
                        break
            if pending and not self.drop_last and index % workers == worker:
                yield self._assemble(pending, in_worker)
        finally:
            for source in sources:
                source.release()

    def _assemble(self, pieces: list[tuple[_Source, int, int]], in_worker: bool) -> Any:
        """One batch from its pieces: each column copied once into a new array (a piece may
        point into the map), which becomes its tensor without another copy.

        In a worker process the batch stays numpy arrays: they cross to the main process inside
        the pickled message, where a tensor each would cost a shared-memory file and a file
        descriptor handed over a socket per column. :class:`PartitionLoader` makes them tensors
        on arrival (a plain ``DataLoader``'s default conversion does the same in the worker).
        """
        arrays: list[np.ndarray] = []
        for column in self.columns:
            parts = [source.arrays()[column.name][start:stop] for source, start, stop in pieces]
            if len(parts) == 1:
                arrays.append(np.array(parts[0], dtype=column.cast))
            else:
                arrays.append(np.concatenate(parts, dtype=column.cast))
        batch: list[Any] = arrays if in_worker else [torch.from_numpy(a) for a in arrays]
        if self.style == "pyspark":
            return batch
        return {column.name: value for column, value in zip(self.columns, batch, strict=True)}


def _keep(batch: Any) -> Any:
    """The loader's ``collate_fn``: batches come whole from the dataset."""
    return batch


def _tensors(batch: Any) -> Any:
    """A batch from a worker, its numpy arrays made tensors (no copy)."""
    if isinstance(batch, dict):
        return {name: _tensor(value) for name, value in batch.items()}
    if isinstance(batch, list):
        return [_tensor(value) for value in batch]
    return batch


def _tensor(value: Any) -> Any:
    return torch.from_numpy(value) if isinstance(value, np.ndarray) else value


def _epoch(epoch: object) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, int | np.integer) or epoch < 0:
        raise ConfigError("epoch", f"must be a non-negative integer, got {epoch!r}")
    return int(epoch)


class _EpochSampler(Sampler[None]):
    """The sampler slot of the loader: what an iterable dataset's loader draws (``None``
    forever), plus ``set_epoch``, which Lightning calls on a loader's sampler every epoch."""

    def __init__(self, loader: PartitionLoader) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[None]:
        while True:
            yield None

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


class _TensorIterator(_MultiProcessingDataLoaderIter):
    """The worker processes' iterator, making tensors of the numpy batches that arrive."""

    def _next_data(self) -> Any:
        return _tensors(super()._next_data())


class PartitionLoader(DataLoader):
    """A ``DataLoader`` over a :class:`PartitionDataset`, yielding its batches as they are.

    Lightning accepts it as is: an iterable dataset's loader gets no distributed sampler, and
    Lightning's per-epoch ``sampler.set_epoch(epoch)`` reaches :meth:`set_epoch`.
    """

    dataset: PartitionDataset

    def __init__(
        self,
        dataset: PartitionDataset,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
    ) -> None:
        super().__init__(
            dataset,
            batch_size=None,
            collate_fn=_keep,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
        )
        # DataLoader guards `sampler` once built; an iterable dataset's sampler only yields
        # None, so putting one with set_epoch in its place changes nothing else.
        object.__setattr__(self, "sampler", _EpochSampler(self))
        self._next_epoch = 0

    @property
    def epoch(self) -> int:
        """The epoch of the latest (or, before any, the next) iteration."""
        return self.dataset.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (later ones follow: epoch + 1, ...)."""
        self._next_epoch = _epoch(epoch)
        self.dataset.set_epoch(self._next_epoch)

    def __iter__(self) -> Any:
        self.dataset.set_epoch(self._next_epoch)
        self._next_epoch += 1
        return super().__iter__()

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        self.check_worker_number_rationality()
        return _TensorIterator(self)

    def __repr__(self) -> str:
        data = self.dataset
        return (
            f"PartitionLoader({os.path.basename(data.path)}, rows={data.shard_rows}, "
            f"epoch_rows={data.epoch_rows}, batch_size={data.batch_size}, "
            f"batches={len(data)}, shuffle={data.shuffle})"
        )


__all__ = ["PartitionDataset", "PartitionLoader"]
