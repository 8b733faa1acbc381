"""EgressProxy in-process under hostile and heavy clients, on asyncio and uvloop.

Every scenario runs in a fresh event loop of each kind, with real loopback
sockets: malformed and abusive clients must never crash the server nor leak a
descriptor; the limits (head timeout, idle timeout, max connections) free
their slots; an audit sink failure closes the door; close() drains; and a
denied destination is never dialled, also under concurrent load. Nothing
leaves 127.0.0.0/8.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import os
import random
import socket
import struct
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import pytest
import uvloop

from egressbox.audit.record import AuditRecord
from egressbox.core.errors import AuditError, Reason
from egressbox.core.ip import IPAddress
from egressbox.core.policy import Policy, parse_policy
from egressbox.net.resolve import Resolution
from egressbox.proxy.server import EgressProxy
from egressbox.proxy.tunnel import Connection
from proxy_fixtures import StreamOrigin

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(sys.platform != "linux", reason="counts descriptors in /proc/self/fd"),
]

Scenario = Callable[[], Coroutine[Any, Any, None]]
Runner = Callable[[Scenario], str]  # returns what the proxy wrote to stderr

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
# A whole scenario on a loaded machine: generous, yet a hang fails the test.
SCENARIO_TIMEOUT = 30.0
# One client operation (read a reply, see the connection end).
IO_TIMEOUT = 10.0
# Poll interval while waiting for the proxy to reach a state.
POLL = 0.02
# Descriptors are closed a loop turn or a linger after the last client leaves.
SETTLE_TIMEOUT = 10.0
# Small limits, so that the timeouts under test fire quickly.
HEAD_TIMEOUT = 0.5
IDLE_TIMEOUT = 1.0  # the smallest [limits] idle_timeout allows
DRAIN_TIMEOUT = 2.0  # room for the few round trips the drain test makes meanwhile
# The malformed-client storm: how many clients, how many at a time, the seed.
STORM_CLIENTS = 240
STORM_CONCURRENCY = 40
STORM_SEED = 20240611
# Seconds (one byte each) a slowloris client may last: head_timeout is 1 s.
SLOWLORIS_ROUNDS = 8
# Clients that reset right after a complete request for the allowed origin.
RESET_CLIENTS = 200
# Concurrent CONNECTs in the never-dial test (half allowed, half denied).
LOAD_CLIENTS = 200

LOOPBACK: IPAddress = ipaddress.ip_address("127.0.0.1")
ALLOWED_SUFFIX = "ok.test"
DENY_RULE = f"*.blocked.{ALLOWED_SUFFIX}"


@pytest.fixture(params=list(LOOPS))
def run(request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> Runner:
    factory = LOOPS[request.param]

    def runner(scenario: Scenario) -> str:
        async def bounded() -> None:
            async with asyncio.timeout(SCENARIO_TIMEOUT):
                await scenario()

        with asyncio.Runner(loop_factory=factory) as r:
            r.run(bounded())
        err = capsys.readouterr().err
        # A bug in the per-connection glue is caught and logged, never raised.
        assert "internal error" not in err
        return err

    return runner


# -- seams: policy, resolver, audit sink ----------------------------------------------


def make_policy(
    allow: Sequence[str],
    *,
    deny: Sequence[str] = (),
    limits: dict[str, float] | None = None,
) -> Policy:
    data: dict[str, Any] = {
        "egress": {"allow": list(allow), "deny": list(deny), "allow_cidrs": ["127.0.0.0/8"]},
        "limits": {
            "head_timeout": HEAD_TIMEOUT,
            "idle_timeout": 60.0,
            "drain_timeout": DRAIN_TIMEOUT,
            **(limits or {}),
        },
    }
    return parse_policy(data, env={})


class LoopbackResolver:
    """Every name is 127.0.0.1; records each query."""

    def __init__(self) -> None:
        self.queries: list[str] = []

    async def resolve(self, host: str) -> Resolution:
        self.queries.append(host)
        return Resolution((LOOPBACK,), (host,), 60.0, "dns")


class BrokenSink:
    """An audit sink whose disk is gone."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, record: AuditRecord) -> None:
        self.writes += 1
        raise AuditError("cannot write audit record to audit.jsonl: [Errno 28] No space left")

    def close(self) -> None:
        pass


# -- an echo origin ------------------------------------------------------------------------


class Origin(StreamOrigin):
    """An echo server on 127.0.0.1 that counts the connections it accepts."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()


# -- raw clients (loop.sock_* works alike on asyncio and uvloop) ---------------------------


class Client:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()

    @classmethod
    async def connect(cls, address: tuple[str, int]) -> Client:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def send(self, data: bytes) -> None:
        await self.loop.sock_sendall(self.sock, data)

    def shutdown_write(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)

    async def recv(self, timeout: float = IO_TIMEOUT) -> bytes:
        async with asyncio.timeout(timeout):
            return await self.loop.sock_recv(self.sock, 65536)

    async def recv_exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            async with asyncio.timeout(IO_TIMEOUT):
                chunk = await self.loop.sock_recv(self.sock, n - len(data))
            if not chunk:
                raise EOFError(f"closed after {len(data)} of {n} bytes")
            data += chunk
        return data

    async def read_until_closed(self, timeout: float = IO_TIMEOUT) -> tuple[bytes, bool]:
        """Everything the peer sends until it ends the connection: (data, closed)."""
        data = b""
        try:
            async with asyncio.timeout(timeout):
                while chunk := await self.loop.sock_recv(self.sock, 65536):
                    data += chunk
        except ConnectionError:
            return data, True
        except TimeoutError:
            return data, False
        return data, True

    async def read_head(self) -> tuple[int, dict[str, str], bytes]:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await self.recv()
            if not chunk:
                raise EOFError(f"closed inside the response head: {data!r}")
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        return (*parse_head(head), rest)

    async def echo(self, payload: bytes) -> None:
        await self.send(payload)
        assert await self.recv_exact(len(payload)) == payload

    def reset(self) -> None:
        """Close with an RST instead of a FIN."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def close(self) -> None:
        self.sock.close()


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def http_connect(proxy: tuple[str, int], target: str) -> tuple[Client, int, dict[str, str]]:
    client = await Client.connect(proxy)
    try:
        await client.send(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        status, headers, _ = await client.read_head()
    except BaseException:
        client.close()
        raise
    return client, status, headers


def socks_request(host: str, port: int) -> bytes:
    name = host.encode()
    return b"\x05\x01\x00\x03" + bytes([len(name)]) + name + port.to_bytes(2, "big")


async def socks_connect(proxy: tuple[str, int], host: str, port: int) -> tuple[Client, int]:
    client = await Client.connect(proxy)
    try:
        await client.send(b"\x05\x01\x00")
        assert await client.recv_exact(2) == b"\x05\x00"
        await client.send(socks_request(host, port))
        reply = await client.recv_exact(4)
        size = {1: 4, 4: 16}.get(reply[3]) or (await client.recv_exact(1))[0]
        await client.recv_exact(size + 2)
    except BaseException:
        client.close()
        raise
    return client, reply[1]


async def refused(address: tuple[str, int]) -> bool:
    try:
        client = await Client.connect(address)
    except ConnectionRefusedError:
        return True
    client.close()
    return False


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + SETTLE_TIMEOUT
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(POLL)


def idle(proxy: EgressProxy) -> bool:
    """No client connection and no tunnel held by the proxy."""
    return not proxy.state.connections and not proxy.state.tunnels


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def addresses(proxy: EgressProxy) -> tuple[tuple[str, int], tuple[str, int]]:
    assert proxy.http_address is not None
    assert proxy.socks_address is not None
    return proxy.http_address, proxy.socks_address


# -- 1. a storm of malformed clients ------------------------------------------------------

SMUGGLING = [
    # Content-Length and Transfer-Encoding together (CL.TE / TE.CL).
    b"POST http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\nContent-Length: 6\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET http://denied.test/x HTTP/1.1\r\n"
    b"Host: denied.test\r\n\r\n",
    # Two different Content-Lengths.
    b"POST http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\nContent-Length: 0\r\n"
    b"Content-Length: 44\r\n\r\nGET http://denied.test/x HTTP/1.1\r\nHost: x\r\n\r\n",
    # An obfuscated Transfer-Encoding.
    b"POST http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\n"
    b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    b"POST http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\nTransfer-Encoding : chunked"
    b"\r\n\r\n0\r\n\r\n",
    # Obsolete line folding, bare LF, NUL and a space before the colon.
    b"GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\nX: a\r\n b\r\n\r\n",
    b"GET http://denied.test/ HTTP/1.1\nHost: denied.test\n\n",
    b"GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\x00\r\n\r\n",
    # A denied request with a body that is itself a request.
    b"POST http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\nContent-Length: 44\r\n\r\n"
    b"GET http://denied.test/x HTTP/1.1\r\nHost: x\r\n\r\n",
    # CONNECT with a body that is a second CONNECT; Host and target that disagree.
    b"CONNECT denied.test:443 HTTP/1.1\r\nHost: denied.test:443\r\n\r\n"
    b"CONNECT denied.test:443 HTTP/1.1\r\nHost: denied.test:443\r\n\r\n",
    b"GET http://denied.test/ HTTP/1.1\r\nHost: other.test\r\n\r\n",
    # Request lines that are not one.
    b"GET http://denied.test/ HTTP/1.1 extra\r\nHost: denied.test\r\n\r\n",
    b"GET  http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\n\r\n",
    b"CONNECT denied.test:443\r\n\r\n",
    b"GET http://denied.test/ HTTP/2.0\r\nHost: denied.test\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"GET http://" + b"a" * 70000 + b"/ HTTP/1.1\r\n\r\n",
]

HEADS = [
    b"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n",
    b"GET http://denied.test/path?q=1 HTTP/1.1\r\nHost: denied.test\r\nAccept: */*\r\n\r\n",
    b"CONNECT [::1]:443 HTTP/1.1\r\nHost: [::1]:443\r\n\r\n",
]


def assert_http_refusal(data: bytes, kind: str) -> None:
    """At most one response, a 4xx/5xx that closes the connection."""
    if not data:
        return
    assert data.startswith(b"HTTP/1.1 "), (kind, data[:200])
    head, _, body = data.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    assert 400 <= status <= 599, (kind, data[:200])
    assert headers.get("connection") == "close", (kind, data[:200])
    assert len(body) == int(headers["content-length"]), (kind, data[:400])  # nothing after it


class Storm:
    """Malformed clients, each drawn from a seeded RNG; every one must be closed by the proxy."""

    def __init__(self, proxy: EgressProxy, origin: Origin, rng: random.Random) -> None:
        self.http, self.socks = addresses(proxy)
        self.origin_port = origin.port
        self.rng = rng
        self.kinds: Counter[str] = Counter()

    def pick(self) -> Callable[[], Awaitable[None]]:
        kinds: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("random_http", self.random_http),
            ("random_socks", self.random_socks),
            ("truncated_head", self.truncated_head),
            ("smuggling", self.smuggling),
            ("http_on_socks", self.http_on_socks),
            ("socks_on_http", self.socks_on_http),
            ("reset_mid_handshake", self.reset_mid_handshake),
            ("reset_after_request", self.reset_after_request),
            ("silent", self.silent),
        ]
        name, action = self.rng.choice(kinds)
        self.kinds[name] += 1
        return action

    async def finish(self, client: Client, kind: str, *, http: bool) -> bytes:
        """Maybe half-close, then read until the proxy ends the connection."""
        if self.rng.random() < 0.5:
            with contextlib.suppress(OSError):
                client.shutdown_write()
        try:
            data, closed = await client.read_until_closed()
        finally:
            client.close()
        assert closed, f"{kind}: the proxy kept the connection open"
        if http:
            assert_http_refusal(data, kind)
        return data

    async def random_http(self) -> None:
        client = await Client.connect(self.http)
        with contextlib.suppress(ConnectionError):
            await client.send(self.rng.randbytes(self.rng.randint(1, 4096)))
        await self.finish(client, "random_http", http=True)

    async def random_socks(self) -> None:
        client = await Client.connect(self.socks)
        prefix = self.rng.choice([b"", b"\x05", b"\x05\x01", b"\x05\x01\x00", b"\x04\x01"])
        with contextlib.suppress(ConnectionError):
            await client.send(prefix + self.rng.randbytes(self.rng.randint(1, 600)))
        await self.finish(client, "random_socks", http=False)

    async def truncated_head(self) -> None:
        head = self.rng.choice(HEADS).replace(b"{port}", str(self.origin_port).encode())
        cut = self.rng.randint(1, len(head) - 1)
        client = await Client.connect(self.http)
        await client.send(head[:cut])
        await self.finish(client, "truncated_head", http=True)

    async def smuggling(self) -> None:
        client = await Client.connect(self.http)
        with contextlib.suppress(ConnectionError):
            await client.send(self.rng.choice(SMUGGLING))
        data = await self.finish(client, "smuggling", http=True)
        assert data, "a smuggling attempt got no answer at all"

    async def http_on_socks(self) -> None:
        client = await Client.connect(self.socks)
        with contextlib.suppress(ConnectionError):
            await client.send(b"GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\n\r\n")
        await self.finish(client, "http_on_socks", http=False)

    async def socks_on_http(self) -> None:
        client = await Client.connect(self.http)
        with contextlib.suppress(ConnectionError):
            await client.send(b"\x05\x01\x00" + socks_request("127.0.0.1", self.origin_port))
        # No line end ever comes: closed at EOF or after the head timeout.
        await self.finish(client, "socks_on_http", http=True)

    async def reset_mid_handshake(self) -> None:
        if self.rng.random() < 0.5:
            client = await Client.connect(self.http)
            head = HEADS[0].replace(b"{port}", str(self.origin_port).encode())
            await client.send(head[: self.rng.randint(1, len(head) - 1)])
        else:
            client = await Client.connect(self.socks)
            steps = [b"\x05\x01\x00", b"\x05\x01\x00" + socks_request("a", 1)[:5]]
            await client.send(self.rng.choice(steps))
        await asyncio.sleep(self.rng.random() * 0.05)
        client.reset()

    async def reset_after_request(self) -> None:
        # A whole request for the allowed origin, then a reset while the proxy
        # decides, dials or hands the sockets to the relay.
        if self.rng.random() < 0.5:
            client = await Client.connect(self.http)
            target = f"127.0.0.1:{self.origin_port}"
            await client.send(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        else:
            client = await Client.connect(self.socks)
            await client.send(b"\x05\x01\x00" + socks_request("127.0.0.1", self.origin_port))
        await asyncio.sleep(self.rng.random() * 0.005)
        client.reset()

    async def silent(self) -> None:
        client = await Client.connect(self.rng.choice([self.http, self.socks]))
        try:
            data, closed = await client.read_until_closed()
        finally:
            client.close()
        assert closed, "a silent client was not closed after the head timeout"
        assert data == b""


async def warm_up(proxy: EgressProxy, origin: Origin) -> None:
    """Touch every lazily opened resource once (uvloop opens /dev/null on first use)."""
    http, socks = addresses(proxy)
    client, status, _ = await http_connect(http, f"127.0.0.1:{origin.port}")
    assert status == 200
    await client.echo(b"warm")
    client.close()
    client, code = await socks_connect(socks, "127.0.0.1", origin.port)
    assert code == 0x00
    await client.echo(b"warm")
    client.close()
    client, status, _ = await http_connect(http, "denied.test:443")
    assert status == 403
    client.close()
    await wait_for(lambda: idle(proxy), "the warm-up connections to end")


def test_malformed_clients_never_crash_the_proxy_nor_leak_descriptors(run: Runner) -> None:
    async def scenario() -> None:
        origin = await Origin().start()
        policy = make_policy([f"127.0.0.1:{origin.port}"])
        proxy = EgressProxy(policy, resolver=LoopbackResolver(), keep_records=True)
        await proxy.start()
        try:
            await warm_up(proxy, origin)
            baseline = fd_count()

            storm = Storm(proxy, origin, random.Random(STORM_SEED))
            gate = asyncio.Semaphore(STORM_CONCURRENCY)

            async def one(action: Callable[[], Awaitable[None]]) -> None:
                async with gate:
                    await action()

            await asyncio.gather(*(one(storm.pick()) for _ in range(STORM_CLIENTS)))
            assert len(storm.kinds) == 9, storm.kinds  # every kind was exercised

            # The proxy still serves, on both listeners.
            http, socks = addresses(proxy)
            client, status, _ = await http_connect(http, f"127.0.0.1:{origin.port}")
            assert status == 200
            await client.echo(b"still serving")
            client.close()
            client, code = await socks_connect(socks, "127.0.0.1", origin.port)
            assert code == 0x00
            await client.echo(b"still serving")
            client.close()

            await wait_for(lambda: idle(proxy), "every connection to end")
            await wait_for(lambda: not origin.writers, "every upstream connection to end")
            await settle_fds(baseline)
        finally:
            await proxy.close(0)
            await origin.close()

    run(scenario)


def test_clients_that_reset_while_the_proxy_dials_leave_nothing_behind(run: Runner) -> None:
    # The window between "allowed, dialled" and "tunnel open": the client is
    # gone, so the upstream socket must be closed and nothing logged as a bug.
    async def scenario() -> None:
        origin = await Origin().start()
        policy = make_policy([f"127.0.0.1:{origin.port}"])
        proxy = EgressProxy(policy, resolver=LoopbackResolver())
        await proxy.start()
        try:
            await warm_up(proxy, origin)
            baseline = fd_count()
            storm = Storm(proxy, origin, random.Random(STORM_SEED))
            gate = asyncio.Semaphore(STORM_CONCURRENCY)

            async def one() -> None:
                async with gate:
                    await storm.reset_after_request()

            await asyncio.gather(*(one() for _ in range(RESET_CLIENTS)))
            await wait_for(lambda: idle(proxy), "every connection to end")
            await wait_for(lambda: not origin.writers, "every upstream connection to end")
            await settle_fds(baseline)
        finally:
            await proxy.close(0)
            await origin.close()

    run(scenario)


async def settle_fds(baseline: int) -> None:
    """Wait (bounded) for the descriptor count to return to `baseline`, then insist on it."""
    deadline = asyncio.get_running_loop().time() + SETTLE_TIMEOUT
    while fd_count() != baseline and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(POLL)
    assert fd_count() == baseline, sorted(os.listdir("/proc/self/fd"))


# -- 2. the limits ----------------------------------------------------------------------


def test_slowloris_is_closed_after_the_head_timeout_and_frees_its_slot(run: Runner) -> None:
    async def scenario() -> None:
        origin = await Origin().start()
        policy = make_policy(
            [f"127.0.0.1:{origin.port}"], limits={"head_timeout": 1.0, "max_connections": 1}
        )
        async with EgressProxy(policy, resolver=LoopbackResolver(), keep_records=True) as proxy:
            http, _ = addresses(proxy)
            target = f"127.0.0.1:{origin.port}"
            head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()
            slow = await Client.connect(http)
            await slow.send(head[:1])
            # The slow client holds the only slot meanwhile.
            client, status, headers = await http_connect(http, target)
            client.close()
            assert (status, headers["x-egressbox-reason"]) == (503, "too_many_connections")

            sent, closed = 1, False
            try:
                for _ in range(SLOWLORIS_ROUNDS):  # one byte per second
                    try:
                        closed = await slow.recv(timeout=1.0) == b""
                    except TimeoutError:
                        pass
                    except ConnectionError:
                        closed = True
                    if closed:
                        break
                    try:
                        await slow.send(head[sent : sent + 1])
                    except ConnectionError:
                        closed = True
                        break
                    sent += 1
            finally:
                slow.close()
            assert closed, f"the slowloris client was still connected after {sent} bytes"
            assert sent < len(head)

            await wait_for(lambda: idle(proxy), "the slot to be freed")
            client, status, _ = await http_connect(http, target)
            assert status == 200
            await client.echo(b"served again")
            client.close()
            assert origin.accepted == 1
        await origin.close()

    run(scenario)


def test_max_connections_refuses_the_excess_and_serves_again_later(run: Runner) -> None:
    async def scenario() -> None:
        origin = await Origin().start()
        target = f"127.0.0.1:{origin.port}"
        policy = make_policy([target], limits={"max_connections": 3})
        async with EgressProxy(policy, resolver=LoopbackResolver(), keep_records=True) as proxy:
            http, socks = addresses(proxy)
            held: list[Client] = []
            for _ in range(2):
                client, status, _ = await http_connect(http, target)
                held.append(client)
                assert status == 200
            client, code = await socks_connect(socks, "127.0.0.1", origin.port)
            held.append(client)
            assert code == 0x00
            for client in held:
                await client.echo(b"holding a slot")

            excess, status, headers = await http_connect(http, target)
            assert (status, headers["x-egressbox-reason"]) == (503, "too_many_connections")
            excess.close()
            excess, code = await socks_connect(socks, "127.0.0.1", origin.port)
            assert code == 0x01
            excess.close()
            assert origin.accepted == 3  # the refused ones were never dialled
            refusals = [
                (r.protocol.value, r.host, r.port, r.decision.value, r.reason.value)
                for r in proxy.records[3:]
            ]
            assert refusals == [
                ("connect", "127.0.0.1", origin.port, "deny", "too_many_connections"),
                ("socks5", "127.0.0.1", origin.port, "deny", "too_many_connections"),
            ]

            for client in held:
                client.close()
            await wait_for(lambda: idle(proxy), "the earlier connections to end")
            client, status, _ = await http_connect(http, target)
            assert status == 200
            await client.echo(b"served again")
            client.close()
            client, code = await socks_connect(socks, "127.0.0.1", origin.port)
            assert code == 0x00
            await client.echo(b"served again")
            client.close()
            assert len(proxy.records) == 7
        await origin.close()

    run(scenario)


def test_idle_tunnels_are_closed_and_busy_ones_are_not(run: Runner) -> None:
    async def scenario() -> None:
        origin = await Origin().start()
        target = f"127.0.0.1:{origin.port}"
        policy = make_policy([target], limits={"idle_timeout": IDLE_TIMEOUT})
        async with EgressProxy(policy, resolver=LoopbackResolver()) as proxy:
            http, socks = addresses(proxy)
            quiet_http, status, _ = await http_connect(http, target)
            assert status == 200
            quiet_socks, code = await socks_connect(socks, "127.0.0.1", origin.port)
            assert code == 0x00
            busy, status, _ = await http_connect(http, target)
            assert status == 200
            for client in (quiet_http, quiet_socks, busy):
                await client.echo(b"hello")

            async def keep_busy() -> int:
                rounds = 0
                while True:  # a byte every IDLE_TIMEOUT / 4 keeps the tunnel alive
                    await busy.echo(b".")
                    rounds += 1
                    await asyncio.sleep(IDLE_TIMEOUT / 4)

            pinger = asyncio.get_running_loop().create_task(keep_busy())
            try:
                for client in (quiet_http, quiet_socks):
                    data, closed = await client.read_until_closed()
                    assert (data, closed) == (b"", True)
                await asyncio.sleep(IDLE_TIMEOUT)
                assert not pinger.done()  # the busy tunnel outlived idle_timeout
            finally:
                pinger.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pinger
            await busy.echo(b"still open")
            for client in (quiet_http, quiet_socks, busy):
                client.close()
            await wait_for(lambda: idle(proxy), "the tunnels to end")
        await origin.close()

    run(scenario)


# -- 3. audit sink failure --------------------------------------------------------------


def test_audit_failure_refuses_this_and_every_later_connection(run: Runner) -> None:
    async def scenario() -> None:
        origin = await Origin().start()
        target = f"127.0.0.1:{origin.port}"
        sink = BrokenSink()
        policy = make_policy([target])
        async with EgressProxy(policy, resolver=LoopbackResolver(), audit=sink) as proxy:
            http, socks = addresses(proxy)
            for _ in range(2):
                for where in (target, "denied.test:443"):
                    client, status, headers = await http_connect(http, where)
                    client.close()
                    assert (status, headers["x-egressbox-reason"]) == (503, "audit_unavailable")
            client, code = await socks_connect(socks, "127.0.0.1", origin.port)
            client.close()
            assert code == 0x01
            client = await Client.connect(http)
            await client.send(b"GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\n\r\n")
            status, headers, _ = await client.read_head()
            client.close()
            assert (status, headers["x-egressbox-reason"]) == (503, "audit_unavailable")
            assert origin.accepted == 0
            assert sink.writes == 1  # the failure stops admission; no retry per connection
        await origin.close()

    err = run(scenario)
    lines = [line for line in err.splitlines() if "audit" in line]
    assert len(lines) == 1, err
    assert "No space left" in lines[0]
    assert "refusing new connections" in lines[0]


# -- 4. graceful close -------------------------------------------------------------------


def test_close_drains_open_tunnels_then_aborts_the_rest(run: Runner) -> None:
    async def scenario() -> None:
        origin = await Origin().start()
        target = f"127.0.0.1:{origin.port}"
        proxy = EgressProxy(make_policy([target]), resolver=LoopbackResolver())
        await proxy.start()
        http, socks = addresses(proxy)
        finishing, status, _ = await http_connect(http, target)
        assert status == 200
        lingering, code = await socks_connect(socks, "127.0.0.1", origin.port)
        assert code == 0x00
        silent = await Client.connect(http)  # never sends: still a connection to drain
        for client in (finishing, lingering):
            await client.echo(b"before close")

        closing = asyncio.get_running_loop().create_task(proxy.close())
        try:
            await wait_for(lambda: not proxy.state.accepting, "close() to start")
            for address in (http, socks):
                assert await refused(address)
            # An open tunnel finishes its work inside drain_timeout...
            await finishing.echo(b"during the drain")
            finishing.shutdown_write()
            assert await finishing.read_until_closed() == (b"", True)
            # ...the other one is still up...
            await lingering.echo(b"still up")
            assert not closing.done()
            # ...until drain_timeout passes: then it and the silent client are aborted.
            async with asyncio.timeout(IO_TIMEOUT):
                await closing
            for client in (lingering, silent):
                data, closed = await client.read_until_closed()
                assert (data, closed) == (b"", True)
            assert idle(proxy)
            for address in (http, socks):
                assert await refused(address)
        finally:
            for client in (finishing, lingering, silent):
                client.close()
            if not closing.done():
                closing.cancel()
            await origin.close()

    run(scenario)


# -- 5. never dial a denied destination, under concurrent load ----------------------------


def test_concurrent_connects_never_dial_a_denied_destination(run: Runner) -> None:
    async def scenario() -> None:
        origin = await Origin().start()
        port = origin.port
        resolver = LoopbackResolver()  # every name, denied ones too, would reach the origin
        policy = make_policy([f"*.{ALLOWED_SUFFIX}:{port}"], deny=[DENY_RULE])
        async with EgressProxy(policy, resolver=resolver, keep_records=True) as proxy:
            http, _ = addresses(proxy)
            targets = plan_targets(LOAD_CLIENTS, port)
            results = await asyncio.gather(*(attempt(http, host, port) for host, _ in targets))
            await wait_for(lambda: idle(proxy), "every tunnel to end")

        for (host, expected), status in zip(targets, results, strict=True):
            assert status == (200 if expected == "allowed" else 403), host
        allowed = {host for host, reason in targets if reason == "allowed"}
        assert origin.accepted == len(allowed)
        assert sorted(resolver.queries) == sorted(allowed)  # denied names never resolved
        records = Counter(
            (r.host, r.port, r.protocol.value, r.decision.value, r.reason.value)
            for r in proxy.records
        )
        expected_records = Counter(
            (host, port, "connect", "allow" if reason == "allowed" else "deny", reason)
            for host, reason in targets
        )
        assert records == expected_records
        await origin.close()

    run(scenario)


def plan_targets(count: int, port: int) -> list[tuple[str, str]]:
    """(host, expected reason): allowed, deny_rule and no_allow_rule, interleaved."""
    targets = []
    for i in range(count):
        if i % 2 == 0:
            targets.append((f"a{i}.{ALLOWED_SUFFIX}", Reason.ALLOWED.value))
        elif i % 4 == 1:
            targets.append((f"d{i}.blocked.{ALLOWED_SUFFIX}", Reason.DENY_RULE.value))
        else:
            targets.append((f"n{i}.elsewhere.test", Reason.NO_ALLOW_RULE.value))
    return targets


async def attempt(proxy: tuple[str, int], host: str, port: int) -> int:
    client, status, headers = await http_connect(proxy, f"{host}:{port}")
    try:
        if status == 200:
            await client.echo(f"payload for {host}".encode() * 10)
        else:
            assert headers["connection"] == "close"
    finally:
        client.close()
    return status


# -- 5. the tunnel path's callbacks: no Task without DNS, dial timeout and drain -----------


class CachingLoopbackResolver(LoopbackResolver):
    """LoopbackResolver that, like DnsResolver, answers a name it has seen without a query."""

    def resolve_now(self, host: str) -> Resolution | None:
        if host not in self.queries:
            return None
        return Resolution((LOOPBACK,), (host,), 60.0, "cache")


@pytest.mark.pure_only
def test_only_a_decision_that_needs_dns_starts_a_task(
    run: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[str] = []
    original = Connection.start

    def counting(self: Connection, work: Callable[[], object]) -> None:
        started.append(type(self).__name__)
        original(self, work)

    monkeypatch.setattr(Connection, "start", counting)

    async def scenario() -> None:
        origin = await Origin().start()
        policy = make_policy([f"127.0.0.1:{origin.port}", f"{ALLOWED_SUFFIX}:{origin.port}"])
        resolver = CachingLoopbackResolver()
        proxy = EgressProxy(policy, resolver=resolver, keep_records=True)
        await proxy.start()
        try:
            http, socks = addresses(proxy)
            for target in ("127.0.0.1", ALLOWED_SUFFIX, ALLOWED_SUFFIX):
                client, status, _ = await http_connect(http, f"{target}:{origin.port}")
                assert status == 200
                await client.echo(b"ping")
                client.close()
                client, code = await socks_connect(socks, target, origin.port)
                assert code == 0x00
                await client.echo(b"ping")
                client.close()
            client, status, _ = await http_connect(http, "denied.test:443")
            assert status == 403
            client.close()
            # Only the first name needed a query (and a Task); the rest came from the cache.
            assert resolver.queries == [ALLOWED_SUFFIX]
            assert started == ["HttpConnection"]
            assert len(proxy.records) == 7
            await wait_for(lambda: idle(proxy), "every connection to end")
        finally:
            await proxy.close(0)
            await origin.close()

    run(scenario)


def test_dial_timeout_and_drain_while_dialing_leave_nothing_behind(run: Runner) -> None:
    async def scenario() -> None:
        origin = await Origin().start()
        # A listener whose accept queue is full: connects to it hang (SYNs dropped).
        with socket.socket() as hole, socket.socket() as filler:
            hole.bind(("127.0.0.2", 0))
            hole.listen(0)
            port = hole.getsockname()[1]
            filler.connect(("127.0.0.2", port))
            policy = make_policy(
                [f"127.0.0.1:{origin.port}", f"127.0.0.2:{port}"],
                limits={"connect_timeout": 0.3},
            )
            proxy = EgressProxy(policy, resolver=LoopbackResolver(), keep_records=True)
            await proxy.start()
            try:
                await warm_up(proxy, origin)
                baseline = fd_count()
                http, socks = addresses(proxy)
                client, status, headers = await http_connect(http, f"127.0.0.2:{port}")
                assert (status, headers.get("x-egressbox-reason")) == (504, "connect_timeout")
                client.close()
                client = await Client.connect(socks)
                await client.send(b"\x05\x01\x00" + socks_request("127.0.0.2", port))
                data, closed = await client.read_until_closed()
                assert closed and data[2:4] == b"\x05\x04"  # TTL expired: connect_timeout
                client.close()
                await wait_for(lambda: idle(proxy), "the refused connections to end")
                await settle_fds(baseline)
                # A drain while dials are in flight closes the clients and the attempts.
                policy = make_policy(
                    [f"127.0.0.2:{port}"], limits={"connect_timeout": 30.0, "drain_timeout": 0.2}
                )
                proxy.set_policy(policy)
                clients = [await Client.connect(http) for _ in range(3)]
                for waiting in clients:
                    target = f"127.0.0.2:{port}"
                    await waiting.send(
                        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()
                    )
                await wait_for(lambda: len(proxy.records) == 8, "the decisions")
            finally:
                await proxy.close(0)
                await origin.close()
            for waiting in clients:
                data, closed = await waiting.read_until_closed()
                assert (data, closed) == (b"", True)
                waiting.close()
            await settle_fds(
                baseline - 3
            )  # the proxy's two listeners and the origin's are closed too

    run(scenario)


def test_finished_connections_leave_nothing_to_the_cycle_collector(run: Runner) -> None:
    """Tunnels (CONNECT and SOCKS5, ended by either side), refusals and a plain request:
    once they are over, every object the proxy made for them is freed by its reference
    count. Nothing is left in a reference cycle (which would wait for, and cost, a pass
    of the cycle collector under load)."""

    async def one_of_each(http: tuple[str, int], socks: tuple[str, int], port: int) -> None:
        client, status, _ = await http_connect(http, f"127.0.0.1:{port}")
        assert status == 200
        await client.echo(b"ping")
        client.close()
        client, code = await socks_connect(socks, "127.0.0.1", port)
        assert code == 0x00
        await client.echo(b"ping")
        client.shutdown_write()
        assert await client.read_until_closed() == (b"", True)
        client.close()
        client, status, _ = await http_connect(http, "denied.test:443")
        assert status == 403
        client.close()
        client = await Client.connect(http)
        await client.send(b"GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\n\r\n")
        data, _ = await client.read_until_closed()
        assert data.startswith(b"HTTP/1.1 403")
        client.close()

    async def scenario() -> None:
        origin = await Origin().start()
        proxy = EgressProxy(make_policy([f"127.0.0.1:{origin.port}"]), keep_records=True)
        await proxy.start()
        http, socks = addresses(proxy)
        # Once before counting: what the first connections make once per process or loop
        # (a deadline wheel for this loop, which drops one a closed loop left) is not theirs.
        await one_of_each(http, socks, origin.port)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(20):
                await one_of_each(http, socks, origin.port)
            await wait_for(lambda: idle(proxy), "every connection to end")
            await asyncio.sleep(0.1)  # the transports' last callbacks
            gc.collect()
            left = Counter(
                type(o).__qualname__
                for o in gc.garbage
                if type(o).__module__.startswith("egressbox")
            )
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
            await proxy.close(0)
            await origin.close()
        assert not left, left

    run(scenario)
