"""Choosing the ranks' network interface from the address Spark reaches a node at."""

from __future__ import annotations

import socket
from typing import NamedTuple

import psutil
import pytest

from sparktorch_ops.node import netif
from sparktorch_ops.node.netif import first_interface, interface_for, node_socket_env, socket_env
from sparktorch_ops.wire.env import GLOO_IFNAME_ENV, NCCL_IFNAME_ENV

AF_LINK = psutil.AF_LINK


class Addr(NamedTuple):
    """The shape of one ``psutil.net_if_addrs()`` entry."""

    family: int
    address: str
    netmask: str | None = None
    broadcast: str | None = None
    ptp: str | None = None


def addr(family: int, address: str) -> Addr:
    return Addr(family, address)


INTERFACES = {
    "lo": [addr(socket.AF_INET, "127.0.0.1"), addr(socket.AF_INET6, "::1")],
    "eth0": [
        addr(socket.AF_INET, "192.0.2.2"),
        addr(socket.AF_INET6, "fd00::2"),
        addr(socket.AF_INET6, "fe80::fc:ff:fe00:1%eth0"),
        addr(AF_LINK, "02:fc:00:00:00:01"),
    ],
    "br-x": [addr(socket.AF_INET, "10.77.0.1")],
    "eth1": [addr(socket.AF_INET, "10.77.0.2")],
}


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("192.0.2.2", "eth0"),
        ("10.77.0.2", "eth1"),
        ("10.77.0.1", "br-x"),
        ("fd00::2", "eth0"),
        ("FD00:0::2", "eth0"),  # the same address, spelt otherwise
        ("fe80::fc:ff:fe00:1", "eth0"),  # psutil's zone suffix is ignored
        ("fe80::fc:ff:fe00:1%eth0", "eth0"),
        ("10.77.0.3", None),  # nobody here holds it
        ("127.0.0.1", None),  # loopback: nothing to choose
        ("127.0.1.1", None),
        ("::1", None),
        ("0.0.0.0", None),
        ("02:fc:00:00:00:01", None),  # a MAC is not an IP address
        ("myhost", None),
        ("", None),
    ],
)
def test_interface_for_finds_the_interface_holding_the_address(
    address: str, expected: str | None
) -> None:
    assert interface_for(address, INTERFACES) == expected


def test_interface_for_takes_the_first_holder_and_ignores_loopback_even_on_lo() -> None:
    both = {"a": [addr(socket.AF_INET, "10.0.0.5")], "b": [addr(socket.AF_INET, "10.0.0.5")]}
    assert interface_for("10.0.0.5", both) == "a"
    assert interface_for("127.0.0.1", {"lo": [addr(socket.AF_INET, "127.0.0.1")]}) is None
    assert interface_for("10.0.0.5", {}) is None


def test_first_interface_tries_each_address_in_order() -> None:
    assert first_interface(["127.0.0.1", "10.9.9.9", "10.77.0.2"], INTERFACES) == "eth1"
    assert first_interface(["127.0.0.1"], INTERFACES) is None
    assert first_interface([], INTERFACES) is None


def test_socket_env_sets_both_when_the_user_set_neither() -> None:
    assert socket_env({"PATH": "/bin"}, "eth1") == {
        GLOO_IFNAME_ENV: "eth1",
        NCCL_IFNAME_ENV: "=eth1",
    }


def test_socket_env_each_variable_is_the_users_when_set() -> None:
    assert socket_env({GLOO_IFNAME_ENV: "ib0"}, "eth1") == {NCCL_IFNAME_ENV: "=eth1"}
    assert socket_env({NCCL_IFNAME_ENV: "^docker"}, "eth1") == {GLOO_IFNAME_ENV: "eth1"}
    both = {GLOO_IFNAME_ENV: "ib0", NCCL_IFNAME_ENV: "ib"}
    assert socket_env(both, "eth1") == {}
    # Set but empty is still the user's choice (torch then picks by host name, as without us).
    assert socket_env({GLOO_IFNAME_ENV: "", NCCL_IFNAME_ENV: ""}, "eth1") == {}


def test_socket_env_adds_nothing_without_an_interface() -> None:
    assert socket_env({}, None) == {}


def test_resolve_keeps_ip_literals_and_never_raises() -> None:
    assert netif.resolve("10.77.0.2") == ["10.77.0.2"]
    assert netif.resolve("fe80::1%eth0") == ["fe80::1"]
    assert "127.0.0.1" in netif.resolve("localhost")
    assert netif.resolve("no-such-host.invalid") == []


def test_node_socket_env_uses_this_machines_interfaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: INTERFACES)
    assert node_socket_env("10.77.0.2", {}) == {GLOO_IFNAME_ENV: "eth1", NCCL_IFNAME_ENV: "=eth1"}
    assert node_socket_env("10.77.0.2", {GLOO_IFNAME_ENV: "x"}) == {NCCL_IFNAME_ENV: "=eth1"}
    # Loopback (local[N], local-cluster on 127.0.0.1) and unknown hosts add nothing.
    assert node_socket_env("127.0.0.1", {}) == {}
    assert node_socket_env("localhost", {}) == {}
    assert node_socket_env("no-such-host.invalid", {}) == {}


def test_node_socket_env_reads_nothing_when_the_user_set_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def boom() -> None:
        raise AssertionError("interfaces read although the user set both")

    monkeypatch.setattr(psutil, "net_if_addrs", boom)
    assert node_socket_env("10.77.0.2", {GLOO_IFNAME_ENV: "a", NCCL_IFNAME_ENV: "b"}) == {}


def test_node_socket_env_survives_an_unreadable_interface_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail() -> None:
        raise OSError("no /proc")

    monkeypatch.setattr(psutil, "net_if_addrs", fail)
    assert node_socket_env("10.77.0.2", {}) == {}


def test_the_real_interface_table_has_the_shape_we_read() -> None:
    table = psutil.net_if_addrs()
    assert interface_for("127.0.0.1", table) is None
    for entries in table.values():
        for entry in entries:
            if entry.family == socket.AF_INET and not entry.address.startswith("127."):
                holder = interface_for(entry.address, table)
                assert holder is not None
                assert entry.address in [e.address for e in table[holder]]
