"""Loopback origin servers for benchmarks/proxy.py (each role runs in its own process).

    python benchmarks/origin.py bulk     # sink/source for one-tunnel throughput
    python benchmarks/origin.py serve    # echo + small-response HTTP origin (uvloop)

Each role binds 127.0.0.1 on a free port, prints one JSON line with its
port(s) and serves until it is killed.

bulk: a blocking, thread-per-connection server. The client sends a 9-byte
header, b"U" or b"D" and a big-endian u64 N. "U": the server reads exactly N
bytes, then answers one byte (b"K"). "D": the server sends N bytes. Either way
it then reads until the client closes.

serve: one uvloop process with two listeners. The echo port writes back
whatever it reads. The HTTP port answers every request head with a fixed
small response (keep-alive unless the request asks for close or is
HTTP/1.0 without keep-alive); it ignores request bodies, which the benchmark
never sends.
"""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import struct
import sys
import threading

import uvloop

HOST = "127.0.0.1"
CHUNK = 1 << 20  # bytes per send/recv syscall on the bulk port
BACKLOG = 4096  # net.core.somaxconn's default: bursts of 128 concurrent connects
HEADER = struct.Struct("!cQ")
BODY = b"hello, proxy\n"
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
    + str(len(BODY)).encode()
    + b"\r\n\r\n"
    + BODY
)
RESPONSE_CLOSE = RESPONSE.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def raise_nofile() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def read_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        got = conn.recv(size - len(data))
        if not got:
            raise ConnectionError("closed before the header")
        data += got
    return data


# --- bulk ------------------------------------------------------------------------------


def bulk_connection(conn: socket.socket) -> None:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with conn:
        try:
            mode, size = HEADER.unpack(read_exact(conn, HEADER.size))
            if mode == b"U":
                left = size
                while left:
                    got = conn.recv_into(view[: min(left, CHUNK)])
                    if not got:
                        return
                    left -= got
                conn.sendall(b"K")
            elif mode == b"D":
                left = size
                while left:
                    n = min(left, CHUNK)
                    conn.sendall(view[:n])
                    left -= n
            while conn.recv_into(buf):
                pass
        except OSError:
            return


def role_bulk() -> None:
    raise_nofile()
    server = socket.create_server((HOST, 0), backlog=BACKLOG)
    emit({"bulk": server.getsockname()[1]})
    while True:
        conn, _ = server.accept()
        threading.Thread(target=bulk_connection, args=(conn,), daemon=True).start()


# --- echo and HTTP -----------------------------------------------------------------------


class Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[attr-defined]

    def eof_received(self) -> bool:
        return False  # close


class Http(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > 65536:
                    self.transport.close()
                return
            head, self.buf = self.buf[:end].lower(), self.buf[end + 4 :]
            line_end = head.find(b"\r\n")
            line = head if line_end < 0 else head[:line_end]
            close = b"connection: close" in head or (
                line.endswith(b"http/1.0") and b"connection: keep-alive" not in head
            )
            if close:
                self.transport.write(RESPONSE_CLOSE)  # type: ignore[attr-defined]
                self.transport.close()
                return
            self.transport.write(RESPONSE)  # type: ignore[attr-defined]


async def serve() -> None:
    loop = asyncio.get_running_loop()
    echo = await loop.create_server(Echo, HOST, 0, backlog=BACKLOG)
    http = await loop.create_server(Http, HOST, 0, backlog=BACKLOG)
    emit(
        {
            "echo": echo.sockets[0].getsockname()[1],
            "http": http.sockets[0].getsockname()[1],
        }
    )
    await asyncio.Event().wait()  # until killed


def main(argv: list[str]) -> int:
    if argv == ["bulk"]:
        role_bulk()
    elif argv == ["serve"]:
        raise_nofile()
        uvloop.run(serve())
    else:
        print("usage: origin.py bulk|serve", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
