"""Line splitting and process-tree termination, with real processes."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from sparktorch_ops.process import MAX_LINE_BYTES, LineSplitter, terminate_tree


def test_invalid_utf8_is_replaced_not_fatal() -> None:
    splitter = LineSplitter()
    assert splitter.feed(b"ok \xff\xfe end\n") == ["ok \ufffd\ufffd end"]


def test_lines_split_across_reads_and_final_partial_line() -> None:
    splitter = LineSplitter()
    assert splitter.feed(b"hel") == []
    assert splitter.feed(b"lo\nwor") == ["hello"]
    assert splitter.finish() == ["wor"]


def test_carriage_return_redraws_collapse_to_the_latest_state() -> None:
    now = [0.0]
    splitter = LineSplitter(clock=lambda: now[0])
    lines = []
    for pct in range(0, 101, 10):
        lines += splitter.feed(f"\r{pct:3d}%|{'#' * (pct // 10)}".encode())
    lines += splitter.feed(b"\n")
    assert lines == ["100%|##########"]


def test_long_running_progress_bar_is_shown_periodically() -> None:
    now = [0.0]
    splitter = LineSplitter(clock=lambda: now[0])
    shown = []
    for step in range(20):
        now[0] = step * 1.0
        shown += splitter.feed(f"\rstep {step}".encode())
    assert shown == ["step 5", "step 10", "step 15"]


def test_windows_line_endings_and_huge_lines() -> None:
    splitter = LineSplitter()
    assert splitter.feed(b"a\r\nb\r\n") == ["a", "b"]
    big = b"x" * (MAX_LINE_BYTES + 10)
    pieces = splitter.feed(big)
    assert [len(p) for p in pieces] == [MAX_LINE_BYTES]
    assert splitter.finish() == ["x" * 10]


def test_terminate_tree_kills_children_in_other_sessions() -> None:
    # The child starts a grandchild in a new session (as torchrun does) and ignores SIGTERM.
    script = (
        "import subprocess, sys, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
        "print('ready', flush=True)\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert len(tree) == 2
    started = time.monotonic()
    terminate_tree(proc.pid, grace=1.0)
    proc.wait(timeout=10)
    assert time.monotonic() - started < 30
    for pid in tree:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    terminate_tree(proc.pid, grace=1.0)  # idempotent
