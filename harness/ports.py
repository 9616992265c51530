"""Free ports for the services the tests and benchmarks start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port that was free a moment ago (fine for daemons that fail loudly if taken)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
