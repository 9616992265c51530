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
