"""The authenticated rank -> driver channel.

One TCP listener per run, on the driver's address. Every client (rank supervisor, rank worker,
barrier node) opens a connection and must send a HELLO frame carrying the run's random token
before anything else is read; a client that does not is dropped and logged. After that the
client sends framed messages: log lines, metrics, result bytes, exit and failure records. The
driver never writes; it closes connections to tell clients that the run is over, and every
client treats end-of-file as "the driver is gone: stop".

Frame: 1 byte kind, 4 bytes big-endian length, payload.
"""

from __future__ import annotations

import contextvars
import hmac
import json
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparktorch_ops.errors import ChannelError
from sparktorch_ops.messages import (
    HELLO,
    RESULT_CHUNK,
    Hello,
    Message,
    MessageError,
    ResultEnd,
)

_HEADER = struct.Struct("!BI")
MAX_FRAME = 64 << 20
RESULT_CHUNK_SIZE = 16 << 20
_MAX_HELLO = 64 << 10
_READ_SIZE = 256 << 10
_SMALL_FRAME = 64 << 10
_HELLO_DEADLINE_S = 15.0


def encode_frame(kind: int, payload: bytes) -> bytes:
    """One frame: kind, length, payload."""
    if len(payload) > MAX_FRAME:
        raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return _HEADER.pack(kind, len(payload)) + payload


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
        "opened",
        "peer",
        "sock",
    )

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address
        self.buffer = bytearray()
        # A large frame is received straight into its own buffer (no re-slicing of megabytes).
        self.frame: bytearray | None = None
        self.frame_kind = 0
        self.frame_filled = 0
        self.peer: Peer | None = None
        self.opened = time.monotonic()


class ChannelServer:
    """The driver's listener for one run.

    Args:
        host: the address to bind (loopback in local mode, the driver host otherwise).
        handler: receives hellos, frames and closes.
        logger: where dropped clients are reported.
        token: the secret clients must present (a fresh random one is typical).
    """

    def __init__(
        self,
        host: str,
        handler: ChannelHandler,
        logger: Any,
        token: str,
    ) -> None:
        self._handler = handler
        self._log = logger
        self.token = token
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=128)
        self._listener.setblocking(False)
        self.address = join_address(host, self._listener.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._connections: dict[int, _Connection] = {}
        self._next_id = 0
        self._stopping = False
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._serve,), name="sparktorch-channel", daemon=True
        )
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Close every connection and the listener; wait for the server thread. Idempotent."""
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout)

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
                for key, _ in self._selector.select(timeout=1.0):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    else:
                        self._read_guarded(key.data)
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

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            conn = _Connection(sock, join_address(str(addr[0]), int(addr[1])))
            self._next_id += 1
            self._connections[self._next_id] = conn
            self._selector.register(sock, selectors.EVENT_READ, self._next_id)

    def _read_guarded(self, conn_id: int) -> None:
        """Read one connection; anything it sends that breaks the reading closes it alone."""
        try:
            self._read(conn_id)
        except Exception as exc:
            if not isinstance(exc, MessageError):  # not a bad frame: a bug worth a traceback
                self._log.warning("sparktorch_ops channel: handling a frame failed", exc_info=True)
            conn = self._connections.get(conn_id)
            if conn is not None:
                self._reject(conn, f"sent what could not be handled ({type(exc).__name__}: {exc})")

    def _read(self, conn_id: int) -> None:
        conn = self._connections.get(conn_id)
        if conn is None:
            return
        try:
            if conn.frame is not None:
                received = conn.sock.recv_into(memoryview(conn.frame)[conn.frame_filled :])
                data = b"" if received == 0 else None
            else:
                data = conn.sock.recv(_READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, received = b"", 0
        if data is not None and not data:
            self._close(conn)
            return
        if data is None:
            conn.frame_filled += received
            if conn.frame is not None and conn.frame_filled == len(conn.frame):
                frame, conn.frame = conn.frame, None
                assert conn.peer is not None  # large frames are only taken after the HELLO
                self._handler.on_frame(conn.peer, conn.frame_kind, frame)
            return
        conn.buffer += data
        self._parse(conn_id, conn)

    def _parse(self, conn_id: int, conn: _Connection) -> None:
        buffer = conn.buffer
        view = memoryview(buffer)
        offset = 0
        try:
            while len(buffer) - offset >= _HEADER.size:
                kind, length = _HEADER.unpack_from(buffer, offset)
                if conn.peer is None and (kind != HELLO or length > _MAX_HELLO):
                    self._reject(conn, "did not start with a valid HELLO")
                    return
                if length > MAX_FRAME:
                    self._reject(conn, f"sent a frame of {length} bytes")
                    return
                start = offset + _HEADER.size
                end = start + length
                if len(buffer) < end:
                    if length >= _READ_SIZE and conn.peer is not None:
                        conn.frame = bytearray(length)
                        conn.frame_kind = kind
                        conn.frame_filled = len(buffer) - start
                        conn.frame[: conn.frame_filled] = view[start:]
                        offset = len(buffer)
                    break
                payload = bytes(view[start:end])
                offset = end
                if conn.peer is None:
                    if not self._authenticate(conn_id, conn, payload):
                        return
                else:
                    self._handler.on_frame(conn.peer, kind, payload)
        finally:
            view.release()
        if offset:
            del buffer[:offset]

    def _authenticate(self, conn_id: int, conn: _Connection, payload: bytes) -> bool:
        try:
            record = json.loads(payload)
            token = record.pop("token")
        except (ValueError, KeyError, AttributeError, TypeError, RecursionError):
            self._reject(conn, "sent a malformed HELLO")
            return False
        if not isinstance(token, str) or not hmac.compare_digest(
            token.encode("utf-8", "surrogatepass"), self.token.encode()
        ):
            self._reject(conn, "presented a wrong token")
            return False
        try:
            hello = Hello.from_dict(record)
        except MessageError as exc:
            self._reject(conn, f"sent a malformed HELLO ({exc})")
            return False
        conn.peer = Peer(
            conn_id=conn_id,
            hello=hello,
            address=conn.address,
            reply=lambda kind, payload: self._send_to(conn, kind, payload),
        )
        self._handler.on_hello(conn.peer)
        return True

    def _send_to(self, conn: _Connection, kind: int, payload: bytes) -> None:
        # Only small control frames go this way, from the server thread itself.
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(5.0)
            conn.sock.sendall(encode_frame(kind, payload))
        except OSError:
            self._close(conn)
            return
        conn.sock.setblocking(False)

    def _reject(self, conn: _Connection, why: str) -> None:
        self._log.warning(
            "sparktorch_ops channel: dropped a client from %s that %s", conn.address, why
        )
        self._close(conn)

    def _drop_silent_clients(self) -> None:
        now = time.monotonic()
        for conn in list(self._connections.values()):
            if conn.peer is None and now - conn.opened > _HELLO_DEADLINE_S:
                self._reject(conn, f"sent no HELLO within {_HELLO_DEADLINE_S:g} s")

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


class ChannelClient:
    """A rank-side connection to the driver. ``send`` is thread-safe."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self.closed = False

    @classmethod
    def connect(
        cls, address: str, token: str, hello: Hello, timeout: float = 30.0
    ) -> ChannelClient:
        """Connect and authenticate.

        Raises:
            ChannelError: the driver cannot be reached.
        """
        host, port = split_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise ChannelError(f"cannot reach the driver's channel at {address}: {exc}") from exc
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client = cls(sock)
        client.send(HELLO, json.dumps({**hello.to_dict(), "token": token}).encode())
        return client

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
        """Block until the driver sends a frame.

        Raises:
            ChannelError: the driver closed the connection first.
        """
        header = self._recv_exact(_HEADER.size)
        kind, length = _HEADER.unpack(header)
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
