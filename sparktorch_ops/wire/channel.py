"""The authenticated rank -> driver channel.

One TCP listener per run, on the driver's address. Every client (rank supervisor, rank worker,
barrier node) authenticates by challenge and response, so the run's secret never crosses the
wire:

1. the driver sends CHALLENGE: 32 random bytes (``server nonce``);
2. the client sends HELLO: ``HMAC-SHA256(secret, "hello" | server nonce | body)`` followed by
   the body (who it is, as JSON, with a client nonce);
3. the driver checks the MAC and answers WELCOME: ``HMAC-SHA256(secret, "welcome" | client
   nonce | server nonce)``, which the client checks in turn (it is talking to its own driver).

A connection that does not complete this within :data:`HELLO_DEADLINE_S` is dropped; at most
:data:`MAX_PENDING` connections may be unauthenticated at once (further ones are closed on
accept; a real client retries with backoff). After the WELCOME the client sends framed messages:
log lines, metrics, result bytes, exit and failure records. Besides the handshake the driver
writes only the rendezvous port, the data layout and stack requests; it closes connections to
tell clients that the run is over, and every client treats end-of-file as "the driver is gone:
stop". TCP keepalive on both ends notices a vanished host within about a minute. When Spark's
encryption is on, every connection is TLS with the run's pinned certificate
(:mod:`sparktorch_ops.wire.tls`).

Frame: 1 byte kind, 4 bytes big-endian length, payload. Anything one connection sends that
cannot be handled closes that connection only.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
import os
import random
import secrets
import selectors
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

from sparktorch_ops.errors import ChannelError
from sparktorch_ops.wire.messages import (
    CHALLENGE,
    HELLO,
    RESULT_CHUNK,
    WELCOME,
    Hello,
    Message,
    MessageError,
    ResultEnd,
)

_HEADER = struct.Struct("!BI")
MAX_FRAME = 64 << 20
RESULT_CHUNK_SIZE = 16 << 20
_MAX_HELLO = 4 << 10
_READ_SIZE = 256 << 10
_SMALL_FRAME = 64 << 10
HELLO_DEADLINE_S = 2.0
MAX_PENDING = 64
_NONCE_BYTES = 32
_MAC = hashlib.sha256().digest_size
_HELLO_CONTEXT = b"sparktorch-ops hello\0"
_WELCOME_CONTEXT = b"sparktorch-ops welcome\0"
# Keepalive: probe after 15 s of silence, every 5 s, give up after 6 misses (about 45 s).
_KEEPALIVE = (15, 5, 6)
_LOGGED_REJECTS = 20  # then one summary line: a flood must not flood the log too


def hello_mac(secret: bytes, server_nonce: bytes, body: bytes) -> bytes:
    """The client's proof that it holds the run's secret (bound to this HELLO's body)."""
    return hmac.new(secret, _HELLO_CONTEXT + server_nonce + body, hashlib.sha256).digest()


def welcome_mac(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The driver's proof that it holds the run's secret."""
    return hmac.new(secret, _WELCOME_CONTEXT + client_nonce + server_nonce, hashlib.sha256).digest()


def set_keepalive(sock: socket.socket) -> None:
    """TCP keepalive, so that a peer whose host vanished is noticed within about a minute."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = _KEEPALIVE
    for name, value in (
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPINTVL", interval),
        ("TCP_KEEPCNT", count),
    ):
        option = getattr(socket, name, None)
        if option is not None:  # Linux and recent macOS; elsewhere the system defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def write_secret_file(directory: str, secret: str) -> str:
    """Write the run's secret to a new file only this user can read; returns its path.

    Ranks read it from there (see :data:`~sparktorch_ops.wire.env.SECRET_FILE_ENV`), so it is
    never in an environment that user code may print.
    """
    path = os.path.join(directory, "channel.secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secret)
    return path


def read_secret_file(path: str) -> str:
    """The secret :func:`write_secret_file` wrote."""
    with open(path) as source:
        return source.read()


def encode_frame(kind: int, payload: bytes) -> bytes:
    """One frame: kind, length, payload."""
    if len(payload) > MAX_FRAME:
        raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return _HEADER.pack(kind, len(payload)) + payload


def backoff(first: float, most: float, factor: float = 1.5) -> Iterator[float]:
    """The pauses of a polling or retry loop: ``first``, then ``factor`` times the last, at
    most ``most``; endless (the loop decides when to stop)."""
    pause = first
    while True:
        yield pause
        pause = min(pause * factor, most)


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    """``(host, port)`` -> ``"host:port"``, bracketing IPv6 literals."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class Peer:
    """An authenticated client connection, as the handler sees it."""

    conn_id: int
    hello: Hello
    address: str
    reply: Callable[[int, bytes], None] = field(default=lambda kind, payload: None, repr=False)


class ChannelHandler:
    """What the server calls; runs on the server's thread, so keep each call short."""

    def on_hello(self, peer: Peer) -> None:
        """A client authenticated."""

    def on_frame(self, peer: Peer, kind: int, payload: bytes | bytearray) -> None:
        """A frame arrived from an authenticated client (large ones come as bytearray)."""

    def on_closed(self, peer: Peer) -> None:
        """An authenticated client's connection ended (cleanly or not)."""


class _Connection:
    __slots__ = (
        "address",
        "buffer",
        "frame",
        "frame_filled",
        "frame_kind",
        "handshaking",
        "nonce",
        "opened",
        "peer",
        "sock",
    )

    def __init__(self, sock: socket.socket, address: str, handshaking: bool) -> None:
        self.sock = sock
        self.address = address
        self.buffer = bytearray()
        # A large frame is received straight into its own buffer (no re-slicing of megabytes).
        self.frame: bytearray | None = None
        self.frame_kind = 0
        self.frame_filled = 0
        self.handshaking = handshaking  # a TLS handshake still in progress
        self.nonce = b""  # the challenge sent to this client (empty until sent)
        self.peer: Peer | None = None
        self.opened = time.monotonic()

    def receive(self) -> bool:
        """Read what the socket has (into the large frame being received, else the buffer);
        False when the peer has closed the connection."""
        try:
            if self.frame is not None:
                view = memoryview(self.frame)[self.frame_filled :]
                received = self.sock.recv_into(view, len(view))
                self.frame_filled += received
                return received > 0
            data = self.sock.recv(_READ_SIZE)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return True
        except OSError:
            return False
        self.buffer += data
        return bool(data)

    def frames(self) -> Generator[tuple[int, bytes | bytearray], None, None]:
        """The complete frames received, in order. Until the connection has a peer only a
        HELLO may come; the consumer authenticates it before the next frame is cut, under the
        rules for an authenticated client.

        Raises:
            _BadFrame: a frame breaks those rules (the connection must be dropped).
        """
        if self.frame is not None:
            if self.frame_filled == len(self.frame):
                frame, self.frame = self.frame, None
                yield self.frame_kind, frame
            return
        buffer = self.buffer
        view = memoryview(buffer)
        offset = 0
        try:
            while len(buffer) - offset >= _HEADER.size:
                kind, length = _HEADER.unpack_from(buffer, offset)
                if self.peer is None and (kind != HELLO or length > _MAX_HELLO):
                    raise _BadFrame("did not start with a valid HELLO")
                if length > MAX_FRAME:
                    raise _BadFrame(f"sent a frame of {length} bytes")
                start = offset + _HEADER.size
                end = start + length
                if len(buffer) < end:
                    if length >= _READ_SIZE and self.peer is not None:
                        # Received straight into its own buffer from here on.
                        self.frame = bytearray(length)
                        self.frame_kind = kind
                        self.frame_filled = len(buffer) - start
                        self.frame[: self.frame_filled] = view[start:]
                        offset = len(buffer)
                    break
                payload = bytes(view[start:end])
                offset = end
                yield kind, payload
        finally:
            view.release()
            if offset:
                del buffer[:offset]


class _BadFrame(Exception):
    """A client sent a frame the channel's rules do not allow (the reason)."""


class ChannelServer:
    """The driver's listener for one run.

    Args:
        host: the address to bind (loopback in local mode, the driver host otherwise).
        handler: receives hellos, frames and closes.
        logger: where dropped clients are reported.
        secret: the run's secret, which clients prove they hold (never sent).
        tls: a server context: every connection is TLS (None: plain TCP).
        advertise: the host clients are told to connect to, when it is not ``host`` (the
            server then binds ``host``, e.g. every interface, behind NAT or in a container).
    """

    def __init__(
        self,
        host: str,
        handler: ChannelHandler,
        logger: Any,
        secret: str,
        tls: ssl.SSLContext | None = None,
        advertise: str | None = None,
    ) -> None:
        self._handler = handler
        self._log = logger
        self._secret = secret.encode()
        self._tls = tls
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=128)
        self._listener.setblocking(False)
        self.address = join_address(advertise or host, self._listener.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._connections: dict[int, _Connection] = {}
        self._outbox: deque[tuple[int, bytes]] = deque()
        self._next_id = 0
        self._stopping = False
        self.rejected = 0  # connections dropped before authenticating (for logs and tests)
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._serve,), name="sparktorch-channel", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"ChannelServer({self.address}, tls={self._tls is not None})"

    def close(self, timeout: float = 10.0) -> None:
        """Close every connection and the listener; wait for the server thread. Idempotent."""
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout)

    def send(self, conn_id: int, message: Message) -> None:
        """Send a small control message to one client, from any thread (the server's thread
        writes it; a client that has gone by then is skipped)."""
        self._outbox.append((conn_id, encode_frame(message.KIND, message.encode())))
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def drain(self, until: Callable[[], bool], timeout: float) -> bool:
        """Wait (polling) until ``until()`` holds or ``timeout`` passes; True if it held."""
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline or not self._thread.is_alive():
                return until()
            time.sleep(0.02)
        return True

    def _serve(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self._selector.select(timeout=0.5):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    else:
                        self._read_guarded(key.data)
                self._send_outbox()
                self._drop_silent_clients()
        except Exception:  # a bug here must not hang the run: report and close everything
            self._log.exception("sparktorch_ops channel server failed")
        finally:
            for conn in list(self._connections.values()):
                self._close(conn)
            self._selector.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()
            if self.rejected > _LOGGED_REJECTS:
                self._log.warning(
                    "sparktorch_ops channel: %d clients were dropped before authenticating in "
                    "all (the first %d were logged)",
                    self.rejected,
                    _LOGGED_REJECTS,
                )

    def _pending(self) -> int:
        return sum(1 for conn in self._connections.values() if conn.peer is None)

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the next select retries
                self._log.warning("sparktorch_ops channel: accept failed: %s", exc)
                return
            address = join_address(str(addr[0]), int(addr[1]))
            if self._pending() >= MAX_PENDING:
                # Closed before any byte is read: a real client sees end-of-file before its
                # challenge and tries again; a crowd of idle connections cannot grow.
                sock.close()
                self._count_reject(address, f"came while {MAX_PENDING} others were pending")
                continue
            try:
                set_keepalive(sock)
                sock.setblocking(False)
                if self._tls is not None:
                    sock = self._tls.wrap_socket(
                        sock, server_side=True, do_handshake_on_connect=False
                    )
            except (OSError, ValueError) as exc:
                sock.close()
                self._count_reject(address, f"could not be set up ({exc})")
                continue
            conn = _Connection(sock, address, handshaking=self._tls is not None)
            self._next_id += 1
            self._connections[self._next_id] = conn
            self._selector.register(sock, selectors.EVENT_READ, self._next_id)
            if not conn.handshaking:
                self._challenge(conn)

    def _challenge(self, conn: _Connection) -> None:
        conn.nonce = secrets.token_bytes(_NONCE_BYTES)
        self._send_small(conn, CHALLENGE, conn.nonce)

    def _send_small(self, conn: _Connection, kind: int, payload: bytes) -> None:
        """A handshake frame, without blocking: it fits in any fresh socket's send buffer."""
        frame = encode_frame(kind, payload)
        try:
            sent = conn.sock.send(frame)
        except (OSError, ValueError):
            sent = -1
        if sent != len(frame):
            self._reject(conn, "could not be sent its handshake")

    def _read_guarded(self, conn_id: int) -> None:
        """Read one connection; anything it sends that breaks the reading closes it alone."""
        conn = self._connections.get(conn_id)
        try:
            self._read(conn_id)
            # TLS may hold decrypted bytes that the selector cannot see: read them now.
            while (
                conn is not None
                and conn_id in self._connections
                and isinstance(conn.sock, ssl.SSLSocket)
                and not conn.handshaking
                and conn.sock.pending()
            ):
                self._read(conn_id)
        except Exception as exc:
            if not isinstance(exc, (MessageError, OSError)):  # a bug worth a traceback
                self._log.warning("sparktorch_ops channel: handling a frame failed", exc_info=True)
            conn = self._connections.get(conn_id)
            if conn is not None:
                self._reject(conn, f"sent what could not be handled ({type(exc).__name__}: {exc})")

    def _handshake(self, conn: _Connection) -> None:
        assert isinstance(conn.sock, ssl.SSLSocket)
        try:
            conn.sock.do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except (ssl.SSLError, OSError) as exc:
            self._reject(conn, f"failed the TLS handshake ({exc})")
            return
        conn.handshaking = False
        self._challenge(conn)

    def _read(self, conn_id: int) -> None:
        conn = self._connections.get(conn_id)
        if conn is None:
            return
        if conn.handshaking:
            self._handshake(conn)
            return
        if not conn.receive():
            self._close(conn)
            return
        frames = conn.frames()
        try:
            for kind, payload in frames:
                if conn.peer is not None:
                    self._handler.on_frame(conn.peer, kind, payload)
                elif not self._authenticate(conn_id, conn, bytes(payload)):
                    return
        except _BadFrame as exc:
            self._reject(conn, str(exc))
        finally:
            frames.close()

    def _authenticate(self, conn_id: int, conn: _Connection, payload: bytes) -> bool:
        mac, body = payload[:_MAC], payload[_MAC:]
        if not conn.nonce or not hmac.compare_digest(
            mac, hello_mac(self._secret, conn.nonce, body)
        ):
            self._reject(conn, "failed authentication (wrong secret or a replayed HELLO)")
            return False
        try:
            record = json.loads(body)
            client_nonce = bytes.fromhex(record.pop("nonce"))
            hello = Hello.from_dict(record)
        except (ValueError, KeyError, AttributeError, TypeError, RecursionError) as exc:
            self._reject(conn, f"sent a malformed HELLO ({type(exc).__name__}: {exc})")
            return False
        conn.peer = Peer(
            conn_id=conn_id,
            hello=hello,
            address=conn.address,
            reply=lambda kind, payload: self._send_to(conn, kind, payload),
        )
        self._send_small(conn, WELCOME, welcome_mac(self._secret, client_nonce, conn.nonce))
        if conn.peer is not None:  # still connected after the WELCOME
            self._handler.on_hello(conn.peer)
        return conn.peer is not None

    def _send_to(self, conn: _Connection, kind: int, payload: bytes) -> None:
        self._send_frame(conn, encode_frame(kind, payload))

    def _send_frame(self, conn: _Connection, frame: bytes) -> None:
        # Only small control frames go this way, from the server thread itself.
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(5.0)
            conn.sock.sendall(frame)
        except OSError:
            self._close(conn)
            return
        conn.sock.setblocking(False)

    def _send_outbox(self) -> None:
        while self._outbox:
            conn_id, frame = self._outbox.popleft()
            conn = self._connections.get(conn_id)
            if conn is not None and conn.peer is not None:
                self._send_frame(conn, frame)

    def _count_reject(self, address: str, why: str) -> None:
        self.rejected += 1
        if self.rejected <= _LOGGED_REJECTS:
            self._log.warning(
                "sparktorch_ops channel: dropped a client from %s that %s", address, why
            )

    def _reject(self, conn: _Connection, why: str) -> None:
        if conn.peer is None:
            self._count_reject(conn.address, why)
        else:
            self._log.warning(
                "sparktorch_ops channel: dropped %s from %s that %s",
                conn.peer.hello.who,
                conn.address,
                why,
            )
        self._close(conn)

    def _drop_silent_clients(self) -> None:
        now = time.monotonic()
        for conn in list(self._connections.values()):
            if conn.peer is None and now - conn.opened > HELLO_DEADLINE_S:
                self._reject(conn, f"did not authenticate within {HELLO_DEADLINE_S:g} s")

    def _close(self, conn: _Connection) -> None:
        for conn_id, known in list(self._connections.items()):
            if known is conn:
                del self._connections[conn_id]
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if conn.peer is not None:
            peer, conn.peer = conn.peer, None
            self._handler.on_closed(peer)


class _Retry(Exception):
    """The driver closed or ignored a connection before authenticating it: try again."""


class ChannelClient:
    """A rank-side connection to the driver. ``send`` is thread-safe."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self.closed = False

    @classmethod
    def connect(
        cls,
        address: str,
        secret: str,
        hello: Hello,
        timeout: float = 30.0,
        fingerprint: str | None = None,
    ) -> ChannelClient:
        """Connect and authenticate (challenge and response; TLS when ``fingerprint`` is given).

        A connection the driver drops before authenticating it (too many pending clients, a
        stall past the deadline) is retried with backoff until ``timeout``.

        Raises:
            ChannelError: the driver cannot be reached, or did not prove it holds the secret,
                or presented another certificate.
        """
        host, port = split_address(address)
        deadline = time.monotonic() + timeout
        delays = backoff(0.05, 1.0, factor=2)
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((host, port), timeout=max(0.1, remaining))
            except OSError as exc:
                raise ChannelError(
                    f"cannot reach the driver's channel at {address}: {exc}"
                ) from exc
            try:
                return cls._authenticate(sock, address, secret.encode(), hello, fingerprint)
            except _Retry as why:
                sock.close()
                delay = next(delays)
                if time.monotonic() + delay > deadline:
                    raise ChannelError(
                        f"the driver's channel at {address} did not accept this client within "
                        f"{timeout:g} s ({why})"
                    ) from None
                time.sleep(delay * (0.5 + random.random()))
            except BaseException:
                sock.close()
                raise

    @classmethod
    def _authenticate(
        cls,
        sock: socket.socket,
        address: str,
        secret: bytes,
        hello: Hello,
        fingerprint: str | None,
    ) -> ChannelClient:
        sock.settimeout(HELLO_DEADLINE_S * 5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_keepalive(sock)
        if fingerprint is not None:
            from sparktorch_ops.wire import tls

            try:
                sock = tls.client_context().wrap_socket(sock)
            except (ssl.SSLError, OSError) as exc:
                raise _Retry(f"TLS handshake: {exc}") from None
            tls.check_pinned(sock, fingerprint, address)
        client = cls(sock)
        try:
            server_nonce = client._expect(CHALLENGE, _NONCE_BYTES)
            client_nonce = secrets.token_bytes(_NONCE_BYTES)
            body = json.dumps({**hello.to_dict(), "nonce": client_nonce.hex()}).encode()
            client.send(HELLO, hello_mac(secret, server_nonce, body) + body)
            proof = client._expect(WELCOME, _MAC)
        except (ChannelError, TimeoutError) as exc:
            raise _Retry(str(exc)) from None
        if not hmac.compare_digest(proof, welcome_mac(secret, client_nonce, server_nonce)):
            raise ChannelError(
                f"the channel at {address} did not prove it holds this run's secret; refusing it"
            )
        sock.settimeout(None)
        return client

    def _expect(self, kind: int, size: int) -> bytes:
        got, payload = self.recv_frame()
        if got != kind or len(payload) != size:
            raise ChannelError(f"expected handshake frame {kind}, got frame {got}")
        return payload

    def send(self, kind: int, payload: bytes | memoryview) -> None:
        """Send one frame.

        Raises:
            ChannelError: the connection is gone.
        """
        if len(payload) > MAX_FRAME:
            raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
        header = _HEADER.pack(kind, len(payload))
        with self._lock:
            try:
                if len(payload) < _SMALL_FRAME:
                    self._sock.sendall(header + bytes(payload))
                else:  # no copy of a large payload just to prepend five bytes
                    self._sock.sendall(header)
                    self._sock.sendall(payload)
            except OSError as exc:
                self.closed = True
                raise ChannelError(f"lost the driver's channel: {exc}") from exc

    def send_message(self, message: Message) -> None:
        """Send one typed message as its frame."""
        self.send(message.KIND, message.encode())

    def send_result(self, data: bytes) -> None:
        """Send result bytes in chunks, then the end marker with the total size."""
        view = memoryview(data)
        for start in range(0, len(view), RESULT_CHUNK_SIZE):
            self.send(RESULT_CHUNK, view[start : start + RESULT_CHUNK_SIZE])
        self.send_message(ResultEnd(size=len(data)))

    def recv_frame(self) -> tuple[int, bytes]:
        """Block until the driver sends a frame (at most :data:`MAX_FRAME` bytes).

        Raises:
            ChannelError: the driver closed the connection first.
        """
        header = self._recv_exact(_HEADER.size)
        kind, length = _HEADER.unpack(header)
        if length > MAX_FRAME:
            raise ChannelError(f"the driver sent a frame of {length} bytes")
        return kind, self._recv_exact(length)

    def _recv_exact(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            try:
                chunk = self._sock.recv(size - len(data))
            except OSError as exc:
                raise ChannelError(f"lost the driver's channel: {exc}") from exc
            if not chunk:
                raise ChannelError("the driver closed the channel")
            data += chunk
        return bytes(data)

    def wait_closed(self) -> None:
        """Block until the driver closes the connection (or it breaks)."""
        try:
            while self._sock.recv(4096):
                pass
        except OSError:
            pass
        self.closed = True

    def release_in_child(self) -> None:
        """In a forked child: drop the inherited copy of the connection, leaving it open for
        the parent (a shutdown would end it for both)."""
        self.closed = True
        os.close(self._sock.detach())

    def close(self) -> None:
        """Close the connection. Idempotent."""
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
