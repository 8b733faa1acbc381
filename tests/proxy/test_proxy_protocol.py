"""The PROXY protocol on the HTTP and SOCKS5 listeners (EgressProxy(proxy_protocol_from=...),
`serve --proxy-protocol`): real HAProxy in TCP mode sending `send-proxy` (v1) and
`send-proxy-v2`, curl through it, and raw sockets for what a balancer would never send.

Judged from outside: the replies the clients get, the audit records (a refused header is no
destination decision, so none), the refusal counts by cause, what stderr said, and the
per-client counts the proxy keeps (the real client behind HAProxy, not HAProxy). Clients
bind other loopback addresses (127.0.0.5, 127.0.0.6) so that the real client differs from
HAProxy's own address; everything stays on 127.0.0.0/8.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from egressbox.core.limits import Limits
from egressbox.protocols.proxy_header import V2_SIGNATURE, build_v1, build_v2
from egressbox.proxy.server import EgressProxy
from listening import free_port, wait_listening
from proxy_fixtures import IO_TIMEOUT, Curl, EchoOrigin, HttpOrigin, Origins, StartProxy, Wire

pytestmark = [pytest.mark.usefixtures("dials"), pytest.mark.timeout(90)]

CLAIMED = ipaddress.ip_address("198.51.100.7")  # a client address a header names
BALANCER_SIDE = ipaddress.ip_address("192.0.2.1")
START_TIMEOUT = 15.0
POLL = 0.05
HEAD_TIMEOUT = 0.5  # small, so that the header timeout fires quickly


def connect_line(port: int, host: str = "origin.test") -> bytes:
    return f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()


async def until(predicate: object, what: str) -> None:
    """Poll `predicate()` (bounded by IO_TIMEOUT)."""
    assert callable(predicate)
    async with asyncio.timeout(IO_TIMEOUT):
        while not predicate():
            await asyncio.sleep(POLL)


async def closed_without_reply(reader: asyncio.StreamReader) -> bool:
    """The proxy closed (or reset) the connection and sent nothing."""
    try:
        data = await asyncio.wait_for(reader.read(1024), IO_TIMEOUT)
    except ConnectionResetError:
        return True
    return data == b""


# -- HAProxy ---------------------------------------------------------------------------------


@dataclass
class Haproxy:
    proc: subprocess.Popen[bytes]
    ports: dict[str, int]
    log: Path

    def address(self, name: str) -> tuple[str, int]:
        return "127.0.0.1", self.ports[name]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_haproxy(workdir: Path, backends: dict[str, tuple[int, str]]) -> Haproxy:
    """HAProxy in TCP mode: one frontend per backend name, each passing connections to
    127.0.0.1:PORT with OPTION (`send-proxy` or `send-proxy-v2`)."""
    program = shutil.which("haproxy")
    if program is None:
        pytest.skip("HAProxy is not installed (Debian package haproxy; scripts/setup --test)")
    ports = {name: free_port() for name in backends}
    lines = [
        "global",
        "    maxconn 256",
        "defaults",
        "    mode tcp",
        "    timeout connect 5s",
        "    timeout client 30s",
        "    timeout server 30s",
    ]
    for name, (port, option) in backends.items():
        lines += [
            f"frontend {name}",
            f"    bind 127.0.0.1:{ports[name]}",
            f"    default_backend {name}_egressbox",
            f"backend {name}_egressbox",
            f"    server egressbox 127.0.0.1:{port} {option}",
        ]
    conf = workdir / "haproxy.cfg"
    conf.write_text("\n".join(lines) + "\n")
    log = workdir / "haproxy.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([program, "-db", "-f", str(conf)], stdout=out, stderr=out)
    haproxy = Haproxy(proc, ports, log)
    try:
        _wait_listening(haproxy)
    except BaseException:
        haproxy.stop()
        raise
    return haproxy


def _wait_listening(haproxy: Haproxy) -> None:
    problem = wait_listening(haproxy.ports.values(), haproxy.proc, START_TIMEOUT)
    if problem:
        pytest.fail(f"haproxy {problem}: {haproxy.log.read_text()[-2000:]}")


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="egressbox-pp-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def behind_haproxy(
    start_proxy: StartProxy, workdir: Path, proxy_log: list[str]
) -> AsyncIterator[tuple[EgressProxy, Haproxy]]:
    """A proxy trusting 127.0.0.1 (HAProxy) for the header, max 1 connection per client,
    with HAProxy frontends `v1` and `v2` for its HTTP listener and `socks` for SOCKS5."""
    proxy = await start_proxy(
        proxy_protocol_from=["127.0.0.1"],
        limits=Limits(max_connections_per_client=1),
        log=proxy_log.append,
    )
    assert proxy.http_address is not None and proxy.socks_address is not None
    haproxy = start_haproxy(
        workdir,
        {
            "v1": (proxy.http_address[1], "send-proxy"),
            "v2": (proxy.http_address[1], "send-proxy-v2"),
            "socks": (proxy.socks_address[1], "send-proxy-v2"),
        },
    )
    try:
        yield proxy, haproxy
    finally:
        haproxy.stop()


@pytest.mark.parametrize("frontend", ["v1", "v2"])
async def test_curl_through_haproxy_tunnels_and_forwards(
    behind_haproxy: tuple[EgressProxy, Haproxy],
    origin: HttpOrigin,
    curl: Curl,
    wire: Wire,
    frontend: str,
) -> None:
    proxy, haproxy = behind_haproxy
    host, port = haproxy.address(frontend)
    url = origin.url("origin.test")
    tunnelled = await curl("-p", "-x", f"http://{host}:{port}", url)
    forwarded = await curl("-x", f"http://{host}:{port}", url)
    assert tunnelled.stdout == forwarded.stdout == b"hello from v4"
    assert wire.summary(proxy.records) == [
        ("connect", "origin.test", origin.port, "allow", "allowed"),
        ("http", "origin.test", origin.port, "allow", "allowed"),
    ]
    assert proxy.proxy_protocol_refusals == {}


async def test_socks5_through_haproxy_v2(
    behind_haproxy: tuple[EgressProxy, Haproxy], origin: HttpOrigin, curl: Curl, wire: Wire
) -> None:
    proxy, haproxy = behind_haproxy
    host, port = haproxy.address("socks")
    result = await curl("--socks5-hostname", f"{host}:{port}", origin.url("origin.test"))
    assert result.stdout == b"hello from v4"
    assert wire.summary(proxy.records) == [
        ("socks5", "origin.test", origin.port, "allow", "allowed")
    ]


async def _tunnel_from(
    source: str, address: tuple[str, int], target_port: int
) -> tuple[int, asyncio.StreamWriter]:
    """A CONNECT from the loopback address `source`; the reply's status, and the writer."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(*address, local_addr=(source, 0)), IO_TIMEOUT
    )
    writer.write(connect_line(target_port))
    await writer.drain()
    status, _, _ = await Wire.read_head(reader)
    if status == 200:
        writer.write(b"ping")
        await writer.drain()
        assert await Wire.read_exactly(reader, 4) == b"ping"
    return status, writer


@pytest.mark.parametrize("frontend", ["v1", "v2"])
async def test_the_per_client_cap_counts_the_client_behind_haproxy(
    behind_haproxy: tuple[EgressProxy, Haproxy],
    origins: Origins,
    proxy_log: list[str],
    frontend: str,
) -> None:
    """HAProxy connects from 127.0.0.1 each time; the header names 127.0.0.5 or 127.0.0.6.
    With max_connections_per_client = 1, a second tunnel of 127.0.0.5 is refused while
    127.0.0.6 gets its own: without the header all three would be one client."""
    proxy, haproxy = behind_haproxy
    echo: EchoOrigin = await origins.echo()
    address = haproxy.address(frontend)
    first, held = await _tunnel_from("127.0.0.5", address, echo.port)
    second, refused = await _tunnel_from("127.0.0.5", address, echo.port)
    third, other = await _tunnel_from("127.0.0.6", address, echo.port)
    try:
        assert (first, second, third) == (200, 503, 200)
        # (The refused one lingers a moment after its reply: it still counts meanwhile.)
        assert set(proxy.state.per_client) == {"127.0.0.5", "127.0.0.6"}
        reasons = [r.reason.value for r in proxy.records]
        assert reasons == ["allowed", "too_many_connections", "allowed"]
        # The refusal's line names the client behind HAProxy.
        assert any("too_many_connections (client 127.0.0.5)" in line for line in proxy_log)
    finally:
        for writer in (held, refused, other):
            await Wire.close(writer)
    await until(lambda: not proxy.state.per_client, "the tunnels to end")


# -- raw senders ------------------------------------------------------------------------------


Pair = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def raw(proxy: EgressProxy, data: bytes) -> Pair:
    """A connection to the HTTP listener that has sent `data`."""
    reader, writer = await Wire.open(proxy.http_address)
    if data:
        writer.write(data)
        await writer.drain()
    return reader, writer


async def test_a_header_names_the_client_and_the_request_follows_in_the_same_write(
    start_proxy: StartProxy, origins: Origins, wire: Wire
) -> None:
    proxy = await start_proxy(proxy_protocol_from=["127.0.0.0/8"])
    echo = await origins.echo()
    for header in (
        build_v1((CLAIMED, 4242), (BALANCER_SIDE, 80)),
        build_v2((CLAIMED, 4242), (BALANCER_SIDE, 80), ((1, b"h2"), (4, b""))),
    ):
        reader, writer = await raw(proxy, header + connect_line(echo.port) + b"early")
        status, _, _ = await wire.read_head(reader)
        assert status == 200
        assert await wire.read_exactly(reader, 5) == b"early"  # bytes behind the head
        assert proxy.state.per_client == {str(CLAIMED): 1}
        await Wire.close(writer)
        await until(lambda: not proxy.state.per_client, "the tunnel to end")
    assert [r.reason.value for r in proxy.records] == ["allowed", "allowed"]


async def test_a_header_fed_byte_by_byte_then_socks5(
    start_proxy: StartProxy, origins: Origins, wire: Wire
) -> None:
    proxy = await start_proxy(proxy_protocol_from=["127.0.0.1"])
    echo = await origins.echo()
    header = build_v2((ipaddress.ip_address("2001:db8::5"), 1), (ipaddress.ip_address("::1"), 2))
    reader, writer = await wire.open(proxy.socks_address)
    for i in range(len(header)):
        writer.write(header[i : i + 1])
        await writer.drain()
    writer.write(wire.socks_hello("origin.test", echo.port, as_domain=True))
    assert await wire.read_socks_reply(reader) == 0
    assert proxy.state.per_client == {"2001:db8::5": 1}
    await wire.close(writer)


async def test_local_and_unknown_headers_count_the_balancer_itself(
    start_proxy: StartProxy, origins: Origins, wire: Wire
) -> None:
    proxy = await start_proxy(proxy_protocol_from=["127.0.0.1"])
    echo = await origins.echo()
    for header in (build_v2(None), b"PROXY UNKNOWN\r\n"):
        reader, writer = await raw(proxy, header + connect_line(echo.port))
        assert (await wire.read_head(reader))[0] == 200
        assert proxy.state.per_client == {"127.0.0.1": 1}
        await Wire.close(writer)
        await until(lambda: not proxy.state.per_client, "the tunnel to end")


REFUSED = [
    (b"CONNECT origin.test:443 HTTP/1.1\r\n\r\n", "not_proxy_protocol"),
    (b"\x05\x01\x00", "not_proxy_protocol"),
    (
        b"PROXY TCP4 198.51.100.7 192.0.2.1 +80 443\r\nCONNECT a:1 HTTP/1.1\r\n\r\n",
        "malformed_header",
    ),
    (b"PROXY UNKNOWN " + b"x" * 200, "header_too_long"),
    (V2_SIGNATURE + bytes([0x21, 0x11, 0xFF, 0xFF]), "header_too_long"),
    (V2_SIGNATURE + bytes([0x21, 0x12, 0, 12]) + bytes(12), "unsupported_header"),
    (V2_SIGNATURE + bytes([0x21, 0x11, 0, 15]) + bytes(12) + b"\x01\x00\x09", "malformed_header"),
]


async def test_what_no_balancer_sends_is_closed_counted_said_once_and_not_audited(
    start_proxy: StartProxy, capfd: pytest.CaptureFixture[str]
) -> None:
    proxy = await start_proxy(proxy_protocol_from=["127.0.0.1"])
    for data, _ in REFUSED * 2:
        reader, writer = await raw(proxy, data)
        assert await closed_without_reply(reader), data
        await Wire.close(writer)
    expected: dict[str, int] = {}
    for _, cause in REFUSED * 2:
        expected[cause] = expected.get(cause, 0) + 1
    await until(lambda: proxy.proxy_protocol_refusals == expected, "the refusals to be counted")
    assert proxy.records == []
    said = [line for line in capfd.readouterr().err.splitlines() if "proxy protocol" in line]
    assert sorted(line.split("(")[-1].split(";")[0] for line in said) == sorted(set(expected))
    assert not proxy.state.connections and not proxy.state.per_client


async def test_an_untrusted_sender_is_refused_before_it_sends(
    start_proxy: StartProxy, origins: Origins, capfd: pytest.CaptureFixture[str]
) -> None:
    proxy = await start_proxy(proxy_protocol_from=["127.0.0.2/32", "::1"])
    echo = await origins.echo()
    header = build_v1((CLAIMED, 1), (BALANCER_SIDE, 2))
    for _ in range(3):  # from 127.0.0.1, with a perfectly good header
        reader, writer = await raw(proxy, header + connect_line(echo.port))
        assert await closed_without_reply(reader)
        await Wire.close(writer)
    await until(lambda: proxy.proxy_protocol_refusals == {"untrusted_source": 3}, "counts")
    assert proxy.records == [] and echo.accepted == 0
    said = [line for line in capfd.readouterr().err.splitlines() if "untrusted_source" in line]
    assert len(said) == 1 and "127.0.0.1" in said[0]
    # 127.0.0.2 is trusted: the same bytes from there work.
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(*proxy.http_address or ("", 0), local_addr=("127.0.0.2", 0)),
        IO_TIMEOUT,
    )
    writer.write(header + connect_line(echo.port))
    assert (await Wire.read_head(reader))[0] == 200
    await Wire.close(writer)


async def test_slow_and_silent_senders_lose_their_slot(start_proxy: StartProxy) -> None:
    proxy = await start_proxy(
        proxy_protocol_from=["127.0.0.1"], limits=Limits(head_timeout=HEAD_TIMEOUT)
    )
    slow, slow_w = await raw(proxy, b"PROXY TCP4 198.51")  # and then nothing
    assert await closed_without_reply(slow)
    await Wire.close(slow_w)
    reader, writer = await Wire.open(proxy.http_address)
    writer.write_eof()  # closes before a whole header
    assert await closed_without_reply(reader)
    await Wire.close(writer)
    await until(
        lambda: proxy.proxy_protocol_refusals == {"header_timeout": 1, "closed_before_header": 1},
        "the refusals",
    )
    assert not proxy.state.connections and proxy.records == []


async def test_a_connection_waiting_for_its_header_is_aborted_by_the_drain(
    start_proxy: StartProxy,
) -> None:
    proxy = await start_proxy(proxy_protocol_from=["127.0.0.1"])
    reader, writer = await raw(proxy, b"PROXY ")
    await until(lambda: len(proxy.state.connections) == 1, "the connection to be held")
    await proxy.close(0)
    assert await closed_without_reply(reader)
    await Wire.close(writer)


async def test_without_the_option_a_header_is_just_a_bad_request(
    start_proxy: StartProxy, wire: Wire
) -> None:
    proxy = await start_proxy()
    reply = await wire.exchange(proxy.http_address, b"PROXY UNKNOWN\r\n\r\n")
    assert reply.status == 400


# -- serve --proxy-protocol -------------------------------------------------------------------


def _serve(policy: Path, *flags: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSBOX_UPSTREAM")}
    return subprocess.Popen(
        [sys.executable, "-m", "egressbox", "serve", "--policy", str(policy), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )


def _policy_file(workdir: Path, port: int) -> Path:
    path = workdir / "policy.toml"
    path.write_text(f'[egress]\nallow = ["127.0.0.1:{port}"]\nallow_cidrs = ["127.0.0.1/32"]\n')
    return path


async def test_serve_with_proxy_protocol(origins: Origins, workdir: Path, wire: Wire) -> None:
    echo = await origins.echo()
    proc = _serve(_policy_file(workdir, echo.port), "--proxy-protocol", "--quiet")
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), START_TIMEOUT)
        ready = json.loads(line)
        host, port = ready["http"].rsplit(":", 1)
        reader, writer = await wire.open((host, int(port)))
        header = build_v1((CLAIMED, 1), (BALANCER_SIDE, 2))
        writer.write(header + connect_line(echo.port, "127.0.0.1") + b"x")
        assert (await wire.read_head(reader))[0] == 200
        assert await wire.read_exactly(reader, 1) == b"x"
        await wire.close(writer)
        reader, writer = await wire.open((host, int(port)))
        writer.write(connect_line(echo.port, "127.0.0.1"))  # no header: refused
        assert await closed_without_reply(reader)
        await wire.close(writer)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(proc.communicate, timeout=START_TIMEOUT)
    assert proc.returncode == 0
    assert b"not_proxy_protocol" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--proxy-protocol-from", "10.0.0.1/8"], b"--proxy-protocol-from"),
        (["--proxy-protocol-from", "balancer.example"], b"--proxy-protocol-from"),
    ],
)
async def test_serve_refuses_bad_trusted_lists(
    workdir: Path, flags: list[str], message: bytes
) -> None:
    proc = _serve(_policy_file(workdir, 1), *flags)
    out, err = await asyncio.to_thread(proc.communicate, timeout=START_TIMEOUT)
    assert proc.returncode == 2 and out == b""
    assert message in err
