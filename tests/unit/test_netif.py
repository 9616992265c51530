"""Choosing the ranks' network interface from the address Spark reaches a node at."""

from __future__ import annotations

import socket

import psutil
import pytest

from sparktorch_ops.node import netif
from sparktorch_ops.node.netif import first_interface, interface_for, node_socket_env, socket_env
from sparktorch_ops.wire.env import GLOO_IFNAME_ENV, NCCL_IFNAME_ENV

INTERFACES = {
    "lo": ["127.0.0.1", "::1"],
    "eth0": ["192.0.2.2", "fd00::2", "fe80::fc:ff:fe00:1%eth0", "02:fc:00:00:00:01"],
    "br-x": ["10.77.0.1"],
    "eth1": ["10.77.0.2"],
}


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("192.0.2.2", "eth0"),
        ("10.77.0.2", "eth1"),
        ("10.77.0.1", "br-x"),
        ("fd00::2", "eth0"),
        ("FD00:0::2", "eth0"),  # the same address, spelt otherwise
        ("fe80::fc:ff:fe00:1", "eth0"),  # a zone suffix is ignored
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
    both = {"a": ["10.0.0.5"], "b": ["10.0.0.5"]}
    assert interface_for("10.0.0.5", both) == "a"
    assert interface_for("127.0.0.1", {"lo": ["127.0.0.1"]}) is None
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
    monkeypatch.setattr(netif, "interface_addresses", lambda: INTERFACES)
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

    monkeypatch.setattr(netif, "interface_addresses", boom)
    assert node_socket_env("10.77.0.2", {GLOO_IFNAME_ENV: "a", NCCL_IFNAME_ENV: "b"}) == {}


def test_node_socket_env_survives_an_unreadable_interface_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail() -> None:
        raise OSError("no /proc")

    monkeypatch.setattr(netif, "interface_addresses", fail)
    assert node_socket_env("10.77.0.2", {}) == {}


def test_the_interface_table_is_the_one_psutil_reads() -> None:
    """libc's table read without psutil (the executors need not have it) holds the same
    interfaces and IP addresses as psutil's read of it."""
    ours = netif.interface_addresses()
    theirs = {
        name: sorted(
            entry.address.split("%", 1)[0]
            for entry in entries
            if entry.family in (socket.AF_INET, socket.AF_INET6)
        )
        for name, entries in psutil.net_if_addrs().items()
    }
    assert {name: sorted(addresses) for name, addresses in ours.items()} == theirs
    assert interface_for("127.0.0.1", ours) is None
    for name, addresses in ours.items():
        for address in addresses:
            if not netif.ipaddress.ip_address(address).is_loopback:
                assert address in ours[interface_for(address, ours) or ""], (name, address)
