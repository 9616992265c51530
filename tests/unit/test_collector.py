"""The driver's bookkeeping, fed with frames as the channel would deliver them."""

from __future__ import annotations

import json
import logging

import pytest

from sparktorch_ops.driver.collector import RunCollector
from sparktorch_ops.driver.collector.output import SCRIPT_OUTPUT_CAP
from sparktorch_ops.driver.collector.result import ResultBytes
from sparktorch_ops.wire import channel, messages
from sparktorch_ops.wire.messages import Hello, Notice


def peer(conn_id: int, rank: int, role: str = "supervisor", attempt: int = 0) -> channel.Peer:
    hello = Hello(role=role, rank=rank, host=f"h{rank}", attempt=attempt)
    return channel.Peer(conn_id=conn_id, hello=hello, address="127.0.0.1:1")


def collector(max_restarts: int = 0, script: bool = False) -> RunCollector:
    return RunCollector(
        logging.getLogger("test.collector"),
        log_ranks=None,
        on_metrics=None,
        max_restarts=max_restarts,
        keep_rank0_stdout=script,
    )


def exit_frame(code: int | None, signal: str | None = None) -> bytes:
    return json.dumps({"exit_code": code, "signal": signal, "time": 0}).encode()


def test_first_failure_is_the_root_cause_and_fatal_without_restarts() -> None:
    c = collector()
    for rank in (0, 1):
        c.on_hello(peer(rank, rank))
    c.on_frame(peer(1, 1), messages.EXIT, exit_frame(3))
    c.on_frame(peer(0, 0), messages.EXIT, exit_frame(None, "SIGTERM"))
    assert c.status().fatal
    failures = c.failures()
    assert [(f.rank, f.exit_code, f.signal) for f in failures] == [
        (1, 3, None),
        (0, None, "SIGTERM"),
    ]


def test_failures_before_the_last_restart_are_not_fatal() -> None:
    c = collector(max_restarts=1)
    c.on_hello(peer(1, 1))
    c.on_frame(peer(1, 1), messages.EXIT, exit_frame(1))
    status = c.status()
    assert [f.rank for f in c.failures()] == [1] and status.failed and not status.fatal
    c.on_hello(peer(2, 1, attempt=1))  # torchrun restarted the group
    status = c.status()
    assert c.failures() == [] and not status.failed and not status.fatal
    c.on_frame(peer(2, 1, attempt=1), messages.EXIT, exit_frame(1))
    assert c.status().fatal


def test_a_vanished_rank_is_a_failure() -> None:
    c = collector()
    c.on_hello(peer(7, 0))
    c.on_closed(peer(7, 0))
    status = c.status()
    assert status.fatal and status.lost and status.lost_ranks == {0: "h0"}
    assert c.failures()[0].reason.startswith("the rank's process vanished")


def test_a_truncated_result_is_not_a_result() -> None:
    c = collector()
    c.on_hello(peer(1, 0, role="worker"))
    c.on_frame(peer(1, 0, role="worker"), messages.RESULT_CHUNK, b"abc")
    c.on_frame(peer(1, 0, role="worker"), messages.RESULT_END, b'{"size": 4}')
    assert c.result.value is None
    c.on_frame(peer(1, 0, role="worker"), messages.RESULT_CHUNK, b"abcd")
    c.on_frame(peer(1, 0, role="worker"), messages.RESULT_END, b'{"size": 4}')
    assert c.result.value is not None and c.result.value.reader().read() == b"abcd"


def test_result_bytes_are_read_across_chunks_and_released_as_read() -> None:
    import pickle

    value = {"blob": bytes(range(256)) * 5000, "n": 7}
    data = pickle.dumps(value, protocol=5)
    chunks = [data[i : i + 1000] for i in range(0, len(data), 1000)]
    result = ResultBytes(chunks)
    assert result.size == len(data)
    reader = result.reader()
    assert pickle.load(reader) == value
    assert reader.read() == b"" and not result._chunks


def test_script_output_is_capped_to_its_tail_with_a_note() -> None:
    c = collector(script=True)
    c.on_hello(peer(1, 0))
    line = "y" * 1023
    for _ in range(SCRIPT_OUTPUT_CAP // 1024 + 10):
        c.on_frame(peer(1, 0), messages.STDOUT, line.encode())
    c.on_frame(peer(1, 0), messages.STDOUT, b"the last line")
    text = c.stdout.text()
    assert c.stdout.truncated
    assert text.startswith("[sparktorch_ops: output cut to its last")
    assert text.endswith("the last line\n")
    assert len(text) <= SCRIPT_OUTPUT_CAP + 200


def test_a_notice_is_logged_at_its_own_level_and_kept_in_the_ranks_tail(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Our rank-side lines (a checkpoint resumed, a fresh start) are not the rank's stderr:
    they reach the log at the level they were sent with."""
    c = collector()
    c.on_hello(peer(1, 0))  # the rank's supervisor, then the rank itself
    c.on_hello(peer(2, 0, role="worker"))
    text = "sparktorch_ops.checkpoint: no checkpoint under /x: starting fresh"
    with caplog.at_level(logging.DEBUG, logger="test.collector"):
        c.on_frame(peer(2, 0, role="worker"), messages.NOTICE, Notice(20, text).encode())
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"[rank 0|h0] {text}")
    ]
    assert c.outputs()[0] == text
    with pytest.raises(messages.MessageError, match="logging level"):
        Notice.decode(Notice(25, text).encode())
