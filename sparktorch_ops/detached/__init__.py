"""Detached runs: a training whose driver runs in a process of its own, its whole state in a
run directory that any process reads (:class:`RunHandle`), so that the caller may go away.

``TorchDistributor(..., detached=True).submit(train)`` returns a :class:`RunHandle` at once;
``RunHandle(run_dir)`` reattaches from anywhere; ``sparktorch-ops status|logs|wait|cancel RUN``
does the same from a shell. The Airflow operator defers on one (``deferrable=True``), the
Prefect task waits on one (``detached=True``). See docs/detached.md.
"""

from __future__ import annotations

from sparktorch_ops.detached.handle import RunHandle, RunLostError, RunStatus
from sparktorch_ops.detached.rundir import RunDirectoryError

__all__ = ["RunDirectoryError", "RunHandle", "RunLostError", "RunStatus"]
