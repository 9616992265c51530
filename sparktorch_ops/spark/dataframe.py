"""DataFrame input: what a run trains on, checked before anything starts, laid out for the ranks.

A :class:`DataInput` names the data: a DataFrame, or (for templated pipelines) a SQL query, a
table or a path with its format, resolved on the run's session. :func:`inspect_input` checks it
with one Spark job (row count, array lengths) and turns every problem into a ``ConfigError``
naming the column: an empty input, a type that cannot become a tensor, ragged arrays.

Barrier mode lays the DataFrame out in ``tasks`` partitions of equal size (to within one row;
:meth:`PreparedInput.laid_out`: the input itself when its partitions already are those, else
an exact shuffle) and runs ``mapInArrow(..., barrier=True)`` over them: each
barrier task receives its partition as Arrow record batches and writes one shard per rank
(:func:`~sparktorch_ops.data.shards.write_shards`). Local mode streams the DataFrame to the
driver one partition at a time (:func:`stream_batches`) and writes the shards there. Ranks read
their shard with :mod:`sparktorch_ops.data`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparktorch_ops.errors import ConfigError
from sparktorch_ops.spark.session import sql_functions

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

INPUT_FORMATS = ("parquet", "orc", "json", "csv", "delta", "avro")


@dataclass(frozen=True)
class DataInput:
    """What a run trains on: exactly one of a DataFrame, ``sql``, ``table`` or ``path``.

    Attributes:
        dataframe: a DataFrame (from the run's session).
        sql: a query run on the run's session (``SELECT * FROM events WHERE ds = '...'``).
        table: a table or view name.
        path: files to read with ``format``.
        format: the format of ``path`` (``parquet`` by default).
    """

    dataframe: Any = field(default=None, repr=False)
    sql: str | None = None
    table: str | None = None
    path: str | None = None
    format: str = "parquet"

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("dataframe", "sql", "table", "path")
            if getattr(self, name) not in (None, "")
        ]
        if len(given) != 1:
            raise ConfigError(
                "input",
                "give exactly one of a DataFrame, input_sql, input_table or input_path"
                + (f" (got {', '.join(given)})" if given else ""),
            )
        for name in ("sql", "table", "path"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"input_{name}", f"must be a string, got {value!r}")
        if self.path is not None and self.format not in INPUT_FORMATS:
            raise ConfigError(
                "input_format", f"{self.format!r} is not one of {', '.join(INPUT_FORMATS)}"
            )

    @classmethod
    def given(
        cls,
        dataframe: Any = None,
        sql: str | None = None,
        table: str | None = None,
        path: str | None = None,
        format: str = "parquet",
    ) -> DataInput | None:
        """The input a wrapper's parameters name, or None when none does (an empty rendered
        template counts as not given)."""
        sql, table, path = (value or None for value in (sql, table, path))
        if dataframe is None and sql is None and table is None and path is None:
            return None
        return cls(dataframe, sql, table, path, format)

    @property
    def description(self) -> str:
        """The input in words, for logs and summaries."""
        if self.sql is not None:
            return f"sql: {' '.join(self.sql.split())}"
        if self.table is not None:
            return f"table {self.table}"
        if self.path is not None:
            return f"{self.format} at {self.path}"
        return "a DataFrame"

    def resolve(self, session: SparkSession) -> DataFrame:
        """The DataFrame on ``session`` (a query or a read is planned, not run).

        Raises:
            ConfigError: the query, table or path does not resolve.
        """
        if self.dataframe is not None:
            return self.dataframe
        try:
            if self.sql is not None:
                return session.sql(self.sql)
            if self.table is not None:
                return session.table(self.table)
            return session.read.format(self.format).load(self.path)
        except Exception as exc:  # AnalysisException and friends: the user's input is wrong
            argument = "input_sql" if self.sql else "input_table" if self.table else "input_path"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(argument, f"{self.description} does not resolve: {first}") from exc


@dataclass(frozen=True)
class InputFacts:
    """What :func:`inspect_input` found: rows, columns, the Spark schema (JSON), the rows
    of each non-empty input partition (``(partition id, rows)``, for the exact layout) and how
    many partitions the input has (None where a Connect session cannot tell)."""

    rows: int
    columns: tuple[str, ...]
    schema_json: str
    partition_rows: tuple[tuple[int, int], ...] = ()
    partitions: int | None = None

    def summary(self) -> dict[str, Any]:
        """JSON-safe: rows and columns (for XCom and artifacts)."""
        return {"rows": self.rows, "columns": list(self.columns)}


def check_dataframe(dataframe: Any) -> None:
    """Refuse what is not a DataFrame.

    Raises:
        ConfigError: ``dataframe`` is not a pyspark DataFrame (classic or Connect).
    """
    kind = type(dataframe)
    if not (kind.__name__ == "DataFrame" and kind.__module__.startswith("pyspark.sql")):
        raise ConfigError(
            "dataframe", f"must be a pyspark DataFrame, got {kind.__module__}.{kind.__qualname__}"
        )


def inspect_input(dataframe: DataFrame) -> InputFacts:
    """Check a DataFrame for training with one Spark job, before anything starts.

    Raises:
        ConfigError: a column that cannot become a tensor, an empty DataFrame, arrays of
            different lengths in one column; each names the column and what to do.
    """
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import ArrayType

    from sparktorch_ops.data import shards

    check_dataframe(dataframe)
    F = sql_functions(dataframe)
    schema = dataframe.schema
    try:
        arrow_schema = to_arrow_schema(schema)
    except Exception as exc:  # a type Arrow cannot carry at all
        raise ConfigError("dataframe", f"its schema cannot travel as Arrow: {exc}") from exc
    problems = shards.tensor_problems(arrow_schema)
    if problems:
        name, why = next(iter(problems.items()))
        raise ConfigError(
            "dataframe",
            f"column {name!r} cannot become a tensor ({why}); select or cast the columns to "
            "train on (numbers, fixed-length numeric arrays, ML vectors)"
            + (f"; also {', '.join(map(repr, list(problems)[1:]))}" if len(problems) > 1 else ""),
        )
    arrays = [f.name for f in schema.fields if isinstance(f.dataType, ArrayType)]
    aggregates = [F.count(F.lit(1)).alias("rows")]
    for index, name in enumerate(arrays):
        aggregates += [
            F.min(F.size(F.col(f"`{name}`"))).alias(f"min{index}"),
            F.max(F.size(F.col(f"`{name}`"))).alias(f"max{index}"),
        ]
    # Per input partition: the counts place every row for the exact layout (laid_out).
    per_partition = (
        dataframe.groupBy(F.spark_partition_id().alias("partition")).agg(*aggregates).collect()
    )
    rows = sum(int(row["rows"]) for row in per_partition)
    if rows == 0:
        raise ConfigError(
            "dataframe", "is empty: there is nothing to train on (check the query's filters)"
        )
    for index, name in enumerate(arrays):
        lows = [row[f"min{index}"] for row in per_partition]
        highs = [row[f"max{index}"] for row in per_partition]
        shortest = None if None in lows else min(lows)
        longest = None if None in highs else max(highs)
        if shortest != longest or shortest is None or shortest < 0:
            raise ConfigError(
                "dataframe",
                f"column {name!r} holds arrays of different lengths ({shortest} to {longest}, "
                "or nulls): a batch needs one length per column; pad or filter them",
            )
    partition_rows = tuple(
        sorted((int(row["partition"]), int(row["rows"])) for row in per_partition)
    )
    return InputFacts(
        rows=rows,
        columns=tuple(schema.fieldNames()),
        schema_json=json.dumps(schema.jsonValue()),
        partition_rows=partition_rows,
        partitions=_num_partitions(dataframe) if _even(partition_rows) else None,
    )


def _even(partition_rows: tuple[tuple[int, int], ...]) -> bool:
    """Whether the non-empty partitions are the first ones and differ by at most one row."""
    ids = [partition for partition, _ in partition_rows]
    sizes = [rows for _, rows in partition_rows]
    return ids == list(range(len(ids))) and max(sizes) - min(sizes) <= 1


def _num_partitions(dataframe: DataFrame) -> int | None:
    """How many partitions a classic DataFrame has, where Spark can tell without running a
    job; else None (Connect, whose DataFrames have no RDD; a plan with a shuffle, whose
    partitions adaptive execution only knows once it ran the shuffle)."""
    try:
        plan = str(dataframe._jdf.queryExecution().executedPlan().toString())
        if "Exchange" in plan:
            return None
        return int(dataframe.rdd.getNumPartitions())
    except Exception:  # Connect (no JVM DataFrame here), or a plan that cannot say
        return None


@dataclass(frozen=True)
class PreparedInput:
    """A checked DataFrame, ready to be laid out for a run."""

    dataframe: Any = field(repr=False)
    facts: InputFacts
    description: str

    @property
    def arrow_schema(self) -> pa.Schema:
        """The schema of the record batches the ranks' shards hold."""
        from pyspark.sql.pandas.types import to_arrow_schema

        return to_arrow_schema(self.dataframe.schema)

    def fits(self, tasks: int) -> bool:
        """Whether the input already is ``tasks`` partitions whose sizes differ by at most one
        row: then the barrier stage can read it as it is, without a shuffle."""
        facts = self.facts
        return (
            facts.partitions == tasks
            and len(facts.partition_rows) == tasks
            and _even(facts.partition_rows)
        )

    def laid_out(self, tasks: int, *, shuffle: bool = False) -> DataFrame:
        """The DataFrame in ``tasks`` partitions whose sizes differ by at most one row.

        When the input already is such partitions (:meth:`fits`), it is the input itself, so
        the barrier tasks read the rows straight from it: no shuffle writes and reads them
        once more (``shuffle=True`` lays it out all the same, for inputs whose lineage a
        barrier stage cannot take, see :func:`barrier_refused`). Otherwise:
        Every row gets its position in the whole input (its input partition's offset, from
        :func:`inspect_input`'s counts, plus its place in that partition); task ``t`` gets the
        positions ``[t * rows / tasks, (t + 1) * rows / tasks)``, shuffled there by a key whose
        Spark hash lands in partition ``t``. Spark's round-robin ``repartition(tasks)`` deals
        each input partition out on its own and leaves sizes differing by up to the number of
        input partitions; then the ranks of smaller shards would repeat rows within an epoch.
        An input that reads differently the second time (a nondeterministic query) gets
        uneven shards, never lost rows; the ranks still see equal batch counts.
        """
        if not shuffle and self.fits(tasks):
            return self.dataframe
        F = sql_functions(self.dataframe)
        facts = self.facts
        if not facts.partition_rows:
            return self.dataframe.repartition(tasks)
        offsets: list[Any] = []
        start = 0
        for partition, count in facts.partition_rows:
            offsets += [F.lit(partition), F.lit(start)]
            start += count
        in_partition = F.monotonically_increasing_id().bitwiseAND(F.lit(_ROW_NUMBER_MASK))
        position = F.element_at(F.create_map(*offsets), F.spark_partition_id()) + in_partition
        task = F.least(F.floor(position * F.lit(tasks) / F.lit(facts.rows)), F.lit(tasks - 1))
        keys = F.array(*[F.lit(key) for key in partition_keys(tasks)])
        key = F.element_at(keys, task.cast("int") + 1)
        return self.dataframe.repartition(tasks, key.alias(_LAYOUT_KEY)).drop(_LAYOUT_KEY)


def barrier_refused(exc: BaseException) -> bool:
    """Whether Spark refused a barrier stage for its input's lineage: a barrier stage cannot
    hold RDDs whose partitions differ in number from its own (a ``union``, a ``coalesce``
    before it). Spark says so when the job is submitted, before any task runs."""
    java = getattr(exc, "java_exception", None)
    text = str(exc)
    if java is not None:
        try:
            text += str(java.toString())
        except Exception:  # the JVM may be gone; the Python side's text is enough
            pass
    return "Barrier execution mode does not allow" in text


# monotonically_increasing_id() is (partition id << 33) + the row's number in its partition.
_ROW_NUMBER_MASK = (1 << 33) - 1
_LAYOUT_KEY = "__sparktorch_ops_task"


def spark_hash_int(value: int, seed: int = 42) -> int:
    """Spark's ``hash()`` of an INT (Murmur3 x86 32-bit, as ``Murmur3_x86_32.hashInt``): the
    hash that ``repartition(n, column)`` takes modulo ``n`` to place a row."""

    def rotate(x: int, bits: int) -> int:
        return ((x << bits) | (x >> (32 - bits))) & 0xFFFFFFFF

    k1 = (value & 0xFFFFFFFF) * 0xCC9E2D51 & 0xFFFFFFFF
    k1 = rotate(k1, 15) * 0x1B873593 & 0xFFFFFFFF
    h1 = (seed & 0xFFFFFFFF) ^ k1
    h1 = (rotate(h1, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    h1 ^= 4
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & 0xFFFFFFFF
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & 0xFFFFFFFF
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def partition_keys(tasks: int) -> list[int]:
    """For each task ``t``, the smallest INT ``k`` that ``repartition(tasks, k)`` sends to
    partition ``t`` (``pmod(hash(k), tasks) == t``)."""
    keys: dict[int, int] = {}
    candidate = 0
    while len(keys) < tasks:
        keys.setdefault(spark_hash_int(candidate) % tasks, candidate)
        candidate += 1
    return [keys[task] for task in range(tasks)]


def prepare_input(data: DataInput, session: Any) -> PreparedInput:
    """Resolve ``data`` on ``session`` and check it (one Spark job).

    Raises:
        ConfigError: as :meth:`DataInput.resolve` and :func:`inspect_input`.
    """
    dataframe = data.resolve(session)
    return PreparedInput(dataframe, inspect_input(dataframe), data.description)


def _batches_as_ipc(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Executor side of :func:`stream_batches`: each record batch as one IPC-stream blob."""
    import pyarrow as pa

    for batch in batches:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        yield pa.record_batch([pa.array([sink.getvalue().to_pybytes()], pa.binary())], ["ipc"])


def stream_batches(dataframe: DataFrame) -> Iterator[pa.RecordBatch]:
    """The DataFrame's record batches on the driver, one partition in memory at a time.

    (``toArrow()`` would hold the whole DataFrame; ``toLocalIterator`` of the plain rows would
    convert every value in Python.)
    """
    import pyarrow as pa

    blobs = dataframe.mapInArrow(_batches_as_ipc, "ipc binary")
    for row in blobs.toLocalIterator():
        with pa.ipc.open_stream(pa.py_buffer(row["ipc"])) as reader:
            yield from reader
