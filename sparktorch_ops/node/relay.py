"""The driver's channel, recorded on the executor, for a client the executors cannot reach.

A Spark Connect client (an Airflow or Prefect worker) may sit behind NAT or in a container that
the executors cannot connect to. Then a barrier task serves its node's ranks itself: a
:class:`Relay` is a channel server on the task's loopback that authenticates them exactly like
the driver's would and spools every frame they send (hellos, lines, metrics, the result,
exits, hang-ups) to a file in the task's work directory. When the task ends it hands the frames
back through Spark as rows of the stage's result, and the driver replays them, in order, into
the same collector that live frames feed: lines, metrics, failures and rank 0's value arrive
with the result instead of live, and nothing else about the run changes.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from sparktorch_ops.wire import channel
from sparktorch_ops.wire.messages import Hello

#: Pseudo frame kinds in a relay's record (real frame kinds are never negative).
HELLO_RECORD = -1
CLOSED_RECORD = -2

_RECORD = struct.Struct("!diiQ")  # arrival (time.time()), peer id, kind, payload length
_CLOSE_WAIT_S = 10.0


@dataclass(frozen=True)
class RelayedFrame:
    """One recorded event of one connection: a hello (its fields as JSON), a frame, or the
    hang-up (:data:`CLOSED_RECORD`, empty payload), and when the relay received it (the
    driver merges the tasks' events in that order, so "which rank failed first" holds)."""

    peer: int
    kind: int
    payload: bytes
    time: float = 0.0


class _Recorder(channel.ChannelHandler):
    """Writes every event to the spool file, on the relay's server thread."""

    def __init__(self, spool: BinaryIO) -> None:
        self._spool = spool
        self.open_peers = 0

    def _write(self, peer: int, kind: int, payload: bytes | bytearray) -> None:
        self._spool.write(_RECORD.pack(time.time(), peer, kind, len(payload)))
        self._spool.write(payload)

    def on_hello(self, peer: channel.Peer) -> None:
        self.open_peers += 1
        self._write(peer.conn_id, HELLO_RECORD, json.dumps(peer.hello.to_dict()).encode())

    def on_frame(self, peer: channel.Peer, kind: int, payload: bytes | bytearray) -> None:
        self._write(peer.conn_id, kind, payload)

    def on_closed(self, peer: channel.Peer) -> None:
        self._write(peer.conn_id, CLOSED_RECORD, b"")
        self.open_peers -= 1


class Relay:
    """A channel server on loopback that records what its clients send (see the module).

    Args:
        secret: the run's secret (clients prove they hold it, as with the driver).
        spool_path: the file the frames are written to (in the task's work directory).
    """

    def __init__(self, secret: str, spool_path: str) -> None:
        self._spool_path = spool_path
        self._spool = open(spool_path, "wb")  # noqa: SIM115 (closed by close())
        self._recorder = _Recorder(self._spool)
        self._server = channel.ChannelServer(
            "127.0.0.1", self._recorder, logging.getLogger("sparktorch_ops.node.relay"), secret
        )
        self.address = self._server.address

    def close(self) -> None:
        """Wait (bounded) until every client hung up, then stop serving. Idempotent."""
        self._server.drain(lambda: self._recorder.open_peers <= 0, _CLOSE_WAIT_S)
        self._server.close()
        self._spool.close()

    def frames(self) -> Iterator[RelayedFrame]:
        """The recorded events in arrival order (after :meth:`close`), read from the spool
        one at a time."""
        with open(self._spool_path, "rb") as spool:
            while header := spool.read(_RECORD.size):
                at, peer, kind, length = _RECORD.unpack(header)
                yield RelayedFrame(peer, kind, spool.read(length), at)


class Replayer:
    """Feeds tasks' recorded events to ``handler`` as if they had arrived live.

    A task's connection ids become negative ids unique to the task (live ids are positive).
    """

    def __init__(self, handler: channel.ChannelHandler) -> None:
        self._handler = handler
        self._peers: dict[tuple[int, int], channel.Peer] = {}
        self.replayed = 0

    def feed(self, node: int, frame: RelayedFrame, address: str) -> None:
        """One recorded event of task ``node`` (whose host is ``address``)."""
        self.replayed += 1
        key = (node, frame.peer)
        if frame.kind == HELLO_RECORD:
            hello = Hello.from_dict(json.loads(frame.payload))
            conn_id = -(node * _PEERS_PER_TASK + frame.peer + 1)
            self._peers[key] = channel.Peer(conn_id, hello, address)
            self._handler.on_hello(self._peers[key])
            return
        peer = self._peers.get(key)
        if peer is None:
            return
        if frame.kind == CLOSED_RECORD:
            self._handler.on_closed(self._peers.pop(key))
        else:
            self._handler.on_frame(peer, frame.kind, frame.payload)

    def finish(self) -> None:
        """Connections whose hang-up was not recorded (the task ended first) hang up now."""
        for peer in self._peers.values():
            self._handler.on_closed(peer)
        self._peers.clear()


_PEERS_PER_TASK = 1 << 20


__all__ = ["CLOSED_RECORD", "HELLO_RECORD", "Relay", "RelayedFrame", "Replayer"]
