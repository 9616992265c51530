"""A logging handler that keeps every record, for tests that read what a run logged."""

from __future__ import annotations

import logging


class Collect(logging.Handler):
    """Keeps every record it is handed, at every level."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self) -> list[str]:
        """Every record's message, formatted."""
        return [record.getMessage() for record in self.records]


def collecting_logger(name: str) -> tuple[logging.Logger, Collect]:
    """A fresh logger of its own (``name`` plus a unique suffix), at DEBUG, not propagating,
    whose records a :class:`Collect` keeps."""
    logger = logging.getLogger(f"{name}.{id(object())}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    collect = Collect()
    logger.addHandler(collect)
    return logger, collect
