"""The ``report()`` records on the driver: every one to ``on_metrics``, the latest
``MAX_METRIC_RECORDS`` kept for the result (older ones dropped, counted, with one warning)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from sparktorch_ops.results import MetricRecord
from sparktorch_ops.wire.messages import MetricReport

MAX_METRIC_RECORDS = 100_000


class MetricLog:
    """The run's metric records.

    Args:
        log: the run's logger (the one warning when records are dropped, a raising callback).
        on_metrics: called with each :class:`MetricRecord`; exceptions are logged, not raised.
        max_records: how many records :attr:`records` keeps (the latest).
    """

    def __init__(
        self,
        log: Any,
        on_metrics: Callable[[MetricRecord], None] | None,
        max_records: int = MAX_METRIC_RECORDS,
    ) -> None:
        self._log = log
        self._on_metrics = on_metrics
        self.records: deque[MetricRecord] = deque(maxlen=max_records)
        self.dropped = 0

    def last_step(self, rank: int = 0) -> int | None:
        """The step of ``rank``'s latest record reported live (not replayed), if any."""
        for record in reversed(self.records):
            if record.rank == rank and not record.replayed:
                return record.step
        return None

    def add(self, rank: int, report: MetricReport) -> MetricRecord:
        """Keep ``rank``'s report (under the collector's lock); returns it for :meth:`tell`."""
        metric = MetricRecord(
            rank=rank,
            step=report.step,
            time=report.time,
            values=dict(report.values),
            progress=report.progress,
            replayed=bool(report.replayed),
        )
        if len(self.records) == self.records.maxlen:
            self.dropped += 1
            if self.dropped == 1:
                self._log.log(
                    logging.WARNING,
                    "sparktorch_ops: more than %d metric records; RunResult.metrics keeps the "
                    "latest %d (on_metrics still gets every record)",
                    self.records.maxlen,
                    self.records.maxlen,
                )
        self.records.append(metric)
        return metric

    def tell(self, record: MetricRecord) -> None:
        """Pass a kept record to ``on_metrics`` (outside the collector's lock)."""
        if self._on_metrics is not None:
            try:
                self._on_metrics(record)
            except Exception:
                self._log.exception("sparktorch_ops: the on_metrics callback raised; ignored")
