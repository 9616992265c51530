"""What the run loop needs of a launcher, whichever way it starts a run's agents.

Constructing a launcher does nothing; ``start()`` does the I/O (a work directory and the agent on
the driver, or the Spark barrier job). Every launcher then answers supervision with one
:class:`LauncherStatus` (``status()``), and ends the same two ways: ``stop()`` (the run raised:
stop everything of it now; idempotent) and ``release()`` (after the run, however it ended:
nothing of it left).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class LauncherStatus:
    """What a launcher knows of its run, at one moment.

    Attributes:
        exit: None while the agents run; else the overall exit status and a note.
        error: what ends the run instead of an exit status, for supervision to raise: the
            job killed outside the run (``SparkJobKilledError``), executors whose Python is
            not the driver's version (``ConfigError``).
        tasks_started: the launcher saw every rank's task start (a start deadline then no
            longer applies: the ranks are past waiting for slots).
        cause: the cluster's own reason for a failed job, once known.
        cause_detail: the same with the cluster's detail (the failed task's story).
        cause_pending: the cluster may still say why something of the run was lost (its job
            has not ended): worth a short wait.
        start_timeout: the start deadline when the run sets none (None: no deadline).
        start_timeout_hint: what a start timeout's message adds (why slots may have lacked).
    """

    exit: tuple[int, str] | None = None
    error: BaseException | None = None
    tasks_started: bool = False
    cause: str | None = None
    cause_detail: str = ""
    cause_pending: bool = False
    start_timeout: float | None = None
    start_timeout_hint: str = ""


class Launcher(Protocol):
    """What the run loop needs of a launcher; it never asks which kind it holds."""

    def start(self) -> None:
        """Start the run's agents."""

    def status(self, *, lost: bool = False) -> LauncherStatus:
        """Where the run's agents are now; ``lost``: something of the run was lost, look for
        why at once."""

    def stop(self) -> None:
        """Stop everything of the run now (idempotent)."""

    def release(self) -> None:
        """After the run, however it ended: nothing of it left (waits, bounded, for that)."""
