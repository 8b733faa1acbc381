"""A listener that records the first bytes of every connection it accepts.

Confinement tests judge a child's connects from the host side: what reached a listener is what
the child could reach. One helper for TCP and unix listeners alike; it may answer each
connection (an HTTP origin) or only record (a trap).
"""

from __future__ import annotations

import contextlib
import socket
import threading

ORIGIN_ANSWER = b"HTTP/1.0 200 OK\r\nContent-Length: 6\r\n\r\norigin"
READ_TIMEOUT = 5.0  # seconds a connection's first bytes may take
FIRST_BYTES = 1000  # what is kept of each connection


class Recording:
    """Serves `sock` (bound and listening) on a thread of its own until closed; `accepted`
    holds each connection's first bytes (b"" when it sent nothing readable)."""

    def __init__(self, sock: socket.socket, answer: bytes = b"") -> None:
        self.sock = sock
        self.answer = answer
        # Kept: tests read the port after the listener is closed. (A unix socket's name is not
        # a pair: 0 then.)
        name = sock.getsockname()
        self.port: int = name[1] if isinstance(name, tuple) else 0
        self.accepted: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def paths(self) -> list[str]:
        """The request paths of the HTTP requests recorded, sorted."""
        return sorted(line.split(b" ")[1].decode() for line in self.accepted if line)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(READ_TIMEOUT)
                try:
                    self.accepted.append(conn.recv(FIRST_BYTES))
                    if self.answer:
                        conn.sendall(self.answer)
                except OSError:
                    self.accepted.append(b"")

    def close(self) -> None:
        # shutdown wakes the blocked accept(); close alone does not on Linux.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=READ_TIMEOUT)
