"""The metrics a checkpoint carries (``reports.json``): rank 0's ``report()`` records, written
with the step and sent again, marked as replayed, when a run resumes from it."""

from __future__ import annotations

import json
import logging
from typing import Any

from sparktorch_ops.checkpoint.group import announce
from sparktorch_ops.checkpoint.storage import Storage
from sparktorch_ops.rank import reporting

REPORTS_FILE = "reports.json"
"""Rank 0's ``report()`` records of the last five minutes (``reporting.CARRY_S``), written
before the marker; :func:`load_latest` sends them again on a resume, so a committed
checkpoint implies its steps' metrics reach MLflow even if the driver died first."""


def carried(rank: int) -> list[dict[str, Any]]:
    """The records a checkpoint saved now carries: rank 0's, none on other ranks."""
    return reporting.records_for_checkpoint() if rank == 0 else []


def write(location: Storage, name: str, records: list[dict[str, Any]]) -> None:
    """Rank 0: write ``records`` into step directory ``name`` (nothing when there are none)."""
    if records:
        location.write(json.dumps(records).encode(), name, REPORTS_FILE)


def replay(location: Storage, name: str, log: logging.Logger | None) -> None:
    """Send the reports a checkpoint carries again (rank 0, on resume)."""
    if not location.is_file(name, REPORTS_FILE):
        return
    try:
        with location.open(name, REPORTS_FILE) as handle:
            records = json.loads(handle.read())
    except (OSError, ValueError) as exc:
        announce(
            f"the reports saved with {location.url(name)} cannot be read: {exc}",
            log,
            logging.WARNING,
        )
        return
    if isinstance(records, list):
        reporting.replay(record for record in records if isinstance(record, dict))
