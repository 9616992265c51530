"""DataFrame input: what a run trains on, checked before anything starts, laid out for the ranks.

A :class:`DataInput` names the data: a DataFrame, or (for templated pipelines) a SQL query, a
table or a path with its format, resolved on the run's session. :func:`inspect_input` checks it
with one Spark job (row count, array lengths) and turns every problem into a ``ConfigError``
naming the column: an empty input, a type that cannot become a tensor, ragged arrays.

Barrier mode lays the DataFrame out with ``repartition(tasks).mapInArrow(..., barrier=True)``:
each barrier task receives its partition as Arrow record batches and writes one shard per rank
(:func:`sparktorch_ops.data.write_shards`). Local mode streams the DataFrame to the driver one
partition at a time (:func:`stream_batches`) and writes the shards there. Ranks read their shard
with :mod:`sparktorch_ops.data`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparktorch_ops.errors import ConfigError

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
    """What :func:`inspect_input` found: rows, columns and the Spark schema (JSON)."""

    rows: int
    columns: tuple[str, ...]
    schema_json: str

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
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import ArrayType

    from sparktorch_ops import data

    check_dataframe(dataframe)
    schema = dataframe.schema
    try:
        arrow_schema = to_arrow_schema(schema)
    except Exception as exc:  # a type Arrow cannot carry at all
        raise ConfigError("dataframe", f"its schema cannot travel as Arrow: {exc}") from exc
    problems = data.tensor_problems(arrow_schema)
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
    (row,) = dataframe.agg(*aggregates).collect()
    rows = int(row["rows"])
    if rows == 0:
        raise ConfigError(
            "dataframe", "is empty: there is nothing to train on (check the query's filters)"
        )
    for index, name in enumerate(arrays):
        shortest, longest = row[f"min{index}"], row[f"max{index}"]
        if shortest != longest or shortest is None or shortest < 0:
            raise ConfigError(
                "dataframe",
                f"column {name!r} holds arrays of different lengths ({shortest} to {longest}, "
                "or nulls): a batch needs one length per column; pad or filter them",
            )
    return InputFacts(
        rows=rows,
        columns=tuple(schema.fieldNames()),
        schema_json=json.dumps(schema.jsonValue()),
    )


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

    def laid_out(self, tasks: int) -> DataFrame:
        """The DataFrame in ``tasks`` partitions of nearly equal size.

        Spark's round-robin ``repartition`` deals each input partition's rows out on its own,
        so sizes differ by at most the number of input partitions; the ranks of smaller
        shards wrap around to their own start so that every rank has the same rows per epoch.
        """
        return self.dataframe.repartition(tasks)


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
