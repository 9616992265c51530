"""Typed messages between the processes of a run (rank, supervisor, barrier task -> driver).

Each message is a frozen dataclass that knows its frame kind and encodes itself as JSON.
``decode`` checks every field's type, so a malformed frame is a :class:`MessageError` that the
driver handles as one bad connection, never an ``int(dict.get(...))`` deep in the collector.
"""

from __future__ import annotations

import json
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Literal, TypeVar

# Frame kinds (1 byte on the wire). Log lines and result chunks are raw bytes, not messages.
HELLO = 1
STDOUT = 2
STDERR = 3
METRIC = 4
RESULT_CHUNK = 5
RESULT_END = 6
EXIT = 7
FAILURE = 8
RDZV = 9  # task 0 -> driver: its rendezvous store's port; driver -> every task: the same
CHALLENGE = 10  # driver -> client, first: a nonce the HELLO must answer (see channel)
WELCOME = 11  # driver -> client: proof that the driver holds the run's secret
SHARDS = 12  # barrier task -> driver: the sizes of the data shards it wrote for its ranks
DATA = 13  # driver -> every task: rows per rank per epoch, once every task has its shards
STACK_REQUEST = 14  # driver -> a rank's supervisor: where are the rank's threads now?
STACKS = 15  # supervisor -> driver: the answer
ARRIVED = 16  # barrier task over Connect -> driver: it reached the driver and waits to be told
IN_STAGE = 17  # driver -> those tasks: some task did not reach it; agree among yourselves
NOTICE = 18  # rank -> driver: a line of our rank-side code, at its own log level
UNUSABLE = 19  # barrier task -> driver: its Python cannot run the ranks (no torch, a broken one)

Role = Literal["node", "supervisor", "worker"]
ROLES = ("node", "supervisor", "worker")


class MessageError(ValueError):
    """A frame whose payload is not the message its kind promises."""


M = TypeVar("M", bound="Message")


def _check(value: Any, expected: Any, name: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and expected is not bool:
        raise MessageError(f"{name} must be {expected.__name__}, got {value!r}")
    if not isinstance(value, expected):
        raise MessageError(f"{name} must be {expected.__name__}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise MessageError(f"{name} must be finite, got {value!r}")
    return value


_FIELD_TYPES: dict[type, dict[str, tuple[Any, bool]]] = {}


def _field_types(cls: type) -> dict[str, tuple[Any, bool]]:
    """Each field's JSON type and whether it may be null, read once from the class's
    annotations (``int | None``: an int or null; ``dict[str, Any]``: an object; a
    ``Literal``: its values' type)."""
    known = _FIELD_TYPES.get(cls)
    if known is not None:
        return known
    hints = typing.get_type_hints(cls)
    found: dict[str, tuple[Any, bool]] = {}
    for item in fields(cls):
        hint = hints[item.name]
        optional = typing.get_origin(hint) is types.UnionType and type(None) in typing.get_args(
            hint
        )
        if optional:
            (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        origin = typing.get_origin(hint)
        if origin is Literal:
            hint = type(typing.get_args(hint)[0])
        elif origin is not None:
            hint = origin
        found[item.name] = (hint, optional)
    _FIELD_TYPES[cls] = found
    return found


@dataclass(frozen=True)
class Message:
    """Base of every typed message."""

    KIND: ClassVar[int] = 0

    def encode(self) -> bytes:
        """The frame payload: UTF-8 JSON."""
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls: type[M], payload: bytes | bytearray) -> M:
        """Parse and check a payload.

        Raises:
            MessageError: not JSON, not an object, a missing or mistyped field.
        """
        try:
            record = json.loads(bytes(payload))
        except (ValueError, RecursionError) as exc:
            raise MessageError(f"{cls.__name__}: not JSON ({type(exc).__name__})") from None
        if not isinstance(record, dict):
            raise MessageError(f"{cls.__name__}: expected a JSON object")
        values: dict[str, Any] = {}
        for item in fields(cls):
            expected, optional = _field_types(cls)[item.name]
            if item.name not in record:
                if optional:
                    values[item.name] = None
                    continue
                raise MessageError(f"{cls.__name__}: missing {item.name}")
            values[item.name] = _check(
                record[item.name], expected, f"{cls.__name__}.{item.name}", optional
            )
        message = cls(**values)
        message.validate()
        return message

    def validate(self) -> None:
        """Checks across fields (subclasses override)."""


@dataclass(frozen=True)
class Hello:
    """The first frame of every connection: who is talking (the secret is checked apart)."""

    role: Role
    rank: int | None = None
    local_rank: int | None = None
    group_rank: int | None = None
    node: int | None = None
    host: str = ""
    attempt: int = 0
    pid: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (what goes into the HELLO frame besides the credentials)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, record: Any) -> Hello:
        """Check a decoded HELLO.

        Raises:
            MessageError: a missing or mistyped field, an unknown role, or no rank / node for
                the role.
        """
        if not isinstance(record, dict):
            raise MessageError("Hello: expected a JSON object")
        values: dict[str, Any] = {}
        for name, (expected, optional) in _field_types(cls).items():
            if name in record:
                values[name] = _check(record[name], expected, f"Hello.{name}", optional)
        if "role" not in values:
            raise MessageError("Hello: missing role")
        hello = cls(**values)
        if hello.role not in ROLES:
            raise MessageError(f"Hello: unknown role {hello.role!r}")
        if hello.role == "node" and (hello.node is None or hello.node < 0):
            raise MessageError("Hello: a node must say which node it is")
        if hello.role != "node" and (hello.rank is None or hello.rank < 0):
            raise MessageError(f"Hello: a {hello.role} must say its rank")
        if hello.attempt < 0:
            raise MessageError("Hello: attempt must be >= 0")
        return hello

    @property
    def who(self) -> str:
        """``"rank 3"`` or ``"node 1"``, for events and logs."""
        return f"node {self.node}" if self.role == "node" else f"rank {self.rank}"


@dataclass(frozen=True)
class MetricReport(Message):
    """One ``report()`` call."""

    KIND: ClassVar[int] = METRIC
    step: int
    time: float
    values: dict[str, Any] = field(default_factory=dict)
    progress: float | None = None
    # Sent again from a resumed checkpoint (an earlier try reported it).
    replayed: bool | None = None

    def validate(self) -> None:
        """Values are JSON scalars; progress in [0, 1]."""
        if self.progress is not None and not 0.0 <= self.progress <= 1.0:
            raise MessageError(f"MetricReport.progress out of [0, 1]: {self.progress}")
        for key, value in self.values.items():
            if value is not None and not isinstance(value, (bool, int, float, str)):
                raise MessageError(f"MetricReport.values[{key!r}] is not a scalar")


@dataclass(frozen=True)
class Notice(Message):
    """A line our rank-side code says (a checkpoint resumed, a fresh start), at a log level of
    its own: the rank's stderr reaches the driver's log at WARNING, which such lines are not."""

    KIND: ClassVar[int] = NOTICE
    level: int
    text: str

    def validate(self) -> None:
        """A level of the standard library's logging (DEBUG to CRITICAL)."""
        if self.level not in (10, 20, 30, 40, 50):
            raise MessageError(f"Notice.level must be a logging level, got {self.level}")


@dataclass(frozen=True)
class UnusablePython(Message):
    """A barrier task's Python cannot run the ranks: torch is missing or does not import."""

    KIND: ClassVar[int] = UNUSABLE
    executable: str
    host: str
    reason: str


@dataclass(frozen=True)
class ExitReport(Message):
    """How a rank process (or a node's agent) exited."""

    KIND: ClassVar[int] = EXIT
    exit_code: int | None
    signal: str | None = None
    time: float = 0.0


@dataclass(frozen=True)
class FailureReport(Message):
    """An exception raised by the user's code on a rank."""

    KIND: ClassVar[int] = FAILURE
    type: str
    message: str
    traceback: str = ""
    time: float = 0.0


@dataclass(frozen=True)
class ResultEnd(Message):
    """Rank 0's result is complete: its total size, to check against the chunks."""

    KIND: ClassVar[int] = RESULT_END
    size: int


@dataclass(frozen=True)
class RendezvousPort(Message):
    """Task 0's rendezvous store port, or why it could not host one."""

    KIND: ClassVar[int] = RDZV
    port: int | None = None
    error: str | None = None

    def validate(self) -> None:
        """Exactly one of port (1-65535) and error."""
        if (self.port is None) == (self.error is None):
            raise MessageError("RendezvousPort: exactly one of port and error")
        if self.port is not None and not 0 < self.port < 65536:
            raise MessageError(f"RendezvousPort: bad port {self.port}")


@dataclass(frozen=True)
class ShardSizes(Message):
    """The rows of each shard a barrier task wrote for its ranks (DataFrame input)."""

    KIND: ClassVar[int] = SHARDS
    rows: list[int] = field(default_factory=list)

    def validate(self) -> None:
        """Non-negative integers, at least one."""
        if not self.rows or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in self.rows
        ):
            raise MessageError(f"ShardSizes.rows must be non-negative integers: {self.rows!r}")


@dataclass(frozen=True)
class DataLayout(Message):
    """Rows every rank yields per epoch (the largest shard), or why the data cannot run."""

    KIND: ClassVar[int] = DATA
    epoch_rows: int | None = None
    error: str | None = None

    def validate(self) -> None:
        """Exactly one of a positive epoch_rows and error."""
        if (self.epoch_rows is None) == (self.error is None):
            raise MessageError("DataLayout: exactly one of epoch_rows and error")
        if self.epoch_rows is not None and self.epoch_rows < 1:
            raise MessageError(f"DataLayout: bad epoch_rows {self.epoch_rows}")

    @classmethod
    def for_shards(cls, shards: Mapping[int, Sequence[int]]) -> DataLayout:
        """The layout of every task's shard sizes (task -> rows per rank): the largest shard,
        or an error naming the tasks where some rank got no rows."""
        empty = [f"task {n}" for n, rows in sorted(shards.items()) if min(rows) == 0]
        if empty:
            return cls(
                error=f"{', '.join(empty)} got no rows for some rank: the DataFrame has fewer "
                "rows than ranks, or its partitions are too skewed to share out"
            )
        return cls(epoch_rows=max(max(rows) for rows in shards.values()))


@dataclass(frozen=True)
class StackRequest(Message):
    """The driver asks a rank's supervisor for the rank's Python stacks (``request`` is echoed
    in the answer, so answers to concurrent requests do not mix)."""

    KIND: ClassVar[int] = STACK_REQUEST
    request: int


#: How a rank's stacks were taken: by its helper thread, by faulthandler on a signal (the
#: helper could not run), or not at all (the rank did not answer).
STACK_SOURCES = ("threads", "faulthandler", "none")


@dataclass(frozen=True)
class RankStacks(Message):
    """Where a rank was: every thread's stack (``text``), the training thread's innermost frame
    in one line (``where``), and how they were taken (one of :data:`STACK_SOURCES`)."""

    KIND: ClassVar[int] = STACKS
    request: int
    text: str
    where: str
    source: str

    def validate(self) -> None:
        """A known source."""
        if self.source not in STACK_SOURCES:
            raise MessageError(f"RankStacks.source must be one of {STACK_SOURCES}")


@dataclass(frozen=True)
class Arrived(Message):
    """A barrier task over Spark Connect reached the driver: it waits for the rendezvous port
    and the data layout from the driver, unless told to agree in the stage
    (:class:`AgreeInStage`)."""

    KIND: ClassVar[int] = ARRIVED
    node: int


@dataclass(frozen=True)
class AgreeInStage(Message):
    """The driver to the tasks that reached it: some task did not in time, so the tasks agree
    on the rendezvous port and the data layout among themselves (Spark's ``allGather``)."""

    KIND: ClassVar[int] = IN_STAGE
