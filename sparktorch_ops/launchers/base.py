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
    """What the run loop needs of a launcher; it never asks which kind it holds.

    Attributes:
        default_start_timeout: the start deadline when the run sets none (None: no deadline).
        start_timeout_hint: what a start timeout's message adds (why slots may have lacked).
        explains_losses: a lost rank or task has a cause this launcher can find
            (:meth:`look_for_cause`, then ``spark_error``).
        needs_release: the agents share a rendezvous store that :meth:`release_rendezvous`
            lets go once every agent is done with it.
        spark_error: Spark's own reason for a failed job, once known (else None).
        spark_error_detail: the same with Spark's detail (the failed task's story).
    """

    default_start_timeout: float | None
    start_timeout_hint: str
    explains_losses: bool
    needs_release: bool
    spark_error: str | None
    spark_error_detail: str

    @property
    def stage_started(self) -> bool:
        """Whether the launcher saw every rank's task start (a start deadline then no longer
        applies: the ranks are past waiting for slots)."""

    def start(self) -> None:
        """Start the run's agents."""

    def poll(self) -> tuple[int, str] | None:
        """None while running; else the overall exit status and a note."""

    def look_for_cause(self) -> None:
        """Something was lost: find out why as soon as possible."""

    def release_rendezvous(self) -> None:
        """Every agent is done with the rendezvous store: let it go."""

    def teardown(self) -> None:
        """Stop everything of the run (idempotent)."""

    def finish(self) -> None:
        """After the run, however it ended: nothing of it left."""
