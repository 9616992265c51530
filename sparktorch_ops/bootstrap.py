"""The program torchrun starts for each rank: it supervises the rank process.

torchrun runs this file in a child forked from the agent (``--run-path``), so ``torch`` is
already imported. It connects to the driver's channel, forks the rank process (or, where a fork
could not use CUDA, starts it as a fresh interpreter), which runs :mod:`sparktorch_ops.worker`
(the user's code) with its output piped, forwards every line of it to the driver, and reports
how it exited. The rank process dies with this one (``PR_SET_PDEATHSIG``), and this one stops it
when its own parent (torchrun's agent) dies or the driver closes the channel, so nothing
outlives the run. With ``--start-method=spawn`` in ``torchrun_args`` the supervisor itself is a
fresh interpreter.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from sparktorch_ops import channel, worker
from sparktorch_ops.messages import STDERR, STDOUT, ExitReport, Hello
from sparktorch_ops.planning import CHANNEL_ENV, NODE_HOST_ENV, TOKEN_ENV
from sparktorch_ops.process import (
    ForkedChild,
    die_with_parent,
    pump_lines,
    set_parent_death_signal,
    set_process_name,
    start_parent_watchdog,
)
from sparktorch_ops.results import signal_name

AGENT_PID_ENV = "SPARKTORCH_OPS_AGENT_PID"
_TERMINATE_GRACE_S = 5.0


def fork_keeps_cuda_usable() -> bool:
    """Whether a rank forked from this process could still use CUDA.

    torch refuses CUDA in a child forked after CUDA was initialised (it marks such children as
    bad forks). The agent and the supervisor leave CUDA alone, but a torchrun option such as
    ``--numa-binding``, or an availability check that cannot use NVML, initialises it.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return True
    return not (torch.cuda.is_initialized() or torch.cuda._is_in_bad_fork())


class Supervisor:
    """Runs one rank process and reports it to the driver."""

    def __init__(self, client: channel.ChannelClient) -> None:
        self.client = client
        self.child: ForkedChild | subprocess.Popen[bytes] | None = None
        self.finishing = False

    def start(self) -> None:
        """Fork the rank process, or start it as a fresh interpreter where a fork could not use
        CUDA (before this process starts any thread of its own: the fork must not race)."""

        def run_rank() -> int:
            self.client.release_in_child()
            return worker.run_forked()

        if fork_keeps_cuda_usable():
            self.child = ForkedChild(run_rank)
            return
        self.child = subprocess.Popen(
            [sys.executable, "-u", "-m", "sparktorch_ops.worker"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=lambda: set_parent_death_signal(signal.SIGKILL),
        )

    def stop_child(self, signum: int = signal.SIGTERM) -> None:
        """Signal the rank process; SIGKILL it if it is still there after the grace period."""
        child = self.child
        if child is None or child.poll() is not None:
            return
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            return

        def escalate() -> None:
            deadline = time.monotonic() + _TERMINATE_GRACE_S
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if child.poll() is None:
                child.kill()

        threading.Thread(target=escalate, daemon=True).start()

    def _forward(self, kind: int) -> Any:
        def emit(lines: list[str]) -> None:
            try:
                self.client.send(kind, "\n".join(lines).encode("utf-8", errors="replace"))
            except channel.ChannelError:
                self.stop_child(signal.SIGKILL)

        return emit

    def _on_driver_gone(self) -> None:
        self.client.wait_closed()
        if not self.finishing:
            self.stop_child(signal.SIGKILL)

    def run(self) -> int:
        """Supervise until the rank process exits; return its exit status for torchrun."""
        assert self.child is not None and self.child.stdout and self.child.stderr
        streams = ((self.child.stdout, STDOUT), (self.child.stderr, STDERR))
        pumps = [
            threading.Thread(target=pump_lines, args=(s, self._forward(k)), daemon=True)
            for s, k in streams
        ]
        for pump in pumps:
            pump.start()
        threading.Thread(target=self._on_driver_gone, daemon=True).start()
        returncode = self.child.wait()
        for pump in pumps:  # a grandchild may hold the pipes open: do not wait for it forever
            pump.join(timeout=5)
        self.finishing = True
        if returncode < 0:
            report = ExitReport(exit_code=None, signal=signal_name(-returncode), time=time.time())
        else:
            report = ExitReport(exit_code=returncode, signal=None, time=time.time())
        try:
            self.client.send_message(report)
        except channel.ChannelError:
            pass
        self.client.close()
        return returncode


def main() -> None:
    """Entry point (``sys.argv[1]`` is the run id, a marker for the process table).

    Returns normally when the rank succeeded: torchrun's ``--run-path`` mode takes a return, not
    ``sys.exit(0)``, as success.
    """
    agent_pid = int(os.environ.get(AGENT_PID_ENV, os.getppid()))
    die_with_parent(signal.SIGTERM, agent_pid)
    set_process_name(f"torch-sup-{os.environ['RANK']}")
    hello = Hello(
        role="supervisor",
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
        group_rank=int(os.environ.get("GROUP_RANK", "0")),
        host=os.environ.get(NODE_HOST_ENV, ""),
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        pid=os.getpid(),
    )
    client = channel.ChannelClient.connect(os.environ[CHANNEL_ENV], os.environ[TOKEN_ENV], hello)
    supervisor = Supervisor(client)
    supervisor.start()
    signal.signal(signal.SIGTERM, lambda signum, frame: supervisor.stop_child(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: supervisor.stop_child(signum))
    start_parent_watchdog(lambda: supervisor.stop_child(signal.SIGKILL))
    returncode = supervisor.run()
    if returncode < 0:  # die the way the rank died, so torchrun reports the same signal
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    if returncode != 0:
        sys.exit(returncode)


if __name__ == "__main__":
    main()
