"""A deferred training: the operator submits it detached and hands the wait to the triggerer.

With ``deferrable=True`` the task's try submits the training detached (its driver in a
process of its own, its state in a run directory) and defers to :class:`TorchTrainingTrigger`,
which watches the run directory from the triggerer's event loop (every read in a thread) and
forwards the training's log lines to the task log meanwhile; no worker slot is held while it
trains. The task resumes in ``execute_complete`` with the same XCom summary as an attached run.

- A triggerer restart re-creates the trigger from :meth:`TorchTrainingTrigger.serialize`: it
  goes on watching the same run (the training never depended on the triggerer).
- A retry, or a worker that died before the deferral, finds the training's run directory (the
  durable record's training id names it) and reattaches instead of training twice.
- ``execution_timeout`` holds while deferred: the trigger gets the deadline and cancels the
  run when it passes (Airflow's own trigger timeout, a little later, is only the backstop).
- Marking the deferred task failed or success, or clearing it, calls the trigger's
  ``on_kill`` (Airflow 3.3): it writes the run's cancel request, naming its try. A cleared
  task's next try may reattach before that request lands (the scheduler can start it first):
  when its run then ends cancelled by an earlier try's stop, it starts the training over.
  ``cleanup()``, called on every exit of the trigger (a triggerer's restart included), never
  cancels. Airflow 3.1 and 3.2 have no ``on_kill`` for triggers: there, ``sparktorch-ops
  cancel RUN_DIR`` stops the training.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import AsyncIterator
from typing import Any, NoReturn

from airflow.providers.common.compat.sdk import AirflowTaskTimeout
from airflow.triggers.base import BaseTrigger, TriggerEvent

from sparktorch_ops.detached.handle import MAX_POLL_S, RunHandle
from sparktorch_ops.detached.rundir import RunDirectory
from sparktorch_ops.wire.channel import backoff

#: Seconds between the trigger's cancel at the deadline and Airflow's own trigger timeout.
TIMEOUT_MARGIN_S = 60.0
_CANCEL_WAIT_S = 60.0
_STOPPED = "the deferred Airflow task was stopped"


class TorchTrainingTrigger(BaseTrigger):
    """Fires once the detached training in ``run_dir`` has ended (however it ended).

    Args:
        run_dir: the training's run directory.
        deadline: when the task's ``execution_timeout`` runs out (seconds since the epoch);
            the trigger cancels the training then.
        poll_interval: the most seconds between two looks (it starts faster).
        try_number: the task's try that deferred (named in the cancel request of ``on_kill``).
    """

    def __init__(
        self,
        run_dir: str,
        deadline: float | None = None,
        poll_interval: float = MAX_POLL_S,
        try_number: int | None = None,
    ) -> None:
        super().__init__()
        self.run_dir = run_dir
        self.deadline = deadline
        self.poll_interval = poll_interval
        self.try_number = try_number

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """What re-creates this trigger in another triggerer process."""
        names = ("run_dir", "deadline", "poll_interval", "try_number")
        path = f"{type(self).__module__}.{type(self).__qualname__}"
        return path, {name: getattr(self, name) for name in names}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Look at the run directory until the training has ended; log its lines meanwhile."""
        handle = await asyncio.to_thread(RunHandle, self.run_dir)
        after, pauses, timed_out = 0, backoff(0.2, self.poll_interval), False
        while True:
            status = await asyncio.to_thread(handle.status)
            after = await asyncio.to_thread(handle.forward_logs, self.log, after)
            past = self.deadline is not None and time.time() >= self.deadline
            if status.done or (timed_out and past):
                yield TriggerEvent(
                    {"run_dir": self.run_dir, "state": status.state, "timed_out": timed_out}
                )
                return
            if past:
                self.log.warning(
                    "sparktorch_ops: the task's execution_timeout ran out: cancelling the "
                    "training in %s",
                    self.run_dir,
                )
                await asyncio.to_thread(handle.cancel, "the Airflow task's execution_timeout")
                timed_out = True
                self.deadline = time.time() + _CANCEL_WAIT_S  # then it reports whatever it is
            await asyncio.sleep(next(pauses))

    async def on_kill(self) -> None:
        """The deferred task was marked failed or success, or cleared: stop the training."""
        handle = await asyncio.to_thread(RunHandle, self.run_dir)
        await asyncio.to_thread(handle.cancel, stop_reason(self.try_number))


def stop_reason(try_number: int | None) -> str:
    """The cancel request a stopped deferred try writes."""
    return f"{_STOPPED} (try {try_number})"


def stopped_for_an_earlier_try(event: dict[str, Any], try_number: int, log: Any) -> bool:
    """Whether the run ended cancelled by another try's stop (said in ``log``): the task was
    cleared while it was deferred, and this next try reattached before the earlier trigger's
    ``on_kill``; the training must start over."""
    if event.get("state") != "cancelled" or event.get("timed_out"):
        return False
    reason = RunDirectory(event["run_dir"]).cancel_requested() or ""
    if not reason.startswith(_STOPPED) or reason == stop_reason(try_number):
        return False
    log.info("sparktorch_ops: the training was stopped for an earlier try: starting it over")
    return True


def defer_training(operator: Any, job: Any, context: Any) -> NoReturn:
    """Submit ``job`` detached (or reattach to its training's run) and defer to the trigger
    that watches it; ``execution_timeout`` becomes the trigger's deadline."""
    from sparktorch_ops.detached.submit import submit

    handle = submit(job)
    deadline = timeout = None
    limit = getattr(operator, "execution_timeout", None)
    started = getattr(context["ti"], "start_date", None)
    if limit is not None and started is not None:
        deadline = started.timestamp() + limit.total_seconds()
        timeout = datetime.timedelta(seconds=max(deadline - time.time(), 0) + TIMEOUT_MARGIN_S)
    operator.log.info(
        "sparktorch_ops: deferring while the training %s runs detached in %s",
        handle.training_id,
        handle.run_dir,
    )
    operator.defer(
        trigger=TorchTrainingTrigger(handle.run_dir, deadline, try_number=context["ti"].try_number),
        method_name="execute_complete",
        timeout=timeout,
    )
    raise AssertionError("defer() returns only by raising TaskDeferred")


def ended_run(event: dict[str, Any]) -> Any:
    """The ended training's result (raising its error), from the trigger's event.

    Raises:
        AirflowTaskTimeout: the task's ``execution_timeout`` ended it.
    """
    if event.get("timed_out"):
        raise AirflowTaskTimeout(
            f"sparktorch_ops: the task's execution_timeout ran out while it was deferred; the "
            f"training in {event['run_dir']} was cancelled ({event.get('state')})"
        )
    return RunHandle(event["run_dir"]).result()
