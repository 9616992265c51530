"""Rank 0's result on the driver: its pickled bytes, kept in the chunks they arrived in, up to
the run's ``max_result_bytes`` (refused beyond it as soon as more has arrived, see
:class:`~sparktorch_ops.errors.ResultTooLargeError`)."""

from __future__ import annotations

import io
from collections import deque
from typing import Any

from sparktorch_ops.errors import ResultTooLargeError


class ResultBytes(io.RawIOBase):
    """Rank 0's pickled result, held in the chunks it arrived in and read once.

    The unpickler reads large values straight into their final buffer (``readinto``), and
    every chunk is released as soon as it has been read, so the driver never holds the whole
    pickle twice (chunks plus a joined copy).
    """

    def __init__(self, chunks: list[bytes | bytearray]) -> None:
        super().__init__()
        self._chunks = deque(chunks)
        self._offset = 0
        self.size = sum(len(chunk) for chunk in chunks)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(target) and self._chunks:
            chunk = self._chunks[0]
            take = min(len(chunk) - self._offset, len(target) - filled)
            target[filled : filled + take] = memoryview(chunk)[self._offset : self._offset + take]
            filled += take
            self._offset += take
            if self._offset == len(chunk):
                self._chunks.popleft()
                self._offset = 0
        return filled

    def reader(self) -> io.BufferedReader:
        """A buffered file over the bytes, for ``pickle.load``."""
        return io.BufferedReader(self, buffer_size=1 << 16)


class ResultAssembly:
    """Rank 0's result as its chunks arrive.

    Attributes:
        value: the whole result, once its end arrived with every byte it announced.
        refused: the error, once the result passed the limit (nothing of it is kept then).
    """

    def __init__(self, max_bytes: int | None) -> None:
        self._max_bytes = max_bytes
        self._chunks: list[bytes | bytearray] = []
        self._size = 0
        self.value: ResultBytes | None = None
        self.refused: ResultTooLargeError | None = None

    def add(self, chunk: bytes | bytearray) -> None:
        """Keep a chunk, unless the result has passed the limit: then release what arrived
        and keep nothing more of it (the run fails with the error)."""
        if self.refused is not None:
            return
        self._size += len(chunk)
        if self._max_bytes is not None and self._size > self._max_bytes:
            self._chunks = []
            self.refused = ResultTooLargeError(self._size, self._max_bytes)
            return
        self._chunks.append(chunk)

    def end(self, size: int) -> ResultBytes | None:
        """The result is complete at ``size`` bytes: its value, None when it was refused (the
        error then states the exact size) or bytes are missing."""
        if self.refused is not None:
            self.refused = ResultTooLargeError(size, self.refused.limit, exact=True)
            return None
        result = ResultBytes(self._chunks)
        self._chunks, self._size = [], 0
        if size != result.size:
            return None
        self.value = result
        return result

    def reset(self) -> None:
        """Forget a result of an earlier attempt."""
        self._chunks, self._size = [], 0
        self.value = None
        self.refused = None
