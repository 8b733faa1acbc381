"""The TLS name check on tunnels, with real TLS clients and a real TLS origin on loopback.

A Python `ssl` client goes through CONNECT (and SOCKS5, with python-socks) to a
TLS origin that keeps every raw byte it receives, so what reached the upstream is
judged from the origin's side: with the target's name the handshake completes and
the origin got exactly the client's bytes; with another name the client's
connection is closed, the origin got nothing, and one `sni_mismatch` record says
so. `tls_name_check = "off"` lets the other name through; a client that sends
nothing after its tunnel opens is closed by the head timeout; a server that
speaks first is relayed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import ssl
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest
from python_socks.async_.asyncio import Proxy

from egressbox.audit.record import JsonlFileSink
from egressbox.core.policy import parse_policy
from proxy_fixtures import BASE_POLICY, IO_TIMEOUT
from tls_hellos import ech_hello, handshake_message, real_hello, records

if TYPE_CHECKING:
    from pathlib import Path

    from egressbox.proxy.server import EgressProxy
    from proxy_fixtures import Origins, StartProxy, TlsFiles, Wire

pytestmark = pytest.mark.usefixtures("dials")

NAME = "tls.ok.test"  # the origin's certificate name; BASE_POLICY admits *.ok.test
OTHER = "other.ok.test"  # admitted too, but not the tunnel's target
HEAD_TIMEOUT = 1.0  # for the silent-client test: a timer, not a hang
RECORD_KEYS = {"ts", "protocol", "host", "port", "decision", "reason"}


def policy_with(**egress: Any) -> dict[str, Any]:
    policy = copy.deepcopy(BASE_POLICY)
    policy["egress"].update(egress)
    return policy


# -- a TLS origin that keeps the raw bytes ------------------------------------------------


@dataclass
class Seen:
    raw: bytearray = field(default_factory=bytearray)
    handshake: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class RawTlsOrigin:
    """A TLS server over a MemoryBIO: records what arrives before TLS reads it, and
    answers every application-data read with `hello over tls`."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.context = context
        self.connections: list[Seen] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> RawTlsOrigin:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen = Seen()
        self.connections.append(seen)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        server = self.context.wrap_bio(incoming, outgoing, server_side=True)
        try:
            while data := await reader.read(65536):
                seen.raw += data
                incoming.write(data)
                self._step(server, seen)
                if pending := outgoing.read():
                    writer.write(pending)
                    await writer.drain()
        except (ssl.SSLError, ConnectionError):
            pass
        finally:
            seen.ended.set()
            writer.close()

    @staticmethod
    def _step(server: ssl.SSLObject, seen: Seen) -> None:
        if not seen.handshake:
            try:
                server.do_handshake()
            except ssl.SSLWantReadError:
                return
            seen.handshake = True
        with contextlib.suppress(ssl.SSLWantReadError):
            if server.read(65536):
                server.write(b"hello over tls\n")

    async def only_connection(self) -> Seen:
        """The one connection the proxy made, once it has ended or handshaken."""
        async with asyncio.timeout(IO_TIMEOUT):
            while not self.connections:
                await asyncio.sleep(0.01)
        assert len(self.connections) == 1
        return self.connections[0]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()


@pytest.fixture
async def tls_origin(tls_files: TlsFiles) -> Any:
    origin = await RawTlsOrigin(tls_files.server_context()).start()
    try:
        yield origin
    finally:
        await origin.close()


def client_context(tls_files: TlsFiles, *, check_hostname: bool = True) -> ssl.SSLContext:
    context = tls_files.client_context()
    context.check_hostname = check_hostname
    return context


# -- clients ------------------------------------------------------------------------------------


async def connect_tunnel(
    proxy: EgressProxy, wire: Wire, target: str, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await wire.open(proxy.http_address)
    authority = f"[{target}]:{port}" if ":" in target else f"{target}:{port}"
    writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    status, _, _ = await wire.read_head(reader)
    assert status == 200
    return reader, writer


async def tls_exchange(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    context: ssl.SSLContext,
    server_hostname: str,
) -> bytes:
    """A TLS handshake over an open tunnel, one request line and its answer."""
    async with asyncio.timeout(IO_TIMEOUT):
        await writer.start_tls(context, server_hostname=server_hostname)
        writer.write(b"ping\n")
        return await reader.readline()


async def refused_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    context: ssl.SSLContext,
    server_hostname: str,
) -> BaseException:
    """The handshake fails: the proxy answered with an alert and closed."""
    with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)) as caught:
        await tls_exchange(reader, writer, context, server_hostname)
    return caught.value


def assert_unrecognized_name(error: BaseException) -> None:
    # The proxy's alert (unrecognized_name) when the client's TLS stack reports it.
    if isinstance(error, ssl.SSLError):
        assert "UNRECOGNIZED_NAME" in str(error).upper().replace(" ", "_"), error


async def close(writer: asyncio.StreamWriter) -> None:
    """Close a client at once (no TLS close_notify exchange to wait for); after a
    refused handshake, waiting re-raises its error."""
    writer.transport.abort()
    with contextlib.suppress(ConnectionError, TimeoutError, ssl.SSLError):
        await asyncio.wait_for(writer.wait_closed(), IO_TIMEOUT)


async def wait_records(proxy: EgressProxy, count: int) -> None:
    async with asyncio.timeout(IO_TIMEOUT):
        while len(proxy.records) < count:
            await asyncio.sleep(0.01)


# -- CONNECT --------------------------------------------------------------------------------


async def test_connect_with_the_target_name_completes_the_handshake(
    proxy: EgressProxy, tls_origin: RawTlsOrigin, tls_files: TlsFiles, wire: Wire
) -> None:
    reader, writer = await connect_tunnel(proxy, wire, NAME, tls_origin.port)
    try:
        assert await tls_exchange(reader, writer, client_context(tls_files), NAME) == (
            b"hello over tls\n"
        )
    finally:
        await close(writer)
    seen = await tls_origin.only_connection()
    assert seen.handshake
    assert wire.summary(proxy.records) == [("connect", NAME, tls_origin.port, "allow", "allowed")]


async def test_connect_with_another_name_is_closed_before_any_byte_goes_upstream(
    proxy: EgressProxy, tls_origin: RawTlsOrigin, tls_files: TlsFiles, wire: Wire
) -> None:
    reader, writer = await connect_tunnel(proxy, wire, NAME, tls_origin.port)
    try:
        error = await refused_handshake(reader, writer, client_context(tls_files), OTHER)
        # Written before the close: already there when the client sees it.
        assert len(proxy.records) == 2
    finally:
        await close(writer)
    assert_unrecognized_name(error)
    seen = await tls_origin.only_connection()
    async with asyncio.timeout(IO_TIMEOUT):
        await seen.ended.wait()  # the proxy closed its upstream connection...
    assert bytes(seen.raw) == b""  # ...without sending it a byte
    assert not seen.handshake
    assert wire.summary(proxy.records) == [
        ("connect", NAME, tls_origin.port, "allow", "allowed"),
        ("connect", NAME, tls_origin.port, "deny", "sni_mismatch"),
    ]


async def test_the_record_has_exactly_six_keys(
    start_proxy: StartProxy,
    tls_origin: RawTlsOrigin,
    tls_files: TlsFiles,
    wire: Wire,
    tmp_path: Path,
) -> None:
    log = tmp_path / "audit.jsonl"
    proxy = await start_proxy(audit=JsonlFileSink(log), keep_records=False)
    reader, writer = await connect_tunnel(proxy, wire, NAME.upper() + ".", tls_origin.port)
    try:
        await refused_handshake(reader, writer, client_context(tls_files), OTHER)
    finally:
        await close(writer)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [set(line) for line in lines] == [RECORD_KEYS, RECORD_KEYS]
    # host: the target as normalized, never the ClientHello's name.
    assert [(r["host"], r["decision"], r["reason"]) for r in lines] == [
        (NAME, "allow", "allowed"),
        (NAME, "deny", "sni_mismatch"),
    ]


async def test_an_ip_literal_target_takes_a_name_the_rules_admit(
    proxy: EgressProxy, tls_origin: RawTlsOrigin, tls_files: TlsFiles, wire: Wire
) -> None:
    # 127.0.0.1 is allowed as an IP literal; tls.ok.test by *.ok.test: the SNI passes.
    reader, writer = await connect_tunnel(proxy, wire, "127.0.0.1", tls_origin.port)
    try:
        answer = await tls_exchange(reader, writer, client_context(tls_files), NAME)
    finally:
        await close(writer)
    assert answer == b"hello over tls\n"
    # unlisted.test has no allow entry: naming it inside a tunnel to an IP is refused.
    reader, writer = await connect_tunnel(proxy, wire, "127.0.0.1", tls_origin.port)
    try:
        await refused_handshake(reader, writer, client_context(tls_files), "unlisted.test")
    finally:
        await close(writer)
    assert wire.summary(proxy.records) == [
        ("connect", "127.0.0.1", tls_origin.port, "allow", "allowed"),
        ("connect", "127.0.0.1", tls_origin.port, "allow", "allowed"),
        ("connect", "127.0.0.1", tls_origin.port, "deny", "sni_mismatch"),
    ]
    assert bytes(tls_origin.connections[1].raw) == b""


async def test_a_pipelined_hello_split_in_records_reaches_the_origin_byte_for_byte(
    proxy: EgressProxy, tls_origin: RawTlsOrigin, wire: Wire
) -> None:
    message = handshake_message(real_hello(NAME))
    flight = records(message, [7, 100, 101, 300])
    authority = f"{NAME}:{tls_origin.port}"
    head = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()
    reader, writer = await wire.open(proxy.http_address)
    try:
        writer.write(head + flight[:3])  # the head and the first bytes of the hello together
        status, _, _ = await wire.read_head(reader)
        assert status == 200
        for start in range(3, len(flight), 64):  # the rest in pieces, one loop turn apart
            writer.write(flight[start : start + 64])
            await writer.drain()
            await asyncio.sleep(0.005)
        seen = await tls_origin.only_connection()
        async with asyncio.timeout(IO_TIMEOUT):
            while len(seen.raw) < len(flight):
                await asyncio.sleep(0.01)
        assert bytes(seen.raw) == flight
    finally:
        await close(writer)
    assert len(proxy.records) == 1


async def test_a_pipelined_hello_for_another_name_never_leaves_the_proxy(
    proxy: EgressProxy, tls_origin: RawTlsOrigin, wire: Wire
) -> None:
    authority = f"{NAME}:{tls_origin.port}"
    head = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()
    reader, writer = await wire.open(proxy.http_address)
    try:
        writer.write(head + real_hello(OTHER))
        status, _, _ = await wire.read_head(reader)
        assert status == 200
        # The alert (unrecognized_name), then the close.
        assert await wire.read_to_eof(reader) == bytes([0x15, 3, 3, 0, 2, 2, 112])
    finally:
        await close(writer)
    seen = await tls_origin.only_connection()
    async with asyncio.timeout(IO_TIMEOUT):
        await seen.ended.wait()
    assert bytes(seen.raw) == b""
    assert wire.summary(proxy.records)[1:] == [
        ("connect", NAME, tls_origin.port, "deny", "sni_mismatch")
    ]


@pytest.mark.parametrize(
    ("public_name", "refused"), [(OTHER.encode(), True), (NAME.encode(), False), (None, True)]
)
async def test_ech_outer_name_must_be_the_target(
    proxy: EgressProxy,
    tls_origin: RawTlsOrigin,
    wire: Wire,
    public_name: bytes | None,
    refused: bool,
) -> None:
    reader, writer = await connect_tunnel(proxy, wire, NAME, tls_origin.port)
    hello = ech_hello(public_name)
    try:
        writer.write(hello)
        seen = await tls_origin.only_connection()
        if refused:
            assert (await wire.read_to_eof(reader))[:2] == b"\x15\x03"
            async with asyncio.timeout(IO_TIMEOUT):
                await seen.ended.wait()
            assert bytes(seen.raw) == b""
        else:
            async with asyncio.timeout(IO_TIMEOUT):
                while len(seen.raw) < len(hello):
                    await asyncio.sleep(0.01)
            assert bytes(seen.raw) == hello  # (the origin then fails the fake hello)
    finally:
        await close(writer)
    reasons = [r.reason.value for r in proxy.records]
    assert reasons == (["allowed", "sni_mismatch"] if refused else ["allowed"])


async def test_off_lets_another_name_through(
    start_proxy: StartProxy, tls_origin: RawTlsOrigin, tls_files: TlsFiles, wire: Wire
) -> None:
    proxy = await start_proxy(policy_with(tls_name_check="off"))
    reader, writer = await connect_tunnel(proxy, wire, NAME, tls_origin.port)
    try:
        # The certificate names tls.ok.test: only the client's own name check is off.
        context = client_context(tls_files, check_hostname=False)
        assert await tls_exchange(reader, writer, context, OTHER) == b"hello over tls\n"
    finally:
        await close(writer)
    assert (await tls_origin.only_connection()).handshake
    assert wire.summary(proxy.records) == [("connect", NAME, tls_origin.port, "allow", "allowed")]


async def test_report_mode_audits_would_deny_and_lets_it_through(
    start_proxy: StartProxy, tls_origin: RawTlsOrigin, tls_files: TlsFiles, wire: Wire
) -> None:
    proxy = await start_proxy(policy_with(mode="report"))
    reader, writer = await connect_tunnel(proxy, wire, NAME, tls_origin.port)
    try:
        context = client_context(tls_files, check_hostname=False)
        assert await tls_exchange(reader, writer, context, OTHER) == b"hello over tls\n"
    finally:
        await close(writer)
    assert wire.summary(proxy.records) == [
        ("connect", NAME, tls_origin.port, "allow", "allowed"),
        ("connect", NAME, tls_origin.port, "would_deny", "sni_mismatch"),
    ]


# -- SOCKS5 ------------------------------------------------------------------------------


async def socks_tunnel(
    proxy: EgressProxy, host: str, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    assert proxy.socks_address is not None
    address = f"{proxy.socks_address[0]}:{proxy.socks_address[1]}"
    client = Proxy.from_url(f"socks5://{address}", rdns=True)
    sock = await client.connect(host, port, timeout=IO_TIMEOUT)
    return await asyncio.open_connection(sock=sock)


async def test_socks5_with_the_target_name_completes_the_handshake(
    proxy: EgressProxy, tls_origin: RawTlsOrigin, tls_files: TlsFiles, wire: Wire
) -> None:
    reader, writer = await socks_tunnel(proxy, NAME, tls_origin.port)
    try:
        answer = await tls_exchange(reader, writer, client_context(tls_files), NAME)
    finally:
        await close(writer)
    assert answer == b"hello over tls\n"
    assert wire.summary(proxy.records) == [("socks5", NAME, tls_origin.port, "allow", "allowed")]


async def test_socks5_with_another_name_is_closed_before_any_byte_goes_upstream(
    proxy: EgressProxy, tls_origin: RawTlsOrigin, tls_files: TlsFiles, wire: Wire
) -> None:
    reader, writer = await socks_tunnel(proxy, NAME, tls_origin.port)
    try:
        error = await refused_handshake(reader, writer, client_context(tls_files), OTHER)
        assert len(proxy.records) == 2
    finally:
        await close(writer)
    assert_unrecognized_name(error)
    seen = await tls_origin.only_connection()
    async with asyncio.timeout(IO_TIMEOUT):
        await seen.ended.wait()
    assert bytes(seen.raw) == b""
    assert wire.summary(proxy.records) == [
        ("socks5", NAME, tls_origin.port, "allow", "allowed"),
        ("socks5", NAME, tls_origin.port, "deny", "sni_mismatch"),
    ]


async def test_socks5_off_lets_another_name_through(
    start_proxy: StartProxy, tls_origin: RawTlsOrigin, tls_files: TlsFiles, wire: Wire
) -> None:
    proxy = await start_proxy(policy_with(tls_name_check="off"))
    reader, writer = await socks_tunnel(proxy, NAME, tls_origin.port)
    try:
        context = client_context(tls_files, check_hostname=False)
        assert await tls_exchange(reader, writer, context, OTHER) == b"hello over tls\n"
    finally:
        await close(writer)
    assert [r.reason.value for r in proxy.records] == ["allowed"]


# -- the timer, server-first protocols, drain ------------------------------------------------


@pytest.mark.parametrize("route", ["connect", "socks5"])
async def test_a_silent_client_is_closed_by_the_head_timeout(
    start_proxy: StartProxy, tls_origin: RawTlsOrigin, wire: Wire, route: str
) -> None:
    policy = policy_with()
    policy["limits"] = {"head_timeout": HEAD_TIMEOUT}
    proxy = await start_proxy(policy)
    if route == "connect":
        reader, writer = await connect_tunnel(proxy, wire, NAME, tls_origin.port)
    else:
        reader, writer = await socks_tunnel(proxy, NAME, tls_origin.port)
    started = time.monotonic()
    try:
        assert await wire.read_to_eof(reader) == b""  # bounded by IO_TIMEOUT
    finally:
        await close(writer)
    waited = time.monotonic() - started
    assert HEAD_TIMEOUT * 0.5 <= waited < IO_TIMEOUT
    seen = await tls_origin.only_connection()
    async with asyncio.timeout(IO_TIMEOUT):
        await seen.ended.wait()
    assert bytes(seen.raw) == b""
    assert [r.reason.value for r in proxy.records] == ["allowed"]  # a timeout is no decision
    async with asyncio.timeout(IO_TIMEOUT):
        while proxy.state.connections or proxy.state.tunnels:
            await asyncio.sleep(0.01)


async def test_a_server_that_speaks_first_is_relayed_at_once(
    start_proxy: StartProxy, wire: Wire
) -> None:
    async def banner_then_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-test\r\n")
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
        writer.close()

    server = await asyncio.start_server(banner_then_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    policy = policy_with()
    policy["limits"] = {"head_timeout": 30.0}  # far longer than the wait below allows
    proxy = await start_proxy(policy)
    try:
        reader, writer = await connect_tunnel(proxy, wire, "origin.test", port)
        try:
            async with asyncio.timeout(5.0):
                assert await reader.readline() == b"SSH-2.0-test\r\n"
            writer.write(b"\x16\x03\x01 not checked once the server has spoken\n")
            async with asyncio.timeout(IO_TIMEOUT):
                assert await reader.readline() == (
                    b"\x16\x03\x01 not checked once the server has spoken\n"
                )
        finally:
            await close(writer)
    finally:
        server.close()
    assert [r.reason.value for r in proxy.records] == ["allowed"]


async def test_a_client_that_only_half_closes_passes_its_eof_on(
    proxy: EgressProxy, origins: Origins, wire: Wire
) -> None:
    echo = await origins.echo()
    reader, writer = await connect_tunnel(proxy, wire, "origin.test", echo.port)
    try:
        writer.write_eof()
        assert await wire.read_to_eof(reader) == b""
    finally:
        await close(writer)
    assert echo.accepted == 1
    assert bytes(echo.received[0]) == b""


async def test_close_denied_sees_a_tunnel_waiting_for_its_first_bytes(
    proxy: EgressProxy, tls_origin: RawTlsOrigin, wire: Wire
) -> None:
    reader, writer = await connect_tunnel(proxy, wire, NAME, tls_origin.port)
    try:
        deny_all = parse_policy({"egress": {"allow": []}}, env={})
        assert proxy.set_policy(deny_all, close_denied=True) == 1
        assert await wire.read_to_eof(reader) == b""
    finally:
        await close(writer)
    seen = await tls_origin.only_connection()
    async with asyncio.timeout(IO_TIMEOUT):
        await seen.ended.wait()
    assert bytes(seen.raw) == b""
