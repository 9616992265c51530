"""Spark Connect pieces that need no server: URLs, slots, channel_host, the relay and replay."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from sparktorch_ops.errors import ConfigError
from sparktorch_ops.node.relay import CLOSED_RECORD, HELLO_RECORD, Relay, RelayedFrame, Replayer
from sparktorch_ops.node.task import TaskReport, stage_row_item, stage_rows
from sparktorch_ops.spark.preflight import check_connect_client, known_slots
from sparktorch_ops.spark.session import parse_master, redact_connect_url
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire import channel
from sparktorch_ops.wire.messages import (
    EXIT,
    STDOUT,
    DataLayout,
    ExitReport,
    Hello,
)


@pytest.mark.parametrize(
    "url",
    ["sc://localhost", "sc://h:15002", "sc://h:15002/", "sc://h:1/;token=abc;use_ssl=true"],
)
def test_connect_urls_are_masters(url: str) -> None:
    master = parse_master(url)
    assert master.is_connect and not master.in_process and master.url == url


@pytest.mark.parametrize("url", ["sc://", "sc:// h", "sc://h:1/path"])
def test_bad_connect_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="sc://HOST:PORT"):
        parse_master(url)


def test_tokens_are_hidden_in_logged_urls() -> None:
    url = "sc://h:1/;user_id=me;token=s3cr3t;use_ssl=true"
    assert redact_connect_url(url) == "sc://h:1/;user_id=me;token=***;use_ssl=true"


class FakeConnectSession:
    """Only what known_slots reads: the server's conf."""

    def __init__(self, conf: dict[str, str]) -> None:
        self.conf = self
        self._values = conf

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)


FakeConnectSession.__module__ = "pyspark.sql.connect.session"


@pytest.mark.parametrize(
    ("conf", "slots"),
    [
        ({"spark.master": "local[2]"}, 2),
        ({"spark.master": "local"}, 1),
        ({"spark.master": "local[4]", "spark.task.cpus": "2"}, 2),
        ({"spark.master": "local-cluster[2,3,1024]"}, 6),
        ({"spark.master": "local[*]"}, None),
        ({"spark.master": "spark://head:7077"}, None),
        ({"spark.master": "k8s://https://api:6443"}, None),
        ({}, None),
    ],
)
def test_slots_known_only_where_the_master_fixes_them(
    conf: dict[str, str], slots: int | None
) -> None:
    assert known_slots(FakeConnectSession(conf)) == slots


@pytest.mark.parametrize("host", ["10.1.2.3", "client.example.com", "::1", "[fe80::1]"])
def test_channel_host_takes_a_host(host: str) -> None:
    assert LaunchSpec(channel_host=host).channel_host == host.strip("[]")


@pytest.mark.parametrize("host", ["", " ", "h:8080", "http://h", "a b", 7])
def test_channel_host_refuses_what_is_not_a_host(host: object) -> None:
    with pytest.raises(ConfigError) as info:
        LaunchSpec(channel_host=host)  # type: ignore[arg-type]
    assert info.value.argument == "channel_host"


def test_layout_of_shards_is_the_largest_or_names_empty_tasks() -> None:
    assert DataLayout.for_shards({0: [3, 4], 1: [4, 4]}).epoch_rows == 4
    error = DataLayout.for_shards({0: [3, 0], 1: [2, 2], 2: [0, 1]}).error
    assert error is not None and error.startswith("task 0, task 2 got no rows")


class Recorder(channel.ChannelHandler):
    def __init__(self) -> None:
        self.events: list[tuple[str, int, Any]] = []

    def on_hello(self, peer: channel.Peer) -> None:
        self.events.append(("hello", peer.conn_id, peer.hello.rank))

    def on_frame(self, peer: channel.Peer, kind: int, payload: bytes | bytearray) -> None:
        self.events.append(("frame", peer.conn_id, (kind, bytes(payload))))

    def on_closed(self, peer: channel.Peer) -> None:
        self.events.append(("closed", peer.conn_id, peer.hello.rank))


SECRET = "ab" * 32


def test_a_relay_records_what_clients_send_and_replays_it(tmp_path: Any) -> None:
    relay = Relay(SECRET, str(tmp_path / "frames"))
    clients = []
    for rank in (0, 1):
        hello = Hello(role="supervisor", rank=rank, host="h", attempt=0, pid=1)
        clients.append(channel.ChannelClient.connect(relay.address, SECRET, hello))
    clients[1].send(STDOUT, b"line from rank 1")
    clients[0].send_message(ExitReport(exit_code=0, time=1.0))
    for client in clients:
        client.close()
    relay.close()
    frames = list(relay.frames())
    kinds = [frame.kind for frame in frames]
    assert kinds.count(HELLO_RECORD) == 2 and kinds.count(CLOSED_RECORD) == 2
    assert [f.time for f in frames] == sorted(f.time for f in frames)

    recorder = Recorder()
    replayer = Replayer(recorder)
    for frame in frames:
        replayer.feed(3, frame, "10.0.0.3")
    replayer.finish()
    assert recorder.events[0][0] == "hello" and recorder.events[-1][0] == "closed"
    assert all(conn_id < 0 for _, conn_id, _ in recorder.events)  # apart from live ids
    assert ("frame", _conn(recorder, 1), (STDOUT, b"line from rank 1")) in recorder.events
    assert any(e[0] == "frame" and e[2][0] == EXIT for e in recorder.events)


def _conn(recorder: Recorder, rank: int) -> int:
    return next(conn for kind, conn, r in recorder.events if kind == "hello" and r == rank)


def test_a_relay_refuses_a_client_without_the_secret(tmp_path: Any) -> None:
    relay = Relay(SECRET, str(tmp_path / "frames"))
    hello = Hello(role="supervisor", rank=0, host="h", attempt=0, pid=1)
    with pytest.raises(channel.ChannelError, match="did not accept"):
        channel.ChannelClient.connect(relay.address, "cd" * 32, hello, timeout=3)
    relay.close()
    assert list(relay.frames()) == []


def test_replay_closes_connections_whose_hang_up_was_not_recorded() -> None:
    hello = b'{"role": "supervisor", "rank": 0, "host": "h"}'
    recorder = Recorder()
    replayer = Replayer(recorder)
    replayer.feed(0, RelayedFrame(0, HELLO_RECORD, hello, 1.0), "h")
    replayer.feed(0, RelayedFrame(7, STDOUT, b"from nobody", 2.0), "h")  # no hello: dropped
    replayer.finish()
    assert [e[0] for e in recorder.events] == ["hello", "closed"]


def test_stage_rows_carry_the_report_then_the_frames() -> None:
    def task(batches: Any) -> Any:
        yield TaskReport(1, "h1", 0, unreachable="refused")
        yield RelayedFrame(4, STDOUT, b"x" * 10, 5.0)

    rows = [row for batch in stage_rows(task)([]) for row in batch.to_pylist()]  # type: ignore[arg-type]
    items = [stage_row_item(row) for row in rows]
    assert items[0] == (1, TaskReport(1, "h1", 0, None, "refused"))
    assert items[1] == (1, RelayedFrame(4, STDOUT, b"x" * 10, 5.0))


def test_closing_a_relay_with_no_client_returns_at_once(tmp_path: Any) -> None:
    relay = Relay(SECRET, str(tmp_path / "frames"))
    thread = threading.Thread(target=relay.close)
    thread.start()
    thread.join(5)
    assert not thread.is_alive()
    assert list(relay.frames()) == []


@pytest.mark.parametrize("version", ["3.5.9", "3.4.1", "dev"])
def test_a_connect_client_older_than_pyspark_4_is_a_config_error_naming_its_version(
    version: str,
) -> None:
    with pytest.raises(ConfigError, match=r"pyspark 4\.0 or later") as info:
        check_connect_client(version)
    assert info.value.argument == "spark" and f"pyspark {version}" in str(info.value)
    for supported in ("4.0.5", "4.3.0", "4.1.0.dev1"):
        check_connect_client(supported)
