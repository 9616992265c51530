"""Runs started from threads for the concurrency tests, and what their ranks run: each meets
the others through files in a shared directory, so a test that passes proves they overlapped
(no sleeps line them up)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.records import Collect

WAIT_S = 90.0  # a bound, only so that a broken test fails instead of hanging


def meet(directory: str, name: str, runs: int, lines: int) -> dict[str, Any]:
    """Say ``name`` started, wait until all ``runs`` have, print numbered lines."""
    Path(directory, f"{name}.started").write_text(str(time.time()))
    deadline = time.monotonic() + WAIT_S
    while len(list(Path(directory).glob("*.started"))) < runs:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: the other runs never started")
        time.sleep(0.02)
    for index in range(lines):
        print(f"{name} line {index}", flush=True)
    return {"name": name, "pid": os.getpid()}


def hold(directory: str, name: str) -> str:
    """Say ``name`` started (every rank), then keep the slots until ``name.release`` exists."""
    Path(directory, f"{name}.started.{os.environ['RANK']}").write_text(str(time.time()))
    deadline = time.monotonic() + WAIT_S
    while not Path(directory, f"{name}.release").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} was never released")
        time.sleep(0.02)
    return f"{name} released"


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Runs:
    """Runs started in threads; each one's outcome (value or exception) once it ends."""

    def __init__(self) -> None:
        self.threads: dict[str, threading.Thread] = {}
        self.outcomes: dict[str, Any] = {}

    def start(self, name: str, call: Callable[[], Any]) -> None:
        def target() -> None:
            try:
                self.outcomes[name] = call()
            except BaseException as exc:
                self.outcomes[name] = exc

        thread = threading.Thread(target=target, name=f"test-run-{name}", daemon=True)
        self.threads[name] = thread
        thread.start()

    def join(self) -> dict[str, Any]:
        for thread in self.threads.values():
            thread.join(WAIT_S * 2)
            assert not thread.is_alive(), f"{thread.name} is still running"
        return self.outcomes


def rank_lines(collect: Collect) -> list[str]:
    return [m.split("] ", 1)[1] for m in collect.messages() if m.startswith("[rank ")]
