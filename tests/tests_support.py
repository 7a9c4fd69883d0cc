"""Small helpers shared by tests (importable because pytest puts tests/ on sys.path via conftest)."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
