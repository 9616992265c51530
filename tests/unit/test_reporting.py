"""``report()`` over a real channel: what reaches the driver, and what is refused."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sparktorch_ops.rank.reporting import install, report
from sparktorch_ops.wire import channel

TOKEN = "report-test-token"


def _hello(rank: int) -> Any:
    """A worker's HELLO: a dict, or the typed Hello where the channel has one."""
    hello_type = getattr(channel, "Hello", None)
    return {"role": "worker", "rank": rank} if hello_type is None else hello_type("worker", rank)


def _rank(peer: channel.Peer) -> int:
    hello: Any = peer.hello
    return int(hello["rank"] if isinstance(hello, dict) else hello.rank)


class Metrics(channel.ChannelHandler):
    """The driver's side: every frame of every rank, decoded as JSON."""

    def __init__(self) -> None:
        self.frames: list[tuple[int, int, dict[str, Any]]] = []  # (rank, kind, record)
        self.lock = threading.Lock()

    def on_frame(self, peer: channel.Peer, kind: int, payload: bytes | bytearray) -> None:
        with self.lock:
            self.frames.append((_rank(peer), kind, json.loads(payload)))

    def records(self, rank: int | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [r for who, _, r in self.frames if rank is None or who == rank]

    def wait_for(self, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(self.records()) < count:
            assert time.monotonic() < deadline, f"only {self.records()} arrived"
            time.sleep(0.01)
        return self.records()


@pytest.fixture
def driver() -> Iterator[tuple[channel.ChannelServer, Metrics]]:
    metrics = Metrics()
    server = channel.ChannelServer("127.0.0.1", metrics, logging.getLogger("test.reporting"), TOKEN)
    try:
        yield server, metrics
    finally:
        install(None)
        server.close()


@pytest.fixture
def connect(
    driver: tuple[channel.ChannelServer, Metrics],
) -> Iterator[Callable[[int], channel.ChannelClient]]:
    """Connect a rank's client and route report() through it, as a rank's bootstrap does."""
    server, _ = driver
    clients: list[channel.ChannelClient] = []

    def rank_client(rank: int) -> channel.ChannelClient:
        client = channel.ChannelClient.connect(server.address, TOKEN, _hello(rank))
        clients.append(client)
        install(client)
        return client

    yield rank_client
    install(None)
    for client in clients:
        client.close()


def test_outside_a_run_report_warns_and_does_nothing() -> None:
    install(None)
    with pytest.warns(RuntimeWarning, match="outside a sparktorch_ops run"):
        assert report(loss=1.0, step=3, progress=0.5) is None


def test_records_arrive_with_a_per_rank_step_count(
    driver: tuple[channel.ChannelServer, Metrics], connect: Callable[[int], Any]
) -> None:
    _, metrics = driver
    before = time.time()
    connect(0)
    report(loss=0.5)
    report(loss=0.25, progress=0.5)
    report(step=10, loss=0.125)
    report(loss=0.0625, progress=1)
    rank0 = metrics.wait_for(4)
    assert [r["step"] for r in rank0] == [0, 1, 10, 11]  # an explicit step moves the count
    assert [r["values"] for r in rank0] == [
        {"loss": 0.5},
        {"loss": 0.25},
        {"loss": 0.125},
        {"loss": 0.0625},
    ]
    assert [r["progress"] for r in rank0] == [None, 0.5, None, 1.0]
    assert all(before <= r["time"] <= time.time() for r in rank0)

    connect(1)  # another rank's client: its own count from 0
    report(acc=0.9)
    metrics.wait_for(5)
    assert [r["step"] for r in metrics.records(rank=1)] == [0]
    assert len({kind for _, kind, _ in metrics.frames}) == 1  # all of them metric frames


def test_values_are_converted_to_plain_scalars(
    driver: tuple[channel.ChannelServer, Metrics], connect: Callable[[int], Any]
) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    _, metrics = driver
    connect(0)
    report(
        np_float=np.float32(0.5),
        np_int=np.int64(7),
        torch_float=torch.tensor(2.5),
        torch_int=torch.tensor(3),
        one_element=torch.tensor([[4.0]]),
        flag=True,
        np_bool=np.bool_(True),
        torch_bool=torch.tensor(False),
        name="resnet",
        nothing=None,
        integer=5,
    )
    (record,) = metrics.wait_for(1)
    values = record["values"]
    assert values == {
        "np_float": 0.5,
        "np_int": 7,
        "torch_float": 2.5,
        "torch_int": 3,
        "one_element": 4.0,
        "flag": True,
        "np_bool": True,
        "torch_bool": False,
        "name": "resnet",
        "nothing": None,
        "integer": 5,
    }
    assert type(values["np_int"]) is int and type(values["torch_int"]) is int
    assert type(values["integer"]) is int and type(values["flag"]) is bool
    assert type(values["np_bool"]) is bool and type(values["torch_bool"]) is bool


def test_non_finite_numbers_arrive_as_strings(
    driver: tuple[channel.ChannelServer, Metrics], connect: Callable[[int], Any]
) -> None:
    torch = pytest.importorskip("torch")
    _, metrics = driver
    connect(0)
    report(nan=math.nan, inf=math.inf, neg=-math.inf, tensor_nan=torch.tensor(float("nan")))
    (record,) = metrics.wait_for(1)
    assert record["values"] == {"nan": "nan", "inf": "inf", "neg": "-inf", "tensor_nan": "nan"}


@pytest.mark.parametrize("progress", [1.5, -0.1, math.nan, "0.5"])
def test_progress_outside_0_1_is_a_value_error(
    driver: tuple[channel.ChannelServer, Metrics],
    connect: Callable[[int], Any],
    progress: Any,
) -> None:
    _, metrics = driver
    connect(0)
    with pytest.raises(ValueError, match=r"progress=\.\.\.\) must be in \[0, 1\]"):
        report(progress=progress, loss=1.0)
    report(marker=1)  # the refused call sent nothing
    assert [r["values"] for r in metrics.wait_for(1)] == [{"marker": 1}]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([1, 2, 3], "expected a number, bool or str, got list"),
        ({"a": 1}, "expected a number, bool or str, got dict"),
        (object(), "expected a number, bool or str, got object"),
        (1 + 2j, "expected a number, bool or str, got complex"),
    ],
)
def test_non_scalars_are_a_type_error(
    driver: tuple[channel.ChannelServer, Metrics],
    connect: Callable[[int], Any],
    value: Any,
    match: str,
) -> None:
    _, metrics = driver
    connect(0)
    with pytest.raises(TypeError, match=rf"report\(weights=\.\.\.\): {match}"):
        report(weights=value)
    report(marker=1)
    assert [r["values"] for r in metrics.wait_for(1)] == [{"marker": 1}]


def test_many_element_tensors_are_a_type_error(connect: Callable[[int], Any]) -> None:
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    connect(0)
    with pytest.raises(TypeError, match=r"report\(weights=\.\.\.\): only scalars"):
        report(weights=torch.ones(3))
    with pytest.raises(TypeError, match=r"report\(weights=\.\.\.\): only scalars"):
        report(weights=np.ones(3))


def test_validation_happens_outside_a_run_too() -> None:
    install(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an error must come before the warning
        with pytest.raises(ValueError, match="progress"):
            report(progress=2)
        with pytest.raises(TypeError, match="weights"):
            report(weights=[1.0])


def test_reports_from_threads_all_arrive(
    driver: tuple[channel.ChannelServer, Metrics], connect: Callable[[int], Any]
) -> None:
    _, metrics = driver
    connect(0)

    def worker(offset: int) -> None:
        for i in range(50):
            report(value=offset + i)

    threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    records = metrics.wait_for(200)
    assert sorted(r["values"]["value"] for r in records) == sorted(
        k * 1000 + i for k in range(4) for i in range(50)
    )
    assert sorted(r["step"] for r in records) == list(range(200))  # no step counted twice


def test_rank_0_keeps_its_records_for_the_next_checkpoint_and_replays_them_marked(
    driver: tuple[channel.ChannelServer, Metrics],
    connect: Callable[[int], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sparktorch_ops.rank import reporting

    _, metrics = driver
    monkeypatch.setenv("RANK", "0")
    connect(0)
    report(step=0, loss=1.0)
    report(step=1, loss=0.5, progress=0.5)
    carried = reporting.records_for_checkpoint()
    assert [(r["step"], r["values"], r["progress"]) for r in carried] == [
        (0, {"loss": 1.0}, None),
        (1, {"loss": 0.5}, 0.5),
    ]
    # Younger than CARRY_S: the next checkpoint carries them again, with the new ones.
    report(step=2, loss=0.25)
    assert [r["step"] for r in reporting.records_for_checkpoint()] == [0, 1, 2]
    monkeypatch.setattr(reporting, "CARRY_S", 0.0)
    assert reporting.records_for_checkpoint() == []  # older than CARRY_S now: dropped
    monkeypatch.setattr(reporting, "CARRY_S", 300.0)

    sent = reporting.replay([*carried, {"step": "x"}, {"values": {}}])
    assert sent == 2  # the malformed ones are skipped
    frames = metrics.wait_for(5)
    assert [(r["step"], r["replayed"]) for r in frames[-2:]] == [(0, True), (1, True)]
    assert all(r["replayed"] is None for r in frames[:3])
    # What was replayed goes with the next checkpoint too.
    assert [r["step"] for r in reporting.records_for_checkpoint()] == [0, 1]


def test_other_ranks_keep_nothing(
    driver: tuple[channel.ChannelServer, Metrics],
    connect: Callable[[int], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sparktorch_ops.rank import reporting

    monkeypatch.setenv("RANK", "1")
    connect(1)
    report(step=0, loss=1.0)
    assert reporting.records_for_checkpoint() == []
