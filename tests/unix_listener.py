"""A pathname unix socket on the host that counts the connections it accepts: a test sees from
the host side whether a confined child reached it."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

# The accept loop's tick (how quickly it notices it should stop), and the join bound.
TICK = 0.1
JOIN_TIMEOUT = 5.0


class UnixListener:
    """Listens at `path` (mode 0777, so another user may connect); accepts and closes each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.sock.settimeout(TICK)
        os.chmod(path, 0o777)
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> int:
        """Stop listening; the number of connections accepted."""
        self._stop.set()
        self._thread.join(timeout=JOIN_TIMEOUT)
        self.sock.close()
        return self.accepted
