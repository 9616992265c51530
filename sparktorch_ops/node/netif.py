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

import ctypes
import ctypes.util
import ipaddress
import os
import socket
from collections.abc import Iterable, Mapping, Sequence

from sparktorch_ops.wire.env import GLOO_IFNAME_ENV, NCCL_IFNAME_ENV

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _parse(address: str) -> _Address | None:
    """An IP address without its IPv6 zone (``fe80::1%eth0``), or None when it is not one."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None


def interface_for(address: str, interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The interface that holds ``address``.

    Args:
        address: an IPv4 or IPv6 address.
        interfaces: interface name -> its addresses, as :func:`interface_addresses` returns
            them (entries that are not IP addresses are skipped).

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
            if _parse(entry) == wanted:
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
    addresses: Iterable[str], interfaces: Mapping[str, Sequence[str]]
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
    try:
        interfaces = interface_addresses()
    except OSError:
        return {}
    return socket_env(env, first_interface(resolve(host), interfaces))


class _Sockaddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort)]


# Where the address lies in each family's sockaddr (after the family and the port; IPv6 also
# has its flow info first): (offset, length).
_ADDRESS_BYTES = {socket.AF_INET: (4, 4), socket.AF_INET6: (8, 16)}


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("next", ctypes.POINTER(_Ifaddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_Sockaddr)),
    ("netmask", ctypes.POINTER(_Sockaddr)),
    ("broadcast_or_peer", ctypes.POINTER(_Sockaddr)),
    ("data", ctypes.c_void_p),
]


def interface_addresses() -> dict[str, list[str]]:
    """This machine's interfaces and their IPv4 and IPv6 addresses, in libc's order (the
    names and addresses gloo and NCCL see: both read ``getifaddrs`` too).

    Raises:
        OSError: libc has no ``getifaddrs`` or it failed.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if not hasattr(libc, "getifaddrs"):
        raise OSError("libc has no getifaddrs")
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"getifaddrs: {os.strerror(errno)}")
    found: dict[str, list[str]] = {}
    try:
        entry = head
        while entry:
            item = entry.contents
            name = (item.name or b"").decode(errors="replace")
            addresses = found.setdefault(name, [])
            family = item.addr.contents.family if item.addr else None
            if family in _ADDRESS_BYTES:
                offset, length = _ADDRESS_BYTES[family]
                raw = ctypes.cast(item.addr, ctypes.POINTER(ctypes.c_ubyte * (offset + length)))
                packed = bytes(raw.contents)[offset:]
                addresses.append(socket.inet_ntop(family, packed))
            entry = item.next
    finally:
        libc.freeifaddrs(head)
    return found
