"""Tests for egressbox.net.dial with real loopback listeners, on asyncio and uvloop.

A "blackholed" address is a loopback listener whose accept queue is full:
Linux drops further SYNs (tcp_abort_on_overflow=0), so a connect just hangs,
like one to a host that drops packets. Unreachable networks and a TEST-NET
blackhole are only ever used inside a network namespace the test creates.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from ipaddress import IPv4Address, IPv6Address, ip_address

import pytest

from egressbox.core.errors import EgressboxError
from egressbox.net.dial import (
    DEFAULT_STAGGER,
    DialError,
    DialFailure,
    Dialing,
    failure_for,
    interleave_families,
    start_connect,
)
from loops import LOOPS, Runner, Scenario

pytestmark = pytest.mark.timeout(60)

V4 = ip_address("127.0.0.1")
V6 = ip_address("::1")
# Generous for a connection on loopback.
TIMEOUT = 5.0
# For dials that must time out on purpose.
SHORT = 0.3
# A stagger no test should ever wait out.
LONG_STAGGER = 30.0
# Ports tried when several addresses must share one.
PORT_TRIES = 20


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(params=list(LOOPS))
def run(request: pytest.FixtureRequest) -> Runner:
    factory = LOOPS[request.param]

    def runner(scenario: Scenario) -> None:
        with asyncio.Runner(loop_factory=factory) as r:
            r.run(scenario())

    return runner


def _bound(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # over TIME_WAIT
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@contextmanager
def listening(host: str, port: int = 0) -> Iterator[int]:
    with _bound(host, port) as sock:
        sock.listen(8)
        yield sock.getsockname()[1]


@contextmanager
def refusing(host: str, port: int = 0) -> Iterator[int]:
    """A bound port with no listener: the kernel answers SYNs with RST."""
    with _bound(host, port) as sock:
        yield sock.getsockname()[1]


@contextmanager
def blackholed(host: str, port: int = 0) -> Iterator[int]:
    """A listener whose accept queue is full: further SYNs are dropped."""
    with _bound(host, port) as sock, socket.socket(sock.family) as filler:
        sock.listen(0)  # room for exactly one queued connection
        bound = sock.getsockname()[1]
        filler.connect((host, bound))
        yield bound


Endpoint = Callable[[str, int], AbstractContextManager[int]]


@contextmanager
def one_port(*endpoints: tuple[Endpoint, str]) -> Iterator[int]:
    """Open every endpoint on one port: the first picks it, the others follow.

    An ephemeral port free on one address may be taken on another (by a
    connection of an earlier test): then try another port, a bounded number
    of times.
    """
    (first, first_host), *rest = endpoints
    for _ in range(PORT_TRIES):
        with ExitStack() as stack:
            port = stack.enter_context(first(first_host, 0))
            try:
                for endpoint, host in rest:
                    stack.enter_context(endpoint(host, port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                continue
            yield port
            return
    raise RuntimeError(f"no port free on every address after {PORT_TRIES} tries")


def peer_host(sock: socket.socket) -> str:
    return str(sock.getpeername()[0])


# --- Order ---------------------------------------------------------------------------


def test_interleave_starts_with_first_family_and_alternates() -> None:
    a6, b6, c6 = (IPv6Address(f"2001:db8::{i}") for i in (1, 2, 3))
    a4, b4 = IPv4Address("192.0.2.1"), IPv4Address("192.0.2.2")
    assert interleave_families([a6, b6, c6, a4, b4]) == [a6, a4, b6, b4, c6]
    assert interleave_families([a4, a6, b6, c6]) == [a4, a6, b6, c6]
    assert interleave_families([a4, b4, a4]) == [a4, b4]
    assert interleave_families([]) == []


def test_failure_codes() -> None:
    assert failure_for(ConnectionRefusedError()) is DialFailure.CONNECT_REFUSED
    assert failure_for(OSError(errno.ECONNREFUSED, "x")) is DialFailure.CONNECT_REFUSED
    assert failure_for(OSError(errno.ETIMEDOUT, "x")) is DialFailure.CONNECT_TIMEOUT
    for code in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EAFNOSUPPORT):
        assert failure_for(OSError(code, "x")) is DialFailure.NETWORK_UNREACHABLE
    assert failure_for(OSError(errno.EADDRNOTAVAIL, "x")) is DialFailure.CONNECT_FAILED
    assert failure_for(OSError("no errno")) is DialFailure.CONNECT_FAILED
    assert issubclass(DialError, EgressboxError)
    assert [f.value for f in DialFailure] == [
        "connect_refused",
        "connect_timeout",
        "network_unreachable",
        "connect_failed",
        "upstream_failed",
        "upstream_denied",
    ]


# --- Inside a private network namespace -------------------------------------------------

_NETNS_SCRIPT = """
import asyncio, json, socket, subprocess, sys
from ipaddress import ip_address
from egressbox.net.dial import DialError, start_connect

subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
# Packets to this TEST-NET-2 range loop back over lo and are dropped (no
# forwarding): a real blackhole, and only inside this namespace.
subprocess.run(["ip", "route", "add", "198.51.100.0/24", "dev", "lo"], check=True)

async def attempt(addresses, port, timeout):
    done = asyncio.get_running_loop().create_future()
    start_connect(
        [ip_address(a) for a in addresses], port, asyncio.Protocol(),
        lambda transport, error: done.set_result((transport, error)),
        timeout=timeout, stagger=0.05,
    )
    transport, error = await done
    if error is not None:
        return error.reason.value
    peer = transport.get_extra_info("peername")[0]
    transport.abort()
    return "connected to " + peer

async def main():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    print(json.dumps({
        "unrouted": await attempt(["192.0.2.1"], port, 2.0),
        "unrouted_v6": await attempt(["2001:db8::1"], port, 2.0),
        "blackhole": await attempt(["198.51.100.1"], port, 0.3),
        "fallback": await attempt(["198.51.100.1", "127.0.0.1"], port, 2.0),
    }))

asyncio.run(main())
"""


def _unshare_command() -> list[str]:
    base = ["unshare", "--net"]
    if os.geteuid() != 0:
        base.append("--map-root-user")
    return [*base, sys.executable, "-c", _NETNS_SCRIPT]


@pytest.mark.skipif(
    shutil.which("unshare") is None or shutil.which("ip") is None,
    reason="needs unshare(1) and ip(8)",
)
def test_unreachable_and_blackholed_inside_a_network_namespace() -> None:
    command = _unshare_command()
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=30)
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip(f"no network namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "unrouted": "network_unreachable",
        "unrouted_v6": "network_unreachable",
        "blackhole": "connect_timeout",
        "fallback": "connected to 127.0.0.1",
    }


# --- start_connect: the loop's create_connection, reported by callback ------------------


class Recorder(asyncio.Protocol):
    """The protocol a dial connects: what it saw, and when."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.data = b""
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


async def connect(
    addresses: list[IPv4Address | IPv6Address],
    port: int,
    *,
    timeout: float,
    stagger: float = DEFAULT_STAGGER,
) -> tuple[asyncio.Transport, Recorder]:
    """start_connect as a coroutine; checks that it reports exactly once."""
    loop = asyncio.get_running_loop()
    reports: list[tuple[asyncio.Transport | None, DialError | None]] = []
    reported: asyncio.Future[None] = loop.create_future()
    protocol = Recorder()

    def on_done(transport: asyncio.Transport | None, error: DialError | None) -> None:
        reports.append((transport, error))
        reported.set_result(None)

    start_connect(addresses, port, protocol, on_done, timeout=timeout, stagger=stagger)
    await reported
    await asyncio.sleep(0.01)  # a second report would come within a few loop turns
    assert len(reports) == 1
    transport, error = reports[0]
    if error is not None:
        assert transport is None
        raise error
    assert transport is not None
    assert protocol.transport is transport  # connection_made ran before the report
    return transport, protocol


async def warm_up() -> None:
    """uvloop opens /dev/null once, on its first transport: not ours to count."""
    with listening("127.0.0.1") as port:
        transport, _ = await connect([V4], port, timeout=TIMEOUT)
        await closed(transport)


async def closed(transport: asyncio.Transport) -> None:
    transport.abort()
    for _ in range(3):
        await asyncio.sleep(0)


def check_transport(transport: asyncio.Transport) -> None:
    sock = transport.get_extra_info("socket")
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_connect_single_address(run: Runner, host: str) -> None:
    async def scenario() -> None:
        with listening(host) as port:
            transport, _ = await connect([ip_address(host)], port, timeout=TIMEOUT)
            check_transport(transport)
            assert transport.get_extra_info("peername")[:2] == (host, port)
            await closed(transport)

    run(scenario)


def test_connect_keeps_what_the_server_says_first(run: Runner) -> None:
    async def scenario() -> None:
        with _bound("127.0.0.2", 0) as listener:
            listener.listen(8)
            port = listener.getsockname()[1]
            task = asyncio.create_task(connect([ip_address("127.0.0.2")], port, timeout=TIMEOUT))
            loop = asyncio.get_running_loop()
            listener.setblocking(False)
            accepted, _ = await loop.sock_accept(listener)
            with accepted:
                accepted.sendall(b"220 ready\r\n")
                transport, protocol = await task
                for _ in range(100):
                    if protocol.data:
                        break
                    await asyncio.sleep(0.01)
                assert protocol.data == b"220 ready\r\n"
                await closed(transport)

    run(scenario)


def test_connect_refused(run: Runner) -> None:
    async def scenario() -> None:
        await warm_up()
        before = fd_count()
        with refusing("127.0.0.1") as port, pytest.raises(DialError) as caught:
            await connect([V4], port, timeout=TIMEOUT)
        assert caught.value.reason is DialFailure.CONNECT_REFUSED
        assert str(caught.value) == f"connection refused by 127.0.0.1 port {port}"
        assert fd_count() == before

    run(scenario)


def test_connect_single_address_times_out(run: Runner) -> None:
    async def scenario() -> None:
        with blackholed("127.0.0.2") as port:
            await warm_up()
            before = fd_count()
            started = time.monotonic()
            with pytest.raises(DialError) as caught:
                await connect([ip_address("127.0.0.2")], port, timeout=SHORT)
            assert time.monotonic() - started >= SHORT * 0.9
            assert fd_count() == before
        assert caught.value.reason is DialFailure.CONNECT_TIMEOUT
        assert str(caught.value) == f"no connection to 127.0.0.2 port {port} within {SHORT:g} s"

    run(scenario)


def test_connect_blackholed_first_address_then_second_wins(run: Runner) -> None:
    async def scenario() -> None:
        with one_port((blackholed, "127.0.0.2"), (listening, "127.0.0.3")) as port:
            await warm_up()
            before = fd_count()
            addresses = [ip_address("127.0.0.2"), ip_address("127.0.0.3")]
            transport, protocol = await connect(addresses, port, timeout=TIMEOUT, stagger=0.05)
            assert transport.get_extra_info("peername")[0] == "127.0.0.3"
            assert transport.get_protocol() is protocol
            check_transport(transport)
            assert fd_count() == before + 1  # the loser's socket is closed
            await closed(transport)
            assert protocol.lost

    run(scenario)


def test_connect_failure_starts_the_next_attempt_at_once(run: Runner) -> None:
    async def scenario() -> None:
        with one_port((listening, "127.0.0.1"), (refusing, "::1")) as port:
            started = time.monotonic()
            transport, _ = await connect(
                [V6, V4], port, timeout=2 * LONG_STAGGER, stagger=LONG_STAGGER
            )
            elapsed = time.monotonic() - started
            assert transport.get_extra_info("peername")[0] == "127.0.0.1"
            await closed(transport)
        assert elapsed < LONG_STAGGER / 3

    run(scenario)


def test_connect_every_attempt_refused_reports_refusal(run: Runner) -> None:
    async def scenario() -> None:
        await warm_up()
        before = fd_count()
        with (
            one_port((refusing, "127.0.0.1"), (refusing, "::1")) as port,
            pytest.raises(DialError) as caught,
        ):
            await connect([V6, V4], port, timeout=TIMEOUT, stagger=0.01)
        assert caught.value.reason is DialFailure.CONNECT_REFUSED
        assert fd_count() == before

    run(scenario)


def test_connect_overall_timeout(run: Runner) -> None:
    async def scenario() -> None:
        with one_port((blackholed, "127.0.0.2"), (blackholed, "127.0.0.3")) as port:
            await warm_up()
            before = fd_count()
            addresses = [ip_address("127.0.0.2"), ip_address("127.0.0.3")]
            with pytest.raises(DialError) as caught:
                await connect(addresses, port, timeout=SHORT, stagger=0.05)
            assert fd_count() == before
        assert caught.value.reason is DialFailure.CONNECT_TIMEOUT
        assert str(caught.value) == (
            f"no connection to 127.0.0.2, 127.0.0.3 port {port} within {SHORT:g} s"
        )

    run(scenario)


@pytest.mark.parametrize("hosts", [["127.0.0.2"], ["127.0.0.2", "::1"]])
def test_cancelled_connect_closes_everything_and_reports_nothing(
    run: Runner, hosts: list[str]
) -> None:
    async def scenario() -> None:
        endpoints = [(blackholed, host) for host in hosts]
        with one_port(*endpoints) as port:
            await warm_up()
            before = fd_count()
            reports: list[object] = []
            dialing = start_connect(
                [ip_address(h) for h in hosts],
                port,
                Recorder(),
                lambda *report: reports.append(report),
                timeout=SHORT,
                stagger=0.01,
            )
            await asyncio.sleep(0.1)  # every attempt in flight
            dialing.cancel()
            await asyncio.sleep(SHORT * 1.5)  # past the timeout: still nothing reported
            assert reports == []
            assert fd_count() == before

    run(scenario)


class CancelOnConnect(Recorder):
    """Cancels the dial from inside connection_made: connected, not yet reported."""

    dialing: Dialing | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.dialing is not None
        self.dialing.cancel()


def test_connect_cancelled_after_connecting_closes_the_winner(run: Runner) -> None:
    async def scenario() -> None:
        with one_port((listening, "127.0.0.1"), (listening, "::1")) as port:
            await warm_up()
            before = fd_count()
            reports: list[object] = []
            for hosts in (["127.0.0.1"], ["127.0.0.1", "::1"]):
                protocol = CancelOnConnect()
                protocol.dialing = start_connect(
                    [ip_address(h) for h in hosts],
                    port,
                    protocol,
                    lambda *report: reports.append(report),
                    timeout=TIMEOUT,
                    stagger=LONG_STAGGER,
                )
                await asyncio.sleep(0.05)
                assert protocol.transport is not None  # it had connected (then was closed)
            assert reports == []
            assert fd_count() == before  # closed (uvloop: without calling connection_lost)

    run(scenario)


def test_connect_bad_arguments(run: Runner) -> None:
    async def scenario() -> None:
        for addresses, port in (([], 80), ([V4], 0), ([V4], 65536)):
            with pytest.raises(ValueError):
                start_connect(addresses, port, Recorder(), print, timeout=1.0)

    run(scenario)


def test_connect_never_calls_the_resolver(run: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_lookups(*args: object, **kwargs: object) -> None:
        raise AssertionError("start_connect must not resolve")

    monkeypatch.setattr(socket, "getaddrinfo", no_lookups)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(loop, "getaddrinfo", no_lookups)
        with listening("127.0.0.1") as port, listening("::1") as port6:
            transport, _ = await connect([V4], port, timeout=TIMEOUT)
            await closed(transport)
            transport, _ = await connect([V6], port6, timeout=TIMEOUT)
            await closed(transport)

    run(scenario)


def test_both_families_v6_blackholed_v4_wins(run: Runner) -> None:
    async def scenario() -> None:
        with one_port((blackholed, "::1"), (listening, "127.0.0.1")) as port:
            transport, _ = await connect([V6, V4], port, timeout=TIMEOUT, stagger=0.05)
            sock = transport.get_extra_info("socket")
            assert sock.family == socket.AF_INET
            assert peer_host(sock) == "127.0.0.1"
            await closed(transport)

    run(scenario)


def test_both_families_v4_refused_v6_wins(run: Runner) -> None:
    async def scenario() -> None:
        with one_port((listening, "::1"), (refusing, "127.0.0.1")) as port:
            transport, _ = await connect([V4, V6], port, timeout=TIMEOUT)
            sock = transport.get_extra_info("socket")
            assert sock.family == socket.AF_INET6
            assert peer_host(sock) == "::1"
            await closed(transport)

    run(scenario)


def test_the_address_text_keeps_the_families_apart() -> None:
    """0.0.0.1 and ::1 are the same number: the cache of address texts must not mix them."""
    from egressbox.net import dial

    for _ in range(2):  # the first call fills the cache, the second reads it
        assert dial._ip_text(IPv4Address(1)) == "0.0.0.1"
        assert dial._ip_text(IPv6Address(1)) == "::1"
        assert dial._ip_text(IPv6Address(2**32 + 1)) == "::1:0:1"
        assert dial._ip_text(IPv4Address("255.255.255.255")) == "255.255.255.255"
