"""A node's torchrun agent: ``torch.distributed.run`` itself, made to die with its parent.

The launcher (the driver in local mode, a barrier task otherwise) starts
``python -m sparktorch_ops.node.agent RUN_ID <torchrun arguments>``. This sets the parent-death
signal, exports its pid for the ranks' supervisors, and then runs torchrun's own ``main`` in
this process: the same launcher, rendezvous, restarts and error files as the ``torchrun``
command, plus a SIGTERM (torchrun's orderly shutdown of its workers) when the launcher vanishes.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, NoReturn

from sparktorch_ops.node.process import (
    die_with_parent,
    exit_status,
    finish_like_an_interpreter,
    start_parent_watchdog,
)
from sparktorch_ops.wire.env import (
    AGENT_PID_ENV,
    LAUNCHER_PID_ENV,
    NVML_CHECK_ADDED_ENV,
    NVML_CUDA_CHECK_ENV,
)


def main() -> None:
    """Entry point; ``sys.argv[1]`` is the run id (a marker in the process table)."""
    run(expected_parent=int(os.environ.get(LAUNCHER_PID_ENV, os.getppid())))


def run(expected_parent: int) -> NoReturn:
    """Be the agent for ``sys.argv[2:]`` (torchrun's arguments) and exit with its status.

    Args:
        expected_parent: the launcher, or the warm agent this process was forked from
            (:mod:`sparktorch_ops.node.forkserver`); this process dies with it.
    """
    die_with_parent(signal.SIGTERM, expected_parent)
    start_parent_watchdog(lambda: os.kill(os.getpid(), signal.SIGTERM))
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    if NVML_CUDA_CHECK_ENV not in os.environ:
        # torchrun calls torch.cuda.is_available() here; through NVML that leaves CUDA
        # uninitialised, so that the ranks forked from this process can still use it.
        os.environ[NVML_CUDA_CHECK_ENV] = "1"
        os.environ[NVML_CHECK_ADDED_ENV] = "1"
    from torch.distributed.run import main as torchrun_main

    _poll_rendezvous_sooner(sys.argv[2:])

    # Imported here so that every forked rank finds them (and torch) loaded already.
    from sparktorch_ops.rank.pickling import cloudpickle_module

    cloudpickle_module()

    import sparktorch_ops.rank.bootstrap  # noqa: F401

    status = 1
    try:
        torchrun_main(sys.argv[2:])
        status = 0
    except SystemExit as exc:
        status = exit_status(exc)
    except BaseException:
        sys.excepthook(*sys.exc_info())
    # The run is over: skip the interpreter's teardown of torch, which every run would wait for.
    finish_like_an_interpreter()
    os._exit(status)


# While they wait for each other, torchrun's agents re-read the rendezvous state at most once a
# second (a cached copy in between) and poll it every second, after a first join skewed by up
# to 0.3 s: that spares one store shared by hundreds of nodes, and costs a multi-node launch a
# second. A run's store serves its own few agents: scale all three to the number of nodes.
_NODES_FOR_TORCHRUN_PACE = 20


def _poll_rendezvous_sooner(torchrun_args: list[str]) -> None:
    """Scale torchrun's rendezvous polling to the run's number of nodes (0.1 s for 2, torchrun's
    own pace from 20): what it buys is about a second off every multi-node launch (the
    rendezvous of 2 nodes settles in a tenth of the time); a single node is left alone.

    torch has no setting for this pace, so this replaces two of its private names in this
    agent process only: ``dynamic_rendezvous._delay`` (the polls and the first join's skew)
    and ``_BackendRendezvousStateHolder.__init__`` (to shorten its ``_cache_duration``). A
    torch without them keeps its own pace (a launch a second slower, nothing else);
    ``tests/unit/test_warm.py`` fails when a torch release moves them, so that it is seen."""
    nnodes = next((a.split("=", 1)[1] for a in torchrun_args if a.startswith("--nnodes=")), "1")
    if not nnodes.isdigit() or int(nnodes) <= 1:
        return
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rendezvous

    delay = getattr(rendezvous, "_delay", None)
    holder = getattr(rendezvous, "_BackendRendezvousStateHolder", None)
    if delay is None or holder is None:
        return
    scale = min(1.0, int(nnodes) / _NODES_FOR_TORCHRUN_PACE)

    def scaled_delay(seconds: float | tuple[float, float]) -> None:
        if isinstance(seconds, tuple):
            delay(seconds=(seconds[0] * scale, seconds[1] * scale))
        else:
            delay(seconds=seconds * scale)

    holder_init = holder.__init__

    def init_with_shorter_cache(self: Any, *args: Any, **kwargs: Any) -> None:
        holder_init(self, *args, **kwargs)
        self._cache_duration = self._cache_duration * scale

    rendezvous._delay = scaled_delay
    holder.__init__ = init_with_shorter_cache


if __name__ == "__main__":
    main()
