"""What the ranks of a run said, on the driver: :class:`RunCollector` reads the channel's frames
(:mod:`.handler`) and keeps them by job: output (:mod:`.output`), rank 0's result
(:mod:`.result`), exits and failures (:mod:`.failures`), metrics (:mod:`.metrics`), stack
answers (:mod:`.stacks`). Everything kept is bounded, so that no rank can exhaust the
driver's memory."""

from __future__ import annotations

from sparktorch_ops.driver.collector.handler import RunCollector

__all__ = ["RunCollector"]
