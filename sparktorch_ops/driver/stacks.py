"""Where every rank is: its Python stacks, asked for over the channel.

:func:`capture_stacks` asks each rank's supervisor (see :mod:`sparktorch_ops.rank.stacks`) and
waits at most :data:`CAPTURE_S` for the answers: a stalled run reports them in its error, any
other stop (timeout, cancel, an orchestrator's kill, Ctrl-C) logs them before the teardown, and
``TorchDistributor.stacks()`` returns them for a run in progress. Each rank's text starts with
one line saying where its training thread is (``in fn (train.py:40) <- time.sleep(60)``).
"""

from __future__ import annotations

import time

from sparktorch_ops.driver.collector import RunCollector
from sparktorch_ops.wire.channel import ChannelServer
from sparktorch_ops.wire.messages import StackRequest

#: How long a capture waits for the ranks: Airflow gives a killed task 5 s before SIGKILL,
#: and the teardown needs the rest.
CAPTURE_S = 2.0
_POLL_S = 0.02


def capture_stacks(
    server: ChannelServer,
    collector: RunCollector,
    num_processes: int,
    *,
    log: bool,
    timeout: float = CAPTURE_S,
) -> dict[int, str]:
    """Every rank's stacks, by rank: ``where`` on the first line, then every thread's stack.

    A rank that does not answer within ``timeout``, or has no supervisor connected, gets one
    line saying so. With ``log``, each answer goes to the run's log as it arrives. Empty when
    no supervisor is connected at all (none started yet, or the tasks relay their ranks'
    frames with their result, over Spark Connect).
    """
    supervisors = collector.supervisors()
    if not supervisors:
        return {}
    request = collector.stacks.open(log)
    try:
        message = StackRequest(request=request)
        for conn_id in supervisors.values():
            server.send(conn_id, message)
        deadline = time.monotonic() + timeout
        while len(collector.stacks.answers(request)) < len(supervisors):
            if time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
        answers = collector.stacks.answers(request)
    finally:
        collector.stacks.close(request)
    stacks: dict[int, str] = {}
    for rank in sorted(set(range(num_processes)) | set(supervisors)):
        answer = answers.get(rank)
        if answer is not None:
            stacks[rank] = f"{answer.where}\n{answer.text}"
        elif rank in supervisors:
            stacks[rank] = f"did not answer within {timeout:g} s"
        else:
            state = collector.ranks.states.get(rank)
            if state is not None and state.exited:
                how = state.signal or f"code {state.exit_code}"
                stacks[rank] = f"exited ({how}) before it was asked"
            else:
                stacks[rank] = "never connected: no supervisor to ask"
    return stacks
