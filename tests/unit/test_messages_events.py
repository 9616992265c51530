"""Typed channel messages and the run's state machine."""

from __future__ import annotations

import logging

import pytest

from sparktorch_ops import events
from sparktorch_ops.events import InvalidTransition, PhaseEvent, RunState, RunStateMachine
from sparktorch_ops.wire.messages import (
    AgreeInStage,
    Arrived,
    ExitReport,
    FailureReport,
    Hello,
    MessageError,
    MetricReport,
    RendezvousPort,
    ResultEnd,
)


def test_messages_round_trip() -> None:
    for message in (
        MetricReport(step=3, time=1.5, values={"loss": 0.1, "tag": "a"}, progress=0.5),
        ExitReport(exit_code=None, signal="SIGKILL", time=2.0),
        FailureReport(type="ValueError", message="boom", traceback="tb", time=1.0),
        ResultEnd(size=10),
        RendezvousPort(port=29500),
        RendezvousPort(error="cannot bind"),
        Arrived(node=1),
        AgreeInStage(),
    ):
        assert type(message).decode(message.encode()) == message
    hello = Hello(role="supervisor", rank=2, local_rank=0, host="h", attempt=1, pid=5)
    assert Hello.from_dict(hello.to_dict()) == hello and hello.who == "rank 2"


@pytest.mark.parametrize(
    ("cls", "payload"),
    [
        (MetricReport, b"not json"),
        (MetricReport, b"[1, 2]"),
        (MetricReport, b'{"step": "3", "time": 1}'),
        (MetricReport, b'{"step": true, "time": 1}'),
        (MetricReport, b'{"step": 1, "time": 1, "values": {"x": [1]}}'),
        (MetricReport, b'{"step": 1, "time": 1, "progress": 2}'),
        (ExitReport, b'{"exit_code": "x", "time": 1}'),
        (ResultEnd, b'{"size": 1e400}'),
        (RendezvousPort, b'{"port": 70000}'),
        (RendezvousPort, b"{}"),
        (Arrived, b"{}"),
        (Arrived, b'{"node": "0"}'),
        (RendezvousPort, b"[" * 100000 + b"]" * 100000),
    ],
)
def test_malformed_messages_are_message_errors(cls: type, payload: bytes) -> None:
    with pytest.raises(MessageError):
        cls.decode(payload)


@pytest.mark.parametrize(
    "record",
    [
        {"rank": 1},
        {"role": "boss", "rank": 1},
        {"role": "worker"},
        {"role": "node"},
        {"role": "worker", "rank": -1},
        {"role": "worker", "rank": "1"},
        {"role": "worker", "rank": 1, "attempt": -2},
        ["role"],
    ],
)
def test_malformed_hellos_are_message_errors(record: object) -> None:
    with pytest.raises(MessageError):
        Hello.from_dict(record)


def test_state_machine_emits_each_transition_and_ends_once() -> None:
    seen: list[PhaseEvent] = []
    machine = RunStateMachine("r", seen.append, logging.getLogger("t"))
    machine.to(RunState.PREPARING)
    machine.emit(events.CHANNEL_OPEN, address="a:1")
    machine.to(RunState.STARTING)
    machine.emit(events.SUPERVISOR_CONNECTED, rank=1)
    machine.to(RunState.RUNNING)
    machine.to(RunState.RUNNING)  # no second event
    machine.finish(RunState.SUCCEEDED)
    machine.finish(RunState.FAILED)  # a final state is never left
    assert [e.name for e in seen] == [
        "preparing", "channel_open", "starting", "supervisor_connected", "running",
        "finishing", "succeeded",
    ]  # fmt: skip
    assert seen[3].rank == 1 and seen[1].detail == {"address": "a:1"}
    assert machine.state is RunState.SUCCEEDED and machine.state.final
    with pytest.raises(InvalidTransition):
        RunStateMachine("r", None, None).to(RunState.RUNNING)


def test_a_failing_hook_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    def hook(event: PhaseEvent) -> None:
        raise RuntimeError("hook bug")

    machine = RunStateMachine("r", hook, logging.getLogger("sparktorch_ops.test"))
    machine.to(RunState.PREPARING)
    assert "on_event hook raised" in caplog.text


def test_advance_moves_only_from_the_expected_state() -> None:
    machine = RunStateMachine("r", None, logging.getLogger("t"))
    machine.to(RunState.PREPARING)
    machine.to(RunState.STARTING)
    machine.to(RunState.FINISHING)  # the run's thread got there first
    assert not machine.advance(RunState.STARTING, RunState.RUNNING)
    assert machine.state is RunState.FINISHING
