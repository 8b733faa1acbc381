"""The least a CONNECT proxy on uvloop can do: a reference floor, not a proxy.

    .venv/bin/python benchmarks/floor_proxy.py     # prints {"http": "127.0.0.1:PORT"}

It finds the end of the request head, dials the `host:port` of the request
line as written, answers 200 and relays with half-close. No parser beyond
that, no policy, no DNS, no audit record, no limits, no timeouts, no
accounting: everything egressbox does per tunnel is left out. benchmarks/
proxy.py runs it beside egressbox so that the cost of that work shows as the
difference between two rows of one run, on the same event loop (uvloop), the
same Python and the same machine, and uvloop imported the way egressbox imports
it (egressbox.net.eventloop: its table of transports compiled), so that the floor
stays a floor. Listens on 127.0.0.1 only; never use it as a proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys

from egressbox.net.eventloop import import_uvloop

uvloop = import_uvloop()

HOST = "127.0.0.1"
HEAD_END = b"\r\n\r\n"
ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"


class _Half(asyncio.Protocol):
    """One side of a tunnel: bytes and EOF go to the peer; the last EOF closes both."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Half | None = None
        self.eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None and not peer.transport.is_closing():
            peer.transport.write(data)

    def eof_received(self) -> bool:
        self.eof = True
        peer = self.peer
        if peer is None or peer.transport is None or peer.transport.is_closing():
            return False
        peer.transport.write_eof()
        if peer.eof:
            peer.transport.close()
            return False  # closes this side too
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None and not peer.transport.is_closing():
            peer.transport.close()


class _Client(_Half):
    """The client side: reads the head, dials, then relays like any side."""

    def __init__(self) -> None:
        super().__init__()
        self.head = b""

    def data_received(self, data: bytes) -> None:
        if self.peer is not None:
            super().data_received(data)
            return
        self.head += data
        end = self.head.find(HEAD_END)
        if end < 0:
            return
        try:
            target = self.head.split(b" ", 2)[1].decode("ascii")
            host, _, port = target.rpartition(":")
            port_number = int(port)
        except (IndexError, UnicodeDecodeError, ValueError):
            self.close()
            return
        rest = self.head[end + len(HEAD_END) :]
        upstream = _Half()
        upstream.peer, self.peer = self, upstream
        assert self.transport is not None
        self.transport.pause_reading()
        loop = asyncio.get_running_loop()
        dial = loop.create_task(loop.create_connection(lambda: upstream, host, port_number))
        dial.add_done_callback(lambda task: self._dialed(task, rest))

    def _dialed(self, task: asyncio.Task[object], rest: bytes) -> None:
        transport = self.transport
        if task.cancelled() or task.exception() is not None:
            self.close()
            return
        if transport is None or transport.is_closing():
            task.result()[0].close()  # type: ignore[index]
            return
        transport.write(ESTABLISHED)
        if rest:
            assert self.peer is not None and self.peer.transport is not None
            self.peer.transport.write(rest)
        transport.resume_reading()

    def eof_received(self) -> bool:
        if self.peer is None or self.peer.transport is None:
            return False  # EOF before the tunnel exists: close
        return super().eof_received()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def serve() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Client, HOST, 0, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    print(json.dumps({"http": f"{HOST}:{port}"}), flush=True)
    await asyncio.Event().wait()


def main() -> int:
    with contextlib.suppress(KeyboardInterrupt):
        assert uvloop is not None, "the floor runs on uvloop"
        uvloop.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
