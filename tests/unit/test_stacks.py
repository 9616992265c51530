"""Where a rank's threads are: the rank's helper thread, faulthandler when the helper cannot
run, nothing from a stopped process; and the driver's bookkeeping of silence and answers."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sparktorch_ops import RankFailure, TrainingCancelledError, TrainingStalledError
from sparktorch_ops.errors import TrainingTimeoutError
from sparktorch_ops.rank import stacks
from sparktorch_ops.wire.env import STACK_FDS_ENV
from sparktorch_ops.wire.messages import STACKS, MessageError, RankStacks, StackRequest
from tests.unit.test_collector import collector, peer

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for a rank process: serves stack requests, then does what argv[1] says.
RANK = """\
import os, re, signal, sys, time
from sparktorch_ops.rank import stacks

def napping_in_the_data_loader():
    time.sleep(600)

def holding_the_gil():
    re.fullmatch(r"(a|aa)+$", "a" * 60 + "b")  # hours in C, never releasing the GIL

stacks.serve(os.environ["SPARKTORCH_OPS_STACK_FDS"])
print("ready", flush=True)
if sys.argv[1] == "sleep":
    napping_in_the_data_loader()
elif sys.argv[1] == "gil":
    holding_the_gil()
else:
    os.kill(os.getpid(), signal.SIGSTOP)
"""


def rank_process(mode: str, directory: Path) -> tuple[subprocess.Popen[str], stacks.StackLine]:
    script = directory / "rank.py"
    script.write_text(RANK)
    line = stacks.StackLine()
    proc = subprocess.Popen(
        [sys.executable, str(script), mode],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, STACK_FDS_ENV: line.child_fds},
        pass_fds=line.pass_fds(),
    )
    line.started()
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    time.sleep(0.3)  # into the function that never returns
    return proc, line


@pytest.mark.parametrize(
    ("mode", "source", "where"),
    [
        ("sleep", "threads", "in napping_in_the_data_loader (rank.py:5) <- time.sleep(600)"),
        ("gil", "faulthandler", "in fullmatch ("),
        ("stop", "none", "did not answer within 1.8 s"),
    ],
)
def test_a_rank_answers_through_its_helper_else_faulthandler_else_is_named(
    mode: str, source: str, where: str, tmp_path: Path
) -> None:
    proc, line = rank_process(mode, tmp_path)
    try:
        started = time.monotonic()
        answer = line.ask(proc.send_signal)
        took = time.monotonic() - started
    finally:
        proc.kill()
        proc.wait()
    assert answer.source == source, answer
    assert answer.where.startswith(where), answer.where
    assert took < 10, f"asking took {took:.1f} s"  # bounded, never a hang
    if mode == "gil":  # the training thread first, with the function that called into C
        assert answer.text.index("Current thread") < answer.text.index("Thread 0x")
        assert "holding_the_gil" in answer.text


def sleeping_in_a_named_function(stop: threading.Event) -> None:
    stop.wait(60)


def test_format_threads_puts_the_main_thread_first_and_skips_the_asker() -> None:
    stop = threading.Event()
    other = threading.Thread(target=sleeping_in_a_named_function, args=(stop,), name="loader")
    other.start()
    try:
        taken = stacks.format_threads(skip=None)
    finally:
        stop.set()
        other.join()
    assert taken.text.startswith("Thread MainThread (most recent call last):")
    assert "Thread loader (most recent call last):" in taken.text
    assert "sleeping_in_a_named_function" in taken.text
    assert taken.where.startswith("in format_threads (stacks.py:")
    mine = stacks.format_threads(skip=threading.main_thread().ident)
    assert "MainThread" not in mine.text


def test_where_in_a_dump_is_its_first_threads_innermost_frame() -> None:
    dump = (
        'Thread 0x01 (most recent call first):\n  File "/x/threading.py", line 320 in wait\n\n'
        'Current thread 0x02 (most recent call first):\n  File "/x/train.py", line 40 in load\n'
        '  File "/x/worker.py", line 68 in run_payload\n  File "/x/runpy.py", line 9 in run\n'
    )
    tidy = stacks.tidy_dump(dump)
    assert tidy.startswith("Current thread 0x02") and stacks.where_in_dump(tidy) == (
        "in load (train.py:40)"
    )


def test_the_collector_times_each_ranks_silence_from_its_connection() -> None:
    runs = collector()
    assert runs.status().silent == {}
    runs.on_hello(peer(1, 0))
    runs.on_hello(peer(2, 1))
    time.sleep(0.2)
    runs.on_frame(peer(1, 0), 2, b"a line")  # stdout of rank 0: progress
    silent = runs.status().silent
    assert silent[1] >= 0.2 > silent[0]
    runs.on_frame(peer(1, 0), 7, b'{"exit_code": 0, "signal": null, "time": 0}')
    assert list(runs.status().silent) == [1]  # an exited rank is not silent


def test_answers_are_matched_to_their_request_and_logged_when_asked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs = collector()
    assert runs.capture_stacks(lambda conn_id, message: None, 2, log=False) == {}
    for rank in range(3):
        runs.on_hello(peer(rank + 1, rank))
    runs.on_frame(peer(3, 2), 7, b'{"exit_code": null, "signal": "SIGKILL", "time": 0}')
    runs.on_closed(peer(3, 2))

    def answer(request: int) -> bytes:
        return RankStacks(request, "Thread MainThread ...", "in f (t.py:1)", "threads").encode()

    sent: list[tuple[int, int]] = []

    def send(conn_id: int, message: StackRequest) -> None:
        sent.append((conn_id, message.request))
        if conn_id == 1:  # rank 0's supervisor answers; rank 1's never does
            runs.on_frame(peer(1, 0), STACKS, answer(99))  # no such request: dropped
            runs.on_frame(peer(1, 0), STACKS, answer(message.request))

    with caplog.at_level(logging.WARNING, logger="test.collector"):
        quiet = runs.capture_stacks(send, 4, log=False, timeout=0.1)
        logged = runs.capture_stacks(send, 4, log=True, timeout=0.1)
    assert (
        quiet
        == logged
        == {
            0: "in f (t.py:1)\nThread MainThread ...",
            1: "did not answer within 0.1 s",
            2: "exited (SIGKILL) before it was asked",
            3: "never connected: no supervisor to ask",
        }
    )
    assert sorted(sent) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert [r.getMessage().split("\n")[0] for r in caplog.records] == [
        "sparktorch_ops: rank 0 is in f (t.py:1) (stacks taken by its helper thread):"
    ]
    with pytest.raises(MessageError, match="source"):
        RankStacks.decode(RankStacks(1, "", "", "guess").encode())


def test_stop_errors_say_where_the_ranks_were_and_survive_pickling() -> None:
    where = {0: "in all_reduce (c10d.py:9)\nThread MainThread ...", 1: "did not answer"}
    silent = [
        RankFailure(1, "h", None, None, "silent for 6.0 s, did not answer", "", 1.0),
        RankFailure(0, "h", None, None, "silent for 5.5 s, in all_reduce (c10d.py:9)", "", 1.5),
    ]
    errors = [
        TrainingStalledError(silent, 5.0, {1: 6.0, 0: 5.5}, where),
        TrainingCancelledError("cancel() was called").with_stacks(where),
        TrainingTimeoutError("timeout", 10.0).with_stacks(where),
    ]
    for error in errors:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
        assert copy.stacks == where
    assert str(errors[0]).startswith("training stalled: no rank showed progress")
    assert "  rank 0 silent for 5.5 s, in all_reduce (c10d.py:9)\n" in str(errors[0])
    assert "--- stacks of rank 0 ---\nThread MainThread ..." in str(errors[0])
    assert errors[0].first_failure is not None and errors[0].first_failure.rank == 1
    for stopped in errors[1:]:
        assert "where the ranks were when it was stopped:" in str(stopped)
        assert "  rank 0 in all_reduce (c10d.py:9)\n  rank 1 did not answer" in str(stopped)


def test_a_supervisor_ignores_a_malformed_stack_request_and_keeps_watching() -> None:
    """A request it cannot read does not end the thread that stops the rank when the driver
    goes; the driver's hang-up still does."""
    import socket

    from sparktorch_ops.rank.bootstrap import Supervisor
    from sparktorch_ops.wire import channel
    from sparktorch_ops.wire.messages import STACK_REQUEST

    driver, rank_side = socket.socketpair()
    supervisor = Supervisor(channel.ChannelClient(rank_side), "secret")
    stopped: list[int] = []
    supervisor.stop_child = stopped.append  # type: ignore[method-assign, assignment]
    driver.sendall(channel.encode_frame(STACK_REQUEST, b"not json"))
    driver.close()
    supervisor._serve_driver()  # returns on the hang-up; raised on the bad request before
    assert supervisor.client.closed and stopped == [signal.SIGKILL]
