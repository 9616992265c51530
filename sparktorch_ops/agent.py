"""A node's torchrun agent: ``torch.distributed.run`` itself, made to die with its parent.

The launcher (the driver in local mode, a barrier task otherwise) starts
``python -m sparktorch_ops.agent RUN_ID <torchrun arguments>``. This sets the parent-death
signal, exports its pid for the ranks' supervisors, and then runs torchrun's own ``main`` in
this process: the same launcher, rendezvous, restarts and error files as the ``torchrun``
command, plus a SIGTERM (torchrun's orderly shutdown of its workers) when the launcher vanishes.
"""

from __future__ import annotations

import os
import signal
import sys

from sparktorch_ops.bootstrap import AGENT_PID_ENV
from sparktorch_ops.planning import LAUNCHER_PID_ENV, NVML_CHECK_ADDED_ENV, NVML_CUDA_CHECK_ENV
from sparktorch_ops.process import (
    die_with_parent,
    exit_status,
    finish_like_an_interpreter,
    start_parent_watchdog,
)


def main() -> None:
    """Entry point; ``sys.argv[1]`` is the run id (a marker in the process table)."""
    launcher = int(os.environ.get(LAUNCHER_PID_ENV, os.getppid()))
    die_with_parent(signal.SIGTERM, launcher)
    start_parent_watchdog(lambda: os.kill(os.getpid(), signal.SIGTERM))
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    if NVML_CUDA_CHECK_ENV not in os.environ:
        # torchrun calls torch.cuda.is_available() here; through NVML that leaves CUDA
        # uninitialised, so that the ranks forked from this process can still use it.
        os.environ[NVML_CUDA_CHECK_ENV] = "1"
        os.environ[NVML_CHECK_ADDED_ENV] = "1"
    from torch.distributed.run import main as torchrun_main

    # Imported here so that every forked rank finds them (and torch) loaded already.
    import sparktorch_ops.bootstrap  # noqa: F401

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


if __name__ == "__main__":
    main()
