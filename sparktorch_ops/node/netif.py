"""Which network interface the ranks of a node talk over: the one Spark reaches the node on.

gloo picks its interface from the machine's host name; where that name resolves to loopback
(``127.0.0.1 myhost`` in ``/etc/hosts``, common on clusters) every rank advertises 127.0.0.1 and
ranks on other hosts cannot connect, unless ``GLOO_SOCKET_IFNAME`` names the right interface.
Spark already knows an address each executor is reachable at (the barrier task's host): the
interface holding that address is the one to use, for gloo and for NCCL's sockets alike.

:func:`interface_for` and :func:`socket_env` are pure; :func:`node_socket_env` resolves the host
and reads the machine's interfaces.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sparktorch_ops.wire.env import GLOO_IFNAME_ENV, NCCL_IFNAME_ENV

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _parse(address: str) -> _Address | None:
    """An IP address without its IPv6 zone (``fe80::1%eth0``), or None when it is not one."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None


def interface_for(address: str, interfaces: Mapping[str, Sequence[Any]]) -> str | None:
    """The interface that holds ``address``.

    Args:
        address: an IPv4 or IPv6 address.
        interfaces: interface name -> its addresses, as ``psutil.net_if_addrs()`` returns them
            (items with an ``address`` attribute; MAC entries are skipped).

    Returns:
        The first interface (in the mapping's order) holding the address; None when none does,
        or when the address is loopback or unspecified (loopback needs no interface choice, and
        a node reached on loopback talks only to itself).
    """
    wanted = _parse(address)
    if wanted is None or wanted.is_loopback or wanted.is_unspecified:
        return None
    for name, addresses in interfaces.items():
        for entry in addresses:
            if _parse(str(getattr(entry, "address", ""))) == wanted:
                return name
    return None


def socket_env(env: Mapping[str, str], interface: str | None) -> dict[str, str]:
    """The variables to add to a node's environment so its ranks use ``interface``.

    ``GLOO_SOCKET_IFNAME`` gets the name and ``NCCL_SOCKET_IFNAME`` ``=name`` (NCCL's exact
    match: a plain ``eth1`` would also take ``eth10``). Each is decided on its own: one that
    ``env`` (the node's environment with the user's ``env=`` over it) already holds, even empty,
    is the user's choice and is left alone.

    Returns:
        Only the additions (empty when ``interface`` is None).
    """
    if interface is None:
        return {}
    wanted = {GLOO_IFNAME_ENV: interface, NCCL_IFNAME_ENV: f"={interface}"}
    return {key: value for key, value in wanted.items() if key not in env}


def resolve(host: str) -> list[str]:
    """The IP addresses ``host`` resolves to here, in the resolver's order (none on failure)."""
    if _parse(host) is not None:
        return [host.split("%", 1)[0]]
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def first_interface(
    addresses: Iterable[str], interfaces: Mapping[str, Sequence[Any]]
) -> str | None:
    """The interface holding the first of ``addresses`` that any holds (:func:`interface_for`)."""
    for address in addresses:
        name = interface_for(address, interfaces)
        if name is not None:
            return name
    return None


def node_socket_env(host: str, env: Mapping[str, str]) -> dict[str, str]:
    """The socket-interface variables for a node Spark reaches at ``host`` (see :func:`socket_env`).

    Never raises: a host that does not resolve, or resolves to loopback, adds nothing.
    """
    if GLOO_IFNAME_ENV in env and NCCL_IFNAME_ENV in env:
        return {}
    import psutil

    try:
        interfaces = psutil.net_if_addrs()
    except (OSError, psutil.Error):
        return {}
    return socket_env(env, first_interface(resolve(host), interfaces))
