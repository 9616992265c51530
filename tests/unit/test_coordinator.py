"""The driver's start-up exchange with the barrier tasks, fed as the channel server would."""

from __future__ import annotations

import threading
import time

from sparktorch_ops import events
from sparktorch_ops.driver.coordinator import Coordinator
from sparktorch_ops.wire import channel, messages
from sparktorch_ops.wire.messages import Hello, Message, RendezvousPort, ShardSizes


class Peers:
    """Node connections whose replies (server thread) and sends (other threads) are kept."""

    def __init__(self) -> None:
        self.frames: dict[int, list[int]] = {}
        self.sent = threading.Event()

    def peer(self, node: int) -> channel.Peer:
        self.frames[node] = []
        return channel.Peer(
            conn_id=node,
            hello=Hello(role="node", node=node, host=f"h{node}"),
            address="127.0.0.1:1",
            reply=lambda kind, payload: self.frames[node].append(kind),
        )

    def send(self, conn_id: int, message: Message) -> None:
        self.frames[conn_id].append(message.KIND)
        self.sent.set()


def coordinator(failures: list[str], phases: list[str]) -> Coordinator:
    return Coordinator(failures.append, lambda name, **where: phases.append(name))


def test_a_classic_session_tells_every_task_as_soon_as_it_knows() -> None:
    peers, failures, phases = Peers(), [], []  # type: ignore[var-annotated]
    c = coordinator(failures, phases)
    c.expect_shards(2)
    first = peers.peer(0)
    c.node_connected(first)
    c.rendezvous_ready(RendezvousPort(port=29500))
    c.node_connected(peers.peer(1))  # a late task hears the port at once
    assert peers.frames == {0: [messages.RDZV], 1: [messages.RDZV]}
    c.shards_written(0, ShardSizes(rows=[5]))
    c.shards_written(1, ShardSizes(rows=[4]))
    assert peers.frames == {0: [messages.RDZV, messages.DATA], 1: [messages.RDZV, messages.DATA]}
    assert phases == [events.RENDEZVOUS_READY, events.DATA_READY] and not failures


def test_over_connect_the_tasks_are_told_once_every_task_arrived() -> None:
    peers, failures, phases = Peers(), [], []  # type: ignore[var-annotated]
    c = coordinator(failures, phases)
    c.expect_shards(2)
    c.expect_arrivals(2, wait_s=30.0, send=peers.send)
    nodes = [peers.peer(0), peers.peer(1)]
    for node, p in enumerate(nodes):
        c.node_connected(p)
        c.shards_written(node, ShardSizes(rows=[3]))
    c.rendezvous_ready(RendezvousPort(port=29500))
    c.node_arrived(nodes[0], 0)
    assert peers.frames == {0: [], 1: []}  # task 1 may yet relay
    c.node_arrived(nodes[1], 1)
    assert peers.frames == {0: [messages.RDZV, messages.DATA], 1: [messages.RDZV, messages.DATA]}
    assert not failures
    c.close()


def test_over_connect_a_task_that_does_not_arrive_makes_the_tasks_agree_in_the_stage() -> None:
    peers, failures, phases = Peers(), [], []  # type: ignore[var-annotated]
    c = coordinator(failures, phases)
    c.expect_arrivals(3, wait_s=0.2, send=peers.send)
    nodes = [peers.peer(0), peers.peer(1), peers.peer(2)]
    started = time.monotonic()
    for node in (0, 1):
        c.node_connected(nodes[node])
        c.node_arrived(nodes[node], node)
    c.rendezvous_ready(RendezvousPort(port=29500))
    assert peers.sent.wait(10.0)  # task 2 relays: the wait passes
    assert time.monotonic() - started >= 0.2
    # Told from the timer's thread, through the server's thread-safe send; never the port.
    assert peers.frames == {0: [messages.IN_STAGE], 1: [messages.IN_STAGE], 2: []}
    c.node_connected(nodes[2])  # arrives after all: told the same, still not the port
    c.node_arrived(nodes[2], 2)
    assert peers.frames[2] == [messages.IN_STAGE]
    assert not failures and phases == [events.RENDEZVOUS_READY]


def test_over_connect_no_decision_is_taken_after_the_run() -> None:
    peers, failures, phases = Peers(), [], []  # type: ignore[var-annotated]
    c = coordinator(failures, phases)
    c.expect_arrivals(2, wait_s=0.1, send=peers.send)
    first = peers.peer(0)
    c.node_connected(first)
    c.node_arrived(first, 0)
    c.close()
    assert not peers.sent.wait(0.5)
    assert peers.frames == {0: []}
