"""Waiting for a server process (HAProxy, squid) to listen, without connecting to it.

A probe connection would show up in the server's own logs and counters (squid logs an
`error:transaction-end-before-headers` line for it, HAProxy passes it on to its backend),
so readiness is read from the kernel's socket table instead. Bounded in time.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterable

POLL = 0.05


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the caller binds it soon after)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def listening_ports() -> set[int]:
    """TCP ports some socket listens on (IPv4 and IPv6), from /proc/net/tcp{,6}."""
    found: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                for row in list(rows)[1:]:
                    fields = row.split()
                    if fields[3] == "0A":  # TCP_LISTEN
                        found.add(int(fields[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return found


def wait_listening(ports: Iterable[int], proc: subprocess.Popen[bytes], timeout: float) -> str:
    """ "" once every port listens; else why not (the process exited, or the time ran out)."""
    wanted = set(ports)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with status {proc.returncode}"
        if wanted <= listening_ports():
            return ""
        time.sleep(POLL)
    return f"not listening on {sorted(wanted)} within {timeout:g} s"
