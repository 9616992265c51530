"""Hostile clients against a live run: every listening port of the run gets garbage, and the
run still returns rank 0's value.

The channel gets more than 30 kinds of garbage (random bytes, absurd length prefixes, every
frame type first, HELLOs with bad MACs and hostile JSON, slow and half-closed and reset
connections, TLS and HTTP greetings, a crowd of idle connections, and, holding the run's secret,
malformed JSON in every frame a rank sends); the rendezvous store torchrun hosts gets the raw
kinds. The ranks wait in a collective until the fuzzing is over, then finish.
"""

from __future__ import annotations

import glob
import hashlib
import hmac
import json
import os
import random
import re
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from sparktorch_ops import TorchDistributor
from sparktorch_ops.events import CHANNEL_OPEN, PhaseEvent
from sparktorch_ops.wire import channel, messages
from sparktorch_ops.wire.env import RUN_ID_ENV

Address = tuple[str, int]
HEADER = struct.Struct("!BI")


def frame(kind: int, payload: bytes, length: int | None = None) -> bytes:
    return HEADER.pack(kind, len(payload) if length is None else length) + payload


def _send(address: Address, data: bytes, *, read_challenge: bool = False) -> None:
    with socket.create_connection(address, timeout=5) as sock:
        if read_challenge:
            sock.recv(64)
        try:
            sock.sendall(data)
            sock.settimeout(channel.HELLO_DEADLINE_S + 3)
            while sock.recv(65536):  # until the server drops us
                pass
        except OSError:
            pass


def _raw(data: bytes, **kw: bool) -> Callable[[Address], None]:
    return lambda address: _send(address, data, **kw)


def _bad_mac_hello(body: bytes) -> Callable[[Address], None]:
    return _raw(frame(messages.HELLO, b"\0" * 32 + body), read_challenge=True)


def _wrong_secret_hello(address: Address) -> None:
    with socket.create_connection(address, timeout=5) as sock:
        nonce = sock.recv(64)[5:]
        body = json.dumps({"role": "worker", "rank": 0, "nonce": "00" * 32}).encode()
        mac = hmac.new(b"guess", b"sparktorch-ops hello\0" + nonce + body, hashlib.sha256)
        sock.sendall(frame(messages.HELLO, mac.digest() + body))
        sock.settimeout(5)
        assert sock.recv(64) == b""  # no WELCOME: closed


def _slowloris(address: Address) -> None:
    data = frame(messages.HELLO, b"\0" * 32 + b'{"role": "worker", "rank": 0}')
    with socket.create_connection(address, timeout=5) as sock:
        try:
            for byte in data:
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
        except OSError:
            return  # dropped at the deadline, as it should be


def _reset(address: Address) -> None:
    sock = socket.create_connection(address, timeout=5)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.send(b"\x01\x00")
    sock.close()  # RST


def _half_close(address: Address) -> None:
    with socket.create_connection(address, timeout=5) as sock:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(5)
        while sock.recv(4096):
            pass


def _connect_and_leave(address: Address) -> None:
    socket.create_connection(address, timeout=5).close()


def _tls_hello(address: Address) -> None:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(address, timeout=5) as sock:
        try:
            context.wrap_socket(sock).close()
        except (ssl.SSLError, OSError):
            pass


def _crowd(address: Address, size: int = 200) -> None:
    crowd = []
    for _ in range(size):
        try:
            crowd.append(socket.create_connection(address, timeout=5))
        except OSError:
            break
    time.sleep(channel.HELLO_DEADLINE_S + 1)
    for sock in crowd:
        sock.close()


CROWD = "crowd of 200 idle connections"
HOSTILE_JSON = [
    b"[" * 100_000,
    b'{"token": "\\ud800", "role": "worker"}',
    b'{"role": "worker", "rank": 1e999, "nonce": "zz"}',
    b'{"step": NaN, "values": {"a": {"b": []}}}',
]

CHANNEL_KINDS: dict[str, Callable[[Address], None]] = {
    "random 1 byte": _raw(os.urandom(1)),
    "random 5 bytes": _raw(os.urandom(5)),
    "random 4 KiB": _raw(os.urandom(4096)),
    "random 1 MiB": _raw(os.urandom(1 << 20)),
    "HELLO claiming 4 GiB": _raw(frame(messages.HELLO, b"", length=0xFFFFFFFF)),
    "HELLO over its size cap": _raw(frame(messages.HELLO, b"x" * 5000)),
    "STDOUT claiming 2 GiB first": _raw(frame(messages.STDOUT, b"", length=1 << 31)),
    "empty HELLO": _raw(frame(messages.HELLO, b""), read_challenge=True),
    "HELLO shorter than a MAC": _raw(frame(messages.HELLO, b"{}"), read_challenge=True),
    "HELLO before reading the challenge": _raw(frame(messages.HELLO, b"\0" * 40)),
    "HELLO with a wrong secret": _wrong_secret_hello,
    "slow HELLO, a byte at a time": _slowloris,
    "connect and close": _connect_and_leave,
    "connect and reset": _reset,
    "half-close": _half_close,
    "TLS ClientHello": _tls_hello,
    "HTTP GET": _raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
    CROWD: _crowd,
}
for _i, _body in enumerate(HOSTILE_JSON):
    CHANNEL_KINDS[f"HELLO with bad MAC and hostile JSON #{_i}"] = _bad_mac_hello(_body)
for _kind in (0, *range(2, 12), 255):  # every frame type but HELLO, first, with hostile JSON
    CHANNEL_KINDS[f"frame kind {_kind} first"] = _raw(
        frame(_kind, HOSTILE_JSON[_kind % len(HOSTILE_JSON)]), read_challenge=True
    )


def _as_authenticated_stranger(secret: str, kind: int, payload: bytes) -> Callable[[Address], None]:
    """Holding the secret (read from the run's 0600 file, as a same-user process could), send
    one malformed frame as a worker that does not exist: that connection alone is closed."""

    def attack(address: Address) -> None:
        client = channel.ChannelClient.connect(
            channel.join_address(*address), secret, messages.Hello(role="worker", rank=7)
        )
        try:
            client.send(kind, payload)
            client._sock.settimeout(5)
            assert client._sock.recv(64) == b"", "a malformed frame did not close its connection"
        finally:
            client.close()

    return attack


def _rendezvous_ports(run_id: str, channel_port: int) -> list[Address]:
    """TCP ports the run's own processes listen on (torchrun's store), not the channel."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(RUN_ID_ENV) != run_id:
                continue
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port != channel_port:
                    found.append(("127.0.0.1", conn.laddr.port))
        except (psutil.Error, OSError):
            continue
    return sorted(set(found))


def wait_for_release(marker: str) -> dict[str, object]:
    """Rank code: a collective, then wait until the fuzzing is over, then another. Also says
    what of its environment could be a secret (what a ``print(os.environ)`` would show)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    deadline = time.monotonic() + 240
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return {
        "sum": int(total.item()),
        "world": int(os.environ["WORLD_SIZE"]),
        "secret_like": sorted(
            f"{k}={v}"
            for k, v in os.environ.items()
            if "SECRET" in k or "TOKEN" in k or re.fullmatch("[0-9a-f]{64}", v)
        ),
    }


def test_garbage_on_every_port_of_a_live_run_does_not_break_it(tmp_path: Path) -> None:
    marker = str(tmp_path / "fuzzing-done")
    opened: list[PhaseEvent] = []
    ready = threading.Event()

    def on_event(event: PhaseEvent) -> None:
        if event.name == CHANNEL_OPEN:
            opened.append(event)
        if event.name == "running":
            ready.set()

    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = TorchDistributor(
                num_processes=2, local_mode=True, use_gpu=False, on_event=on_event
            ).run(wait_for_release, marker)
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            ready.set()

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    tried: list[str] = []
    secret = ""
    try:
        assert ready.wait(180), "the run never started"
        assert opened, f"no channel: {outcome}"
        run_id = opened[0].run_id
        host, port = channel.split_address(opened[0].detail["address"])
        address = (host, port)
        kinds = dict(CHANNEL_KINDS)
        (secret_file,) = glob.glob(os.path.join(tempfile.gettempdir(), f"{run_id}-*", "*.secret"))
        secret = Path(secret_file).read_text()
        assert len(secret) == 64
        authenticated = [
            (messages.METRIC, b'{"step": "x"}'),
            (messages.EXIT, b"[" * 50_000),
            (messages.FAILURE, b'{"type": 1}'),
            (messages.METRIC, b'{"step": 1, "time": 0, "values": {"a": [1]}}'),
            (messages.EXIT, b'{"exit_code": "zero"}'),
        ]
        for number, (kind, payload) in enumerate(authenticated):
            attack = _as_authenticated_stranger(secret, kind, payload)
            kinds[f"authenticated stranger #{number}, frame kind {kind}"] = attack
        random.seed(7)
        names = [name for name in kinds if name != CROWD]
        random.shuffle(names)
        # Eight hostile clients at a time (each waits until it is dropped, up to the hello
        # deadline): well under the cap on unauthenticated connections, which the crowd of
        # 200, alone afterwards, runs into on purpose.
        with ThreadPoolExecutor(max_workers=8) as pool:
            attacks = {name: pool.submit(kinds[name], address) for name in names}
            for name, attack in attacks.items():
                attack.result()
                tried.append(name)
        kinds[CROWD](address)
        tried.append(CROWD)
        store_ports = _rendezvous_ports(run_id, port)
        assert store_ports, "found no rendezvous store port of the run to fuzz"
        # The stores are torch's: they ignore garbage rather than drop it, so each of these
        # waits out its socket timeout; all at once.
        store_kinds = ("random 4 KiB", "HELLO claiming 4 GiB", "connect and reset", "HTTP GET")
        with ThreadPoolExecutor(max_workers=len(store_ports) * len(store_kinds)) as pool:
            store_attacks = {
                f"store {store[1]}: {name}": pool.submit(CHANNEL_KINDS[name], store)
                for store in store_ports
                for name in store_kinds
            }
            for name, attack in store_attacks.items():
                attack.result()
                tried.append(name)
        assert "error" not in outcome and runner.is_alive(), f"the run ended early: {outcome}"
    finally:
        Path(marker).touch()
        runner.join(180)
    assert not runner.is_alive(), "the run did not finish after the fuzzing"
    value = outcome.get("value")
    assert isinstance(value, dict), (outcome, tried)
    assert (value["sum"], value["world"]) == (3, 2)
    assert value["secret_like"] == [] and secret not in str(value), value
    on_channel = [t for t in tried if not t.startswith("store")]
    print(
        f"survived {len(on_channel)} kinds on the channel, {len(tried) - len(on_channel)} on stores"
    )
    assert len(on_channel) >= 30, tried
