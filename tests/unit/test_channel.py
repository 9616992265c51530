"""The channel over real sockets: authentication, framing, large payloads, dropped clients."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

from sparktorch_ops.errors import ChannelError
from sparktorch_ops.wire import channel, messages
from sparktorch_ops.wire.messages import Hello


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


def test_wrong_secret_is_refused_and_cannot_inject(
    server, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    srv, recorder = server
    caplog.set_level(logging.WARNING, logger="test.channel")
    with pytest.raises(ChannelError, match="did not accept"):
        channel.ChannelClient.connect(srv.address, "wrong", Hello(role="worker", rank=0), timeout=1)
    assert "failed authentication" in caplog.text
    assert recorder.frames == [] and recorder.hellos == []


def test_garbage_before_hello_is_dropped(server, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    srv, recorder = server
    caplog.set_level(logging.WARNING, logger="test.channel")
    with _raw(srv) as sock:
        sock.sendall(channel.encode_frame(messages.STDOUT, b"no hello"))
        _wait(lambda: "valid HELLO" in caplog.text)
        assert _read_until_closed(sock)[5 + 32 :] == b""  # the challenge, then closed
    assert recorder.frames == []


def _raw(srv: channel.ChannelServer) -> socket.socket:
    return socket.create_connection(channel.split_address(srv.address), timeout=10)


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass  # closed by the server with our later bytes unread: TCP resets instead of EOF
    return data


class _Tap:
    """A TCP relay between a client and the server that keeps every byte it forwards."""

    def __init__(self, target: str) -> None:
        self.seen = bytearray()
        self._target = channel.split_address(target)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = channel.join_address("127.0.0.1", self._listener.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self.seen += data
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()


def test_the_secret_never_crosses_the_wire_and_a_replayed_hello_is_refused(
    server, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    srv, recorder = server
    caplog.set_level(logging.WARNING, logger="test.channel")
    tap = _Tap(srv.address)
    try:
        client = channel.ChannelClient.connect(tap.address, "s3cret", Hello(role="worker", rank=1))
        client.send(messages.STDOUT, b"hello over the tap")
        client.close()
        _wait(lambda: recorder.closed == 1)
    finally:
        tap.close()
    wire = bytes(tap.seen)
    assert b"hello over the tap" in wire and b"s3cret" not in wire
    # The HELLO frame as it crossed the wire, replayed on a new connection: a fresh challenge
    # makes it worthless.
    hello_at = wire.index(bytes([messages.HELLO]), 5 + 32)
    length = int.from_bytes(wire[hello_at + 1 : hello_at + 5], "big")
    with _raw(srv) as sock:
        sock.sendall(wire[hello_at : hello_at + 5 + length])
        sock.sendall(channel.encode_frame(messages.STDOUT, b"replayed"))
        _read_until_closed(sock)
    _wait(lambda: "replayed HELLO" in caplog.text)
    assert recorder.hellos == [Hello(role="worker", rank=1)]
    assert b"replayed" not in b"".join(p for _, p in recorder.frames)


def test_a_crowd_of_idle_connections_is_capped_and_a_real_client_still_gets_in(server) -> None:  # type: ignore[no-untyped-def]
    srv, recorder = server
    crowd = [_raw(srv) for _ in range(3 * channel.MAX_PENDING)]
    try:
        _wait(lambda: srv.rejected >= 2 * channel.MAX_PENDING)
        client = channel.ChannelClient.connect(srv.address, "s3cret", Hello(role="worker", rank=2))
        client.send(messages.STDOUT, b"made it")
        client.close()
        _wait(lambda: recorder.closed == 1)
        assert recorder.hellos == [Hello(role="worker", rank=2)]
        # Every idle one is closed by the deadline: none holds a descriptor for long.
        for sock in crowd:
            sock.settimeout(channel.HELLO_DEADLINE_S + 10)
            _read_until_closed(sock)
    finally:
        for sock in crowd:
            sock.close()


def test_a_silent_client_is_dropped_at_the_deadline(
    server, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    srv, _ = server
    caplog.set_level(logging.WARNING, logger="test.channel")
    with _raw(srv) as sock:
        started = time.monotonic()
        challenge = _read_until_closed(sock)
        waited = time.monotonic() - started
    assert challenge[0] == messages.CHALLENGE and len(challenge) == 5 + 32
    assert waited < channel.HELLO_DEADLINE_S + 5  # bounded: proves it does not hang
    assert "did not authenticate" in caplog.text


def test_clients_keep_their_connection_alive(server) -> None:  # type: ignore[no-untyped-def]
    srv, _ = server
    client = channel.ChannelClient.connect(srv.address, "s3cret", Hello(role="worker", rank=0))
    try:
        sock = client._sock
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 15
    finally:
        client.close()


def test_tls_channel_pins_the_runs_certificate(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("cryptography")
    from sparktorch_ops.driver.certificate import make_certificate

    certificate = make_certificate()
    assert "key_pem" not in repr(certificate)
    recorder = Recorder()
    srv = channel.ChannelServer(
        "127.0.0.1",
        recorder,
        logging.getLogger("test.channel"),
        "s3cret",
        tls=certificate.server_context(),
    )
    tap = _Tap(srv.address)
    try:
        client = channel.ChannelClient.connect(
            tap.address, "s3cret", Hello(role="worker", rank=0),
            fingerprint=certificate.fingerprint,
        )  # fmt: skip
        payload = b"secret training output " * 1000
        client.send(messages.STDOUT, payload)
        client.send_result(bytes(range(256)) * 8192)  # 2 MiB through TLS records
        client.close()
        _wait(lambda: recorder.closed == 1)
        assert recorder.frames[0] == (messages.STDOUT, payload)
        assert b"".join(p for k, p in recorder.frames if k == messages.RESULT_CHUNK) == (
            bytes(range(256)) * 8192
        )
        assert b"training output" not in bytes(tap.seen)  # encrypted on the wire
        with pytest.raises(ChannelError, match="not this run's"):
            channel.ChannelClient.connect(
                srv.address, "s3cret", Hello(role="worker", rank=0),
                fingerprint=make_certificate().fingerprint,
            )  # fmt: skip
        with pytest.raises(ChannelError, match="did not accept"):  # plain TCP is refused
            channel.ChannelClient.connect(
                srv.address, "s3cret", Hello(role="worker", rank=0), timeout=1
            )
    finally:
        tap.close()
        srv.close()
    assert len(recorder.hellos) == 1


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
