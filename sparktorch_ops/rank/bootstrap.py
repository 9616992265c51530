"""The program torchrun starts for each rank: it supervises the rank process.

torchrun runs this file in a child forked from the agent (``--run-path``), so ``torch`` is
already imported. It connects to the driver's channel, forks the rank process (or, where a fork
could not use CUDA, starts it as a fresh interpreter), which runs :mod:`sparktorch_ops.rank.worker`
(the user's code) with its output piped, forwards every line of it to the driver, and reports
how it exited. The rank process dies with this one (``PR_SET_PDEATHSIG``), and this one stops it
when its own parent (torchrun's agent) dies or the driver closes the channel, so nothing
outlives the run. With ``--start-method=spawn`` in ``torchrun_args`` the supervisor itself is a
fresh interpreter.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

from sparktorch_ops.data import shards
from sparktorch_ops.node.process import (
    ForkedChild,
    die_with_parent,
    pump_lines,
    set_parent_death_signal,
    set_process_name,
    start_parent_watchdog,
)
from sparktorch_ops.rank import worker
from sparktorch_ops.rank.stacks import StackLine
from sparktorch_ops.results import OUTPUT_CUT_NOTE, signal_name
from sparktorch_ops.wire import channel
from sparktorch_ops.wire.env import (
    AGENT_PID_ENV,
    SECRET_FILE_ENV,
    STACK_FDS_ENV,
)
from sparktorch_ops.wire.messages import (
    STACK_REQUEST,
    STDERR,
    STDOUT,
    ExitReport,
    MessageError,
    RankStacks,
    StackRequest,
)

_TERMINATE_GRACE_S = 5.0
# After the rank exits, how long its output pipes may stay open (held by a process it started)
# before the supervisor stops reading them; the pumps look at the clock this often.
_PIPE_EOF_GRACE_S = 5.0
_PUMP_WAKE_S = 0.25
# What the rank left in a pipe is at most the pipe's size: more, read after the grace period,
# comes from a process it started that keeps writing.
_LATE_BYTES = 4 << 20


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

    def __init__(self, client: channel.ChannelClient, secret: str) -> None:
        self.client = client
        self._secret = secret
        self.child: ForkedChild | subprocess.Popen[bytes] | None = None
        self.finishing = False
        self._eof_deadline: float | None = None
        self._stack_line = StackLine(entry=worker.run_payload.__code__)

    def start(self) -> None:
        """Fork the rank process, or start it as a fresh interpreter where a fork could not use
        CUDA (before this process starts any thread of its own: the fork must not race)."""

        line = self._stack_line

        def run_rank() -> int:
            self.client.release_in_child()
            line.close_in_child()
            os.environ[STACK_FDS_ENV] = line.child_fds
            return worker.run_forked(self._secret)

        if fork_keeps_cuda_usable():
            self.child = ForkedChild(run_rank)
        else:
            self.child = subprocess.Popen(
                [sys.executable, "-u", "-m", "sparktorch_ops.rank.worker"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**os.environ, STACK_FDS_ENV: line.child_fds},
                pass_fds=line.pass_fds(),
                preexec_fn=lambda: set_parent_death_signal(signal.SIGKILL),
            )
        line.started()

    def stop_child(self, signum: int = signal.SIGTERM) -> None:
        """Signal the rank process; SIGKILL it if it is still there after the grace period."""
        child = self.child
        if child is None or child.poll() is not None:
            return
        try:
            child.send_signal(signum)
            child.send_signal(signal.SIGCONT)  # a stopped rank acts on the signal too
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

    def _serve_driver(self) -> None:
        """Answer the driver's stack requests until it closes the channel, which means "the
        run is over": then stop the rank (unless it is already finishing)."""
        while True:
            try:
                kind, payload = self.client.recv_frame()
            except channel.ChannelError:
                break
            if kind != STACK_REQUEST:
                continue
            try:
                request = StackRequest.decode(payload).request
            except MessageError:
                continue  # not a request we can answer; the watch on the driver goes on
            threading.Thread(target=self._send_stacks, args=(request,), daemon=True).start()
        self.client.closed = True
        if not self.finishing:
            self.stop_child(signal.SIGKILL)

    def _send_stacks(self, request: int) -> None:
        child = self.child
        assert child is not None
        stacks = self._stack_line.ask(child.send_signal)
        try:
            self.client.send_message(
                RankStacks(
                    request=request, text=stacks.text, where=stacks.where, source=stacks.source
                )
            )
        except channel.ChannelError:
            pass

    def _pump(self, stream: IO[bytes], kind: int) -> None:
        """Forward a stream of the rank line by line to its end (the pipe's EOF).

        Once the rank has exited, its pipe ends as soon as what it wrote is read, however long
        forwarding that takes; only a pipe that is still open but empty ``_PIPE_EOF_GRACE_S``
        after the exit (a process the rank started holds it) is given up on, and a line
        starting with ``OUTPUT_CUT_NOTE`` says so. So is one that such a process keeps filling.
        """
        emit = self._forward(kind)
        cut: list[bool] = []
        pump_lines(stream, emit, self._chunks(stream, cut))
        if cut:
            name = "stdout" if kind == STDOUT else "stderr"
            emit(
                [
                    f"{OUTPUT_CUT_NOTE}: the rank exited but a process it started still held "
                    f"its {name} open {_PIPE_EOF_GRACE_S:g} s later; the rest is not forwarded]"
                ]
            )

    def _chunks(self, stream: IO[bytes], cut: list[bool]) -> Iterator[bytes]:
        """The bytes of the rank's ``stream`` to its end, or until it is given up on (then
        ``cut`` holds True): empty and open, or still filling, past the grace after the exit."""
        fd = stream.fileno()
        late_bytes = 0
        while True:
            deadline = self._eof_deadline
            late = deadline is not None and time.monotonic() > deadline
            try:
                ready, _, _ = select.select([fd], [], [], 0 if late else _PUMP_WAKE_S)
                if not ready:
                    if late:
                        cut.append(True)
                        return
                    continue
                data = os.read(fd, 1 << 16)
            except OSError:
                return
            if not data:
                return
            if late:
                late_bytes += len(data)
            yield data
            if late and late_bytes > _LATE_BYTES:
                cut.append(True)
                return

    def run(self) -> int:
        """Supervise until the rank process exits; return its exit status for torchrun."""
        assert self.child is not None and self.child.stdout and self.child.stderr
        streams = ((self.child.stdout, STDOUT), (self.child.stderr, STDERR))
        pumps = [
            threading.Thread(target=self._pump, args=(stream, kind), daemon=True)
            for stream, kind in streams
        ]
        for pump in pumps:
            pump.start()
        threading.Thread(target=self._serve_driver, daemon=True).start()
        returncode = self.child.wait()
        # Everything the rank wrote is forwarded before its exit is reported; only a pipe that
        # a process it started holds open is given up on (see _pump).
        self._eof_deadline = time.monotonic() + _PIPE_EOF_GRACE_S
        for pump in pumps:
            pump.join()
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
    # DataFrame input still being written: the rank's clock starts once it has its rows.
    shards.wait_for_epoch_rows(os.environ)
    secret = channel.read_secret_file(os.environ[SECRET_FILE_ENV])
    client = worker.connect(
        "supervisor",
        secret,
        local_rank=int(os.environ["LOCAL_RANK"]),
        group_rank=int(os.environ.get("GROUP_RANK", "0")),
    )
    supervisor = Supervisor(client, secret)
    supervisor.start()
    signal.signal(signal.SIGTERM, lambda signum, frame: supervisor.stop_child(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: supervisor.stop_child(signum))
    start_parent_watchdog(lambda: supervisor.stop_child(signal.SIGKILL))
    returncode = supervisor.run()
    # The rank is gone: nothing is left to stop. A successful return makes torch's worker
    # process wait until the agent has read the result; when the agent tears the group down
    # instead (another rank failed, a restart), its SIGTERM must end this process, not wait
    # out torch's 30 s shutdown grace in our handler.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if returncode < 0:  # die the way the rank died, so torchrun reports the same signal
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    if returncode != 0:
        sys.exit(returncode)


if __name__ == "__main__":
    main()
