"""What the run loop needs of a launcher, whichever way it starts a run's agents.

Constructing a launcher does nothing; ``start()`` does the I/O (a work directory and the agent on
the driver, or the Spark barrier job). Every launcher then exposes the same small surface to the
run loop in :mod:`sparktorch_ops.distributor`: ``poll()`` (None while running, else the overall
exit status and a note), ``teardown()`` (idempotent: stop everything of the run) and
``finish()`` (after the run, however it ended).
"""

from __future__ import annotations

from typing import Protocol


class Launcher(Protocol):
    """What the run loop needs of a launcher."""

    def start(self) -> None:
        """Start the run's agents."""

    def poll(self) -> tuple[int, str] | None:
        """None while running; else the overall exit status and a note."""

    def teardown(self) -> None:
        """Stop everything of the run (idempotent)."""

    def finish(self) -> None:
        """After the run, however it ended: nothing of it left."""
