"""A free local TCP port for a test's own server or rank rendezvous (MASTER_PORT), asked of the
kernel by binding port 0 and releasing it: the one copy every test uses."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
