"""What the driver tells the barrier tasks while they start: the rendezvous port, the data layout.

Task 0 hosts torchrun's rendezvous store and reports its port; every task (those yet to
connect too) is told it. With DataFrame input each task reports the rows of the shards it
wrote; once all have, every task is told the rows per rank per epoch (the largest shard), so
every rank runs the same number of steps. Runs on the channel server's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from sparktorch_ops import events
from sparktorch_ops.wire import channel
from sparktorch_ops.wire.messages import DATA, RDZV, DataLayout, RendezvousPort, ShardSizes


class Coordinator:
    """The barrier tasks' start-up exchange of one run.

    Args:
        fail: called with a reason when the exchange cannot go on (no store, an empty rank).
        on_phase: called with a phase name and what it concerns, for the run's events.
    """

    def __init__(self, fail: Callable[[str], None], on_phase: Callable[..., None]) -> None:
        self._fail = fail
        self._on_phase = on_phase
        self._lock = threading.Lock()
        self._nodes: dict[int, channel.Peer] = {}  # by connection id
        self._rendezvous: RendezvousPort | None = None
        self._data_nodes: int | None = None
        self._shards: dict[int, list[int]] = {}

    def expect_shards(self, tasks: int) -> None:
        """Barrier mode with DataFrame input: ``tasks`` tasks will report shard sizes."""
        self._data_nodes = tasks

    def node_connected(self, peer: channel.Peer) -> None:
        """A barrier task connected: it hears the rendezvous port if it is known already."""
        with self._lock:
            self._nodes[peer.conn_id] = peer
            port = self._rendezvous
        if port is not None:
            peer.reply(RDZV, port.encode())

    def node_closed(self, peer: channel.Peer) -> None:
        with self._lock:
            self._nodes.pop(peer.conn_id, None)

    def rendezvous_ready(self, port: RendezvousPort) -> None:
        """Task 0 hosts the store: pass its port to every task."""
        if port.error is not None:
            self._fail(port.error)
            return
        with self._lock:
            self._rendezvous = port
            peers = list(self._nodes.values())
        for peer in peers:
            peer.reply(RDZV, port.encode())
        self._on_phase(events.RENDEZVOUS_READY, node=0, port=port.port)

    def shards_written(self, node: int, sizes: ShardSizes) -> None:
        """Once every task wrote its shards: tell each the rows per rank per epoch, or fail
        the run when a rank got no rows at all."""
        with self._lock:
            self._shards[node] = list(sizes.rows)
            if self._data_nodes is None or len(self._shards) < self._data_nodes:
                return
            shards = dict(self._shards)
            peers = list(self._nodes.values())
        layout = DataLayout.for_shards(shards)
        for peer in peers:
            peer.reply(DATA, layout.encode())
        if layout.error is not None:
            self._fail(layout.error)
            return
        self._on_phase(events.DATA_READY, rows=sum(map(sum, shards.values())))
