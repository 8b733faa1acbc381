"""Load generator for benchmarks/proxy.py (each invocation is one process).

    python benchmarks/loadgen.py throughput --via connect --proxy H:P --target H:P --bytes N
    python benchmarks/loadgen.py setup --via socks5 --proxy H:P --target H:P --concurrency K ...
    python benchmarks/loadgen.py idle --via connect --proxy H:P --target H:P --count N

--via direct|connect|socks5: straight to the target, through an HTTP proxy
with CONNECT, or through a SOCKS5 proxy (no authentication, IPv4 target).

throughput: one tunnel to origin.py's bulk port, N bytes up (or down with
--direction down), blocking sockets and 1 MiB syscalls; prints
{"bytes", "seconds"} timed from the header to the last byte (up: to the
sink's acknowledgement that it has counted all N).

setup: K concurrent loops (uvloop, asyncio Protocols, no Task per tunnel
step) of: connect, handshake, one 64-byte echo round trip through the
tunnel, close. Prints {"event": "ready"}, waits for a line on stdin, runs
--warmup seconds unrecorded and --duration seconds recorded, then prints
{"count", "errors", "latencies_us", ...}. Latency runs from connect() to the
echo's last byte.

idle: opens --count tunnels (at most 256 handshakes in flight), checks each
with an echo round trip, prints {"event": "ready", "open", "failed"}, holds
them until a line arrives on stdin (or --hold-max seconds), closes them and
exits.

Every connection goes to 127.0.0.1; every loop ends by count or time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import resource
import socket
import struct
import sys
import time
from collections import Counter

import uvloop

CHUNK = 1 << 20
HEADER = struct.Struct("!cQ")
PAYLOAD = b"x" * 64  # the echo round trip through each short tunnel
PROBE_TIMEOUT = 10.0  # one short tunnel, connect to echo
IDLE_IN_FLIGHT = 256  # concurrent handshakes while opening idle tunnels
GRACE = 20.0  # a setup run ends this long after its deadline, whatever is pending


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def raise_nofile() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def parse_addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


class HandshakeError(Exception):
    pass


def connect_request(target: tuple[str, int]) -> bytes:
    authority = f"{target[0]}:{target[1]}"
    return f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()


def socks_request(target: tuple[str, int]) -> bytes:
    packed = ipaddress.IPv4Address(target[0]).packed
    return b"\x05\x01\x00\x01" + packed + struct.pack("!H", target[1])


SOCKS_GREETING = b"\x05\x01\x00"  # version 5, one method: no authentication
_SOCKS_ADDR_LEN = {1: 4, 4: 16}


def socks_reply_length(buf: bytes) -> int:
    """Length of a complete SOCKS5 reply at the start of buf, or 0 if incomplete."""
    if len(buf) < 5:
        return 0
    if buf[0] != 5 or buf[1] != 0:
        raise HandshakeError(f"SOCKS5 reply {buf[:2].hex()}")
    atyp = buf[3]
    if atyp == 3:
        size = 4 + 1 + buf[4] + 2
    elif atyp in _SOCKS_ADDR_LEN:
        size = 4 + _SOCKS_ADDR_LEN[atyp] + 2
    else:
        raise HandshakeError(f"SOCKS5 reply address type {atyp}")
    return size if len(buf) >= size else 0


def check_connect_reply(head: bytes) -> None:
    parts = head.split(b" ", 2)
    if len(parts) < 2 or parts[1] != b"200":
        raise HandshakeError(f"CONNECT reply {head[:60]!r}")


# --- throughput (blocking) ---------------------------------------------------------------


def blocking_handshake(sock: socket.socket, via: str, target: tuple[str, int]) -> None:
    if via == "connect":
        sock.sendall(connect_request(target))
        buf = b""
        while b"\r\n\r\n" not in buf:
            got = sock.recv(4096)
            if not got:
                raise HandshakeError("closed during CONNECT")
            buf += got
        head, _, rest = buf.partition(b"\r\n\r\n")
        check_connect_reply(head)
        if rest:
            raise HandshakeError("bytes after the CONNECT reply")
    elif via == "socks5":
        sock.sendall(SOCKS_GREETING)
        if sock.recv(2) != b"\x05\x00":
            raise HandshakeError("SOCKS5 method refused")
        sock.sendall(socks_request(target))
        buf = b""
        while not (size := socks_reply_length(buf)):
            got = sock.recv(512)
            if not got:
                raise HandshakeError("closed during the SOCKS5 request")
            buf += got
        if len(buf) != size:
            raise HandshakeError("bytes after the SOCKS5 reply")


def role_throughput(args: argparse.Namespace) -> None:
    target = parse_addr(args.target)
    dial = target if args.via == "direct" else parse_addr(args.proxy)
    chunk = memoryview(bytearray(CHUNK))
    size: int = args.bytes
    with socket.create_connection(dial, timeout=60.0) as sock:
        blocking_handshake(sock, args.via, target)
        started = time.perf_counter()
        if args.direction == "up":
            sock.sendall(HEADER.pack(b"U", size))
            left = size
            while left:
                n = min(left, CHUNK)
                sock.sendall(chunk[:n])
                left -= n
            if sock.recv(1) != b"K":
                raise HandshakeError("the sink did not acknowledge")
        else:
            sock.sendall(HEADER.pack(b"D", size))
            left = size
            while left:
                got = sock.recv_into(chunk[: min(left, CHUNK)])
                if not got:
                    raise HandshakeError("closed before the last byte")
                left -= got
        seconds = time.perf_counter() - started
    emit({"bytes": size, "seconds": seconds})


# --- tunnels as asyncio Protocols -------------------------------------------------------


class Probe(asyncio.Protocol):
    """One tunnel: handshake, then one echo round trip; `ready` resolves after the echo."""

    def __init__(self, via: str, target: tuple[str, int], ready: asyncio.Future[None]) -> None:
        self.via = via
        self.target = target
        self.ready = ready
        self.buf = b""
        self.state = "new"
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.via == "connect":
            self.send(connect_request(self.target), "head")
        elif self.via == "socks5":
            self.send(SOCKS_GREETING, "method")
        else:
            self.send(PAYLOAD, "echo")

    def send(self, data: bytes, state: str) -> None:
        assert self.transport is not None
        self.state = state
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        try:
            self.advance()
        except HandshakeError as exc:
            self.fail(exc)

    def advance(self) -> None:
        if self.state == "head":
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            check_connect_reply(self.buf[:end])
            self.buf = self.buf[end + 4 :]
            self.send(PAYLOAD, "echo")
        elif self.state == "method":
            if len(self.buf) < 2:
                return
            if self.buf[:2] != b"\x05\x00":
                raise HandshakeError("SOCKS5 method refused")
            self.buf = self.buf[2:]
            self.send(socks_request(self.target), "reply")
        elif self.state == "reply":
            size = socks_reply_length(self.buf)
            if not size:
                return
            self.buf = self.buf[size:]
            self.send(PAYLOAD, "echo")
        if self.state == "echo" and len(self.buf) >= len(PAYLOAD):
            self.state = "open"
            self.buf = b""
            if not self.ready.done():
                self.ready.set_result(None)

    def fail(self, exc: Exception) -> None:
        if not self.ready.done():
            self.ready.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ready.done():
            self.ready.set_exception(exc or ConnectionError(f"closed in state {self.state}"))
        self.state = "closed"


async def open_probe(
    via: str, dial: tuple[str, int], target: tuple[str, int]
) -> tuple[asyncio.Transport, Probe]:
    """A tunnel that has passed its echo round trip (raises on failure or timeout)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    probe = Probe(via, target, ready)
    # One timer bounds the whole tunnel (no wait_for: it would cost a Task per tunnel).
    timer = loop.call_later(PROBE_TIMEOUT, probe.fail, TimeoutError("tunnel timed out"))
    try:
        transport, _ = await loop.create_connection(lambda: probe, dial[0], dial[1])
        await ready
    except BaseException:
        if probe.transport is not None:
            probe.transport.abort()
        raise
    finally:
        timer.cancel()
    return transport, probe


def error_name(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:120]


# --- setup ---------------------------------------------------------------------------------


async def wait_for_go() -> None:
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)


async def setup_run(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    target = parse_addr(args.target)
    dial = target if args.via == "direct" else parse_addr(args.proxy)
    emit({"event": "ready"})
    await wait_for_go()
    began = loop.time()
    cpu_began = cpu_seconds()
    measure_from = began + args.warmup
    end = measure_from + args.duration
    latencies: list[int] = []
    errors: Counter[str] = Counter()

    async def loop_one() -> None:
        while loop.time() < end:
            started = time.perf_counter()
            try:
                transport, _ = await open_probe(args.via, dial, target)
            except (OSError, HandshakeError, TimeoutError) as exc:
                errors[error_name(exc)] += 1
                await asyncio.sleep(0.01)  # do not spin on an instant refusal
                continue
            finished = time.perf_counter()
            transport.close()
            if measure_from <= loop.time() <= end:
                latencies.append(round((finished - started) * 1e6))

    tasks = [loop.create_task(loop_one()) for _ in range(args.concurrency)]
    _, pending = await asyncio.wait(tasks, timeout=args.warmup + args.duration + GRACE)
    for task in pending:
        task.cancel()
    emit(
        {
            "cpu_seconds": cpu_seconds() - cpu_began,
            "elapsed": loop.time() - began,
            "count": len(latencies),
            "duration": args.duration,
            "errors": sum(errors.values()),
            "error_kinds": dict(errors.most_common(5)),
            "latencies_us": latencies,
        }
    )


# --- idle ----------------------------------------------------------------------------------


async def idle_run(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    target = parse_addr(args.target)
    dial = target if args.via == "direct" else parse_addr(args.proxy)
    gate = asyncio.Semaphore(IDLE_IN_FLIGHT)
    held: list[asyncio.Transport] = []
    errors: Counter[str] = Counter()

    async def open_one() -> None:
        async with gate:
            try:
                transport, _ = await open_probe(args.via, dial, target)
            except (OSError, HandshakeError, TimeoutError) as exc:
                errors[error_name(exc)] += 1
                return
            held.append(transport)

    started = loop.time()
    await asyncio.gather(*(open_one() for _ in range(args.count)))
    emit(
        {
            "event": "ready",
            "open": len(held),
            "failed": sum(errors.values()),
            "error_kinds": dict(errors.most_common(5)),
            "seconds": loop.time() - started,
        }
    )
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wait_for_go(), args.hold_max)
    for transport in held:
        transport.close()
    await asyncio.sleep(0.2)
    emit({"event": "closed"})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=["throughput", "setup", "idle"])
    parser.add_argument("--via", choices=["direct", "connect", "socks5"], required=True)
    parser.add_argument("--proxy", default="", help="HOST:PORT of the proxy")
    parser.add_argument("--target", required=True, help="HOST:PORT of the origin")
    parser.add_argument("--bytes", type=int, default=1 << 30)
    parser.add_argument("--direction", choices=["up", "down"], default="up")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.3)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--hold-max", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.via != "direct" and not args.proxy:
        parser.error("--proxy is required unless --via direct")
    raise_nofile()
    if args.role == "throughput":
        role_throughput(args)
    elif args.role == "setup":
        uvloop.run(setup_run(args))
    else:
        uvloop.run(idle_run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
