"""What the driver tells the barrier tasks while they start: the rendezvous port, the data layout.

Task 0 hosts torchrun's rendezvous store and reports its port; every task (those yet to
connect too) is told it. With DataFrame input each task reports the rows of the shards it
wrote; once all have, every task is told the rows per rank per epoch (the largest shard), so
every rank runs the same number of steps. Runs on the channel server's thread.

Over Spark Connect some tasks may not reach the driver; they agree among themselves in the
stage (one ``allGather``, which Spark answers a second late at best), and then every task must.
So the driver tells the tasks anything only once every task said it reached the driver
(:class:`~sparktorch_ops.wire.messages.Arrived`); when some task has not within a wait after
the first did, the tasks that did are told to agree in the stage as well (and so is any that
arrives later). The decision is taken once, so the tasks never split between the two ways.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from sparktorch_ops import events
from sparktorch_ops.wire import channel
from sparktorch_ops.wire.messages import (
    DATA,
    IN_STAGE,
    RDZV,
    AgreeInStage,
    DataLayout,
    Message,
    RendezvousPort,
    ShardSizes,
)

# The decisions over Connect: the driver tells every task, or the tasks agree in the stage.
_FROM_DRIVER = "driver"
_IN_THE_STAGE = "stage"


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
        self._layout: DataLayout | None = None
        # Over Connect: how many tasks must arrive, which did (node -> connection id), the
        # decision once taken, and what sends from a thread other than the server's.
        self._tasks: int | None = None
        self._arrived: dict[int, int] = {}
        self._decision: str | None = None
        self._timer: threading.Timer | None = None
        self._wait_s = 0.0
        self._send: Callable[[int, Message], None] | None = None

    def expect_shards(self, tasks: int) -> None:
        """Barrier mode with DataFrame input: ``tasks`` tasks will report shard sizes."""
        self._data_nodes = tasks

    def expect_arrivals(
        self, tasks: int, wait_s: float, send: Callable[[int, Message], None]
    ) -> None:
        """Over Spark Connect: tell the tasks nothing until all ``tasks`` arrived; ``wait_s``
        after the first arrival without the others, tell those that arrived to agree in the
        stage (``send``: the channel server's thread-safe send, by connection id)."""
        self._tasks, self._wait_s, self._send = tasks, wait_s, send

    def _telling(self) -> bool:
        return self._tasks is None or self._decision == _FROM_DRIVER

    def node_connected(self, peer: channel.Peer) -> None:
        """A barrier task connected: it hears the rendezvous port if it is known already."""
        with self._lock:
            self._nodes[peer.conn_id] = peer
            port = self._rendezvous if self._telling() else None
        if port is not None:
            peer.reply(RDZV, port.encode())

    def node_closed(self, peer: channel.Peer) -> None:
        with self._lock:
            self._nodes.pop(peer.conn_id, None)

    def node_arrived(self, peer: channel.Peer, node: int) -> None:
        """Over Connect: a task reached the driver and waits to be told. The last of all
        tasks to arrive makes the driver tell every task; one arriving after the tasks were
        told to agree in the stage is told so too."""
        tell: list[channel.Peer] = []
        with self._lock:
            decision = self._decision
            if decision is None:
                self._arrived[node] = peer.conn_id
                if len(self._arrived) == self._tasks:
                    self._decision = _FROM_DRIVER
                    if self._timer is not None:
                        self._timer.cancel()
                    tell = list(self._nodes.values())
                elif self._timer is None:
                    self._timer = threading.Timer(self._wait_s, self._agree_in_stage)
                    self._timer.daemon = True
                    self._timer.start()
            port, layout = self._rendezvous, self._layout
        if decision == _IN_THE_STAGE:
            peer.reply(IN_STAGE, AgreeInStage().encode())
        for each in tell:
            if port is not None:
                each.reply(RDZV, port.encode())
            if layout is not None:
                each.reply(DATA, layout.encode())

    def _agree_in_stage(self) -> None:
        """The wait for every task passed (on the timer's thread): those that arrived agree
        in the stage, with those that could not reach the driver."""
        with self._lock:
            if self._decision is not None:
                return
            self._decision = _IN_THE_STAGE
            arrived = list(self._arrived.values())
        assert self._send is not None
        for conn_id in arrived:
            self._send(conn_id, AgreeInStage())

    def close(self) -> None:
        """The run is over: no decision is taken after it."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()

    def rendezvous_ready(self, port: RendezvousPort) -> None:
        """Task 0 hosts the store: pass its port to every task."""
        if port.error is not None:
            self._fail(port.error)
            return
        with self._lock:
            self._rendezvous = port
            peers = list(self._nodes.values()) if self._telling() else []
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
            layout = self._layout = DataLayout.for_shards(shards)
            peers = list(self._nodes.values()) if self._telling() else []
        for peer in peers:
            peer.reply(DATA, layout.encode())
        if layout.error is not None:
            self._fail(layout.error)
            return
        self._on_phase(events.DATA_READY, rows=sum(map(sum, shards.values())))
