"""The original destination of a redirected TCP connection (nftables `redirect`).

A captured connection arrives at the capture listener; the kernel keeps where the child
meant to go (SO_ORIGINAL_DST, IP6T_SO_ORIGINAL_DST: core/original.py reads it), or, without a
network namespace, the connect supervisor recorded it in a Destinations table.
"""

from __future__ import annotations

import socket

from egressbox.core.original import original_destination

# Entries waiting for the proxy to accept their connection: a connect under way (or one the
# command gave up on before it completed) holds one; the oldest go first beyond this many.
# A run's command rarely has more than a few hundred connects in flight at once.
MAX_PENDING = 4096


class Destinations:
    """Where connections sent to the capture listener by the connect supervisor were going
    (runner/notify.py), keyed by the address they come from (IPv4 text, port).

    Without a network namespace there is no nftables redirect and so no SO_ORIGINAL_DST: the
    supervisor binds the command's socket, records its destination here, then connects it to
    the capture listener; the proxy takes the entry when it accepts. Written by the
    supervisor's thread, read by the event loop: a lock guards the dict.
    """

    def __init__(self, limit: int = MAX_PENDING) -> None:
        import threading

        self._limit = limit
        self._by_peer: dict[tuple[str, int], tuple[str, int]] = {}
        self._lock = threading.Lock()

    def put(self, peer: tuple[str, int], destination: tuple[str, int]) -> None:
        with self._lock:
            self._by_peer.pop(peer, None)
            self._by_peer[peer] = destination
            while len(self._by_peer) > self._limit:
                del self._by_peer[next(iter(self._by_peer))]

    def take(self, peer: tuple[str, int]) -> tuple[str, int] | None:
        """The destination of a connection from `peer`, once (None: not one of ours)."""
        with self._lock:
            return self._by_peer.pop(peer, None)

    def __len__(self) -> int:
        return len(self._by_peer)


def destination_of(conn: socket.socket, table: Destinations | None) -> tuple[str, int]:
    """Where a captured connection was going: from the supervisor's table when it sent it,
    else from the redirect (SO_ORIGINAL_DST). Raises OSError when neither knows."""
    if table is not None:
        peer = conn.getpeername()
        found = table.take((str(peer[0]).removeprefix("::ffff:"), int(peer[1])))
        if found is not None:
            return found
    return original_destination(conn)
