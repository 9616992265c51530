"""TorchTrainingTrigger on a real detached run: it re-creates itself from what it serializes,
its ``on_kill`` stops the training naming its try, and the next try of a cleared task tells
that stop from its own (it starts the training over; the race itself runs under the real
scheduler in test_real_scheduler.py)."""

from __future__ import annotations

import asyncio
import importlib
import logging
import re
import time
from pathlib import Path
from typing import Any

import pytest

from harness.procs import wait_until_gone
from sparktorch_ops import TorchDistributor
from sparktorch_ops.airflow.deferred import (
    TorchTrainingTrigger,
    ended_run,
    stop_reason,
    stopped_for_an_earlier_try,
)
from sparktorch_ops.errors import TrainingCancelledError


def sleep_long() -> None:
    time.sleep(300)


async def _first_event(trigger: TorchTrainingTrigger) -> dict[str, Any]:
    async for event in trigger.run():
        return dict(event.payload)
    raise AssertionError("the trigger ended without an event")


def test_on_kill_stops_the_training_and_a_later_try_knows_it_was_not_its_own(
    tmp_path: Path,
) -> None:
    handle = TorchDistributor(
        num_processes=2, use_gpu=False, detached=True, run_dir=tmp_path / "run"
    ).submit(sleep_long)
    deadline = time.monotonic() + 120
    while handle.status().state != "running":
        assert time.monotonic() < deadline, handle.status()
        time.sleep(0.1)
    run_id = handle.events()[0]["run_id"]

    path, kwargs = TorchTrainingTrigger(handle.run_dir, try_number=1).serialize()
    module, name = path.rsplit(".", 1)
    trigger = getattr(importlib.import_module(module), name)(**kwargs)
    assert (trigger.run_dir, trigger.try_number) == (handle.run_dir, 1)

    asyncio.run(trigger.on_kill())
    event = asyncio.run(asyncio.wait_for(_first_event(trigger), 60))
    assert event == {"run_dir": handle.run_dir, "state": "cancelled", "timed_out": False}
    assert wait_until_gone(run_id, timeout=30) == []
    assert handle.directory.cancel_requested() == stop_reason(1)
    log = logging.getLogger("test_trigger")
    assert stopped_for_an_earlier_try(event, 2, log)  # a cleared task's try 2 starts it over
    assert not stopped_for_an_earlier_try(event, 1, log)  # try 1 was stopped: it fails
    with pytest.raises(TrainingCancelledError, match=re.escape(stop_reason(1))):
        ended_run(event)
