"""The channel over real sockets: authentication, framing, large payloads, dropped clients."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

from sparktorch_ops import channel, messages
from sparktorch_ops.errors import ChannelError
from sparktorch_ops.messages import Hello


class Recorder(channel.ChannelHandler):
    def __init__(self) -> None:
        self.hellos: list[Hello] = []
        self.frames: list[tuple[int, bytes]] = []
        self.closed = 0
        self.lock = threading.Lock()

    def on_hello(self, peer: channel.Peer) -> None:
        self.hellos.append(peer.hello)

    def on_frame(self, peer: channel.Peer, kind: int, payload: bytes) -> None:
        with self.lock:
            self.frames.append((kind, payload))

    def on_closed(self, peer: channel.Peer) -> None:
        self.closed += 1


@pytest.fixture
def server(caplog: pytest.LogCaptureFixture):  # type: ignore[no-untyped-def]
    recorder = Recorder()
    srv = channel.ChannelServer("127.0.0.1", recorder, logging.getLogger("test.channel"), "s3cret")
    yield srv, recorder
    srv.close()


def _wait(condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_authenticated_client_frames_arrive_in_order(server) -> None:  # type: ignore[no-untyped-def]
    srv, recorder = server
    client = channel.ChannelClient.connect(srv.address, "s3cret", Hello(role="worker", rank=3))
    for i in range(1000):
        client.send(messages.STDOUT, f"line {i}".encode())
    client.close()
    _wait(lambda: recorder.closed == 1)
    assert recorder.hellos == [Hello(role="worker", rank=3)]
    assert [p.decode() for _, p in recorder.frames] == [f"line {i}" for i in range(1000)]


def test_wrong_token_is_dropped_and_cannot_inject(server, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    srv, recorder = server
    caplog.set_level(logging.WARNING, logger="test.channel")
    intruder = channel.ChannelClient.connect(srv.address, "wrong", Hello(role="worker", rank=0))
    try:
        for _ in range(50):
            intruder.send(messages.STDOUT, b"injected")
            time.sleep(0.01)
    except ChannelError:
        pass  # the server closed the connection: exactly what should happen
    _wait(lambda: "wrong token" in caplog.text)
    assert recorder.frames == [] and recorder.hellos == []


def test_garbage_before_hello_is_dropped(server, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    srv, recorder = server
    caplog.set_level(logging.WARNING, logger="test.channel")
    host, port = channel.split_address(srv.address)
    with socket.create_connection((host, port)) as sock:
        sock.sendall(channel.encode_frame(messages.STDOUT, b"no hello"))
        _wait(lambda: "valid HELLO" in caplog.text)
        assert sock.recv(10) == b""  # closed by the server
    assert recorder.frames == []


def test_large_result_arrives_whole(server) -> None:  # type: ignore[no-untyped-def]
    srv, recorder = server
    data = bytes(range(256)) * (40 * 4096)  # 40 MiB, several chunks
    client = channel.ChannelClient.connect(srv.address, "s3cret", Hello(role="worker", rank=0))
    client.send_result(data)
    client.close()
    _wait(lambda: recorder.closed == 1, timeout=60)
    chunks = b"".join(p for k, p in recorder.frames if k == messages.RESULT_CHUNK)
    end = [json.loads(p) for k, p in recorder.frames if k == messages.RESULT_END]
    assert chunks == data and end == [{"size": len(data)}]


def test_closing_the_server_ends_clients_wait(server) -> None:  # type: ignore[no-untyped-def]
    srv, _ = server
    client = channel.ChannelClient.connect(srv.address, "s3cret", Hello(role="node", node=0))
    waiter = threading.Thread(target=client.wait_closed)
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()
    srv.close()
    waiter.join(10)
    assert not waiter.is_alive() and client.closed


def test_unreachable_driver_is_a_channel_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ChannelError, match="cannot reach"):
        channel.ChannelClient.connect(f"127.0.0.1:{port}", "t", {}, timeout=2)


def test_address_helpers_handle_ipv6() -> None:
    assert channel.join_address("::1", 80) == "[::1]:80"
    assert channel.split_address("[::1]:80") == ("::1", 80)
    assert channel.split_address("10.0.0.1:5") == ("10.0.0.1", 5)
