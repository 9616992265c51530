"""Attempts of a run (``max_failures``): which failed attempt a new one can cure, and what the
run says when it starts the next (pure).

A new attempt helps when something under the training went away: a barrier task's executor or
host, a rank's agent, a rank killed by a signal (the OOM killer's SIGKILL, a preemption's
SIGTERM). It does not when the training failed on its own (a Python exception, a non-zero
exit): the same code on the same data fails again, so that error is final.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sparktorch_ops.results import RankFailure

# Spark's own words for an executor that went away (its job's error, when the driver's
# channel did not see the task go first).
_SPARK_LOST_EXECUTOR = re.compile(
    r"ExecutorLostFailure|Lost executor|executor lost|Executor heartbeat timed out|"
    r"Worker lost|Container killed|decommission",
    re.IGNORECASE,
)
# What torchrun and our teardown stop the other ranks of a failed group with: a rank that
# got it was collateral, unless it was the first to fail.
_COLLATERAL_SIGNAL = "SIGTERM"


@dataclass(frozen=True)
class Cause:
    """Why an attempt ended, in words, and the host where it happened (when known)."""

    text: str
    host: str | None = None


def infrastructure_cause(
    failures: Sequence[RankFailure],
    lost_nodes: Mapping[int, str],
    lost_ranks: Mapping[int, str],
    spark_error: str | None,
) -> Cause | None:
    """The infrastructure failure that ended an attempt, or None when the training's own
    failure did (then a new attempt would fail the same way).

    Args:
        failures: the attempt's failed ranks, the first to fail first.
        lost_nodes: barrier tasks whose connection dropped without their agent's exit, by
            node: their hosts.
        lost_ranks: ranks whose process vanished without an exit report, by rank: their hosts.
        spark_error: Spark's own reason for the failed job, if any.
    """
    if lost_nodes:
        node, host = min(lost_nodes.items())
        return Cause(
            f"barrier task {node} on {host} was lost (its executor or host went away)", host
        )
    for index, failure in enumerate(failures):
        if failure.signal is not None and (index == 0 or failure.signal != _COLLATERAL_SIGNAL):
            where = f" on {failure.host}" if failure.host else ""
            return Cause(f"rank {failure.rank}{where} was killed by {failure.signal}", failure.host)
    if lost_ranks:
        rank, host = min(lost_ranks.items())
        where = f" on {host}" if host else ""
        return Cause(f"the process of rank {rank}{where} vanished", host or None)
    if spark_error is not None and _SPARK_LOST_EXECUTOR.search(spark_error):
        return Cause(f"Spark lost an executor: {spark_error.strip().splitlines()[0]}")
    return None


def retry_line(
    number: int,
    attempts_allowed: int,
    cause: Cause,
    last_step: int | None,
    resume_step: int | None,
    next_processes: int,
) -> str:
    """The WARNING a run logs when it starts another attempt: ``attempt 1 of 3 ended: <cause>
    at step 4; starting attempt 2 from the checkpoint of step 3 with 2 ranks``."""
    at_step = f" at step {last_step}" if last_step is not None else ""
    start = f"from the checkpoint of step {resume_step}" if resume_step is not None else "afresh"
    return (
        f"sparktorch_ops: attempt {number} of {attempts_allowed} ended: {cause.text}{at_step}; "
        f"starting attempt {number + 1} {start} with {next_processes} ranks"
    )
