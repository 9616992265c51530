"""Line splitting and process-tree termination, with real processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil

from sparktorch_ops.node.process import MAX_LINE_BYTES, LineSplitter, terminate_tree


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


def _forked_child_report(code: str) -> dict[str, object]:
    """Run a ForkedChild in a fresh interpreter (forking pytest itself would copy its state)."""
    program = (
        "import json, os, signal, sys, time\n"
        "from sparktorch_ops.node.process import ForkedChild\n" + code
    )
    proc = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout.splitlines()[-1]))


def test_forked_child_pipes_its_output_and_reports_its_status() -> None:
    report = _forked_child_report(
        "def child():\n"
        "    print('to stdout', flush=True)\n"
        "    os.write(2, b'to stderr\\n')\n"
        "    return 7\n"
        "c = ForkedChild(child)\n"
        "out, err = c.stdout.read(), c.stderr.read()\n"
        "code = c.wait()\n"
        "def raising():\n"
        "    raise RuntimeError('boom')\n"
        "r = ForkedChild(raising)\n"
        "r_err = r.stderr.read()\n"
        "def sleeper():\n"
        "    time.sleep(60)\n"
        "    return 0\n"
        "s = ForkedChild(sleeper)\n"
        "s.send_signal(signal.SIGTERM)\n"
        "print(json.dumps({'out': out.decode(), 'err': err.decode(), 'code': code,\n"
        "                  'raised': r.wait(), 'raised_err': r_err.decode(),\n"
        "                  'signalled': s.wait(), 'after_reap': s.send_signal(9)}))\n"
    )
    assert report["out"] == "to stdout\n" and report["err"] == "to stderr\n"
    assert report["code"] == 7
    assert report["raised"] == 1 and "RuntimeError: boom" in str(report["raised_err"])
    assert report["signalled"] == -15


def test_forked_child_dies_with_its_parent() -> None:
    report = _forked_child_report(
        "r, w = os.pipe()\n"
        "middle = os.fork()\n"
        "if middle == 0:\n"
        "    def child():\n"
        "        time.sleep(120)\n"
        "        return 0\n"
        "    c = ForkedChild(child)\n"
        "    os.write(w, str(c.pid).encode())\n"
        "    time.sleep(0.5)\n"
        "    os._exit(0)  # the parent goes; the child must not outlive it\n"
        "grandchild = int(os.read(r, 64))\n"
        "os.waitpid(middle, 0)\n"
        "deadline = time.monotonic() + 30\n"
        "while time.monotonic() < deadline:\n"
        "    try:\n"
        "        os.kill(grandchild, 0)\n"
        "    except ProcessLookupError:\n"
        "        break\n"
        "    time.sleep(0.1)\n"
        "print(json.dumps({'gone': time.monotonic() < deadline}))\n"
    )
    assert report["gone"] is True
