"""Real clients through a real EgressProxy to real origins, all on loopback.

curl (CONNECT, plain forwarding, SOCKS5 with and without remote names),
python-socks, aiohttp, http.client and urllib; bodies with either framing,
a download of a few MiB checked by sha256, keep-alive with a fresh decision
per request, and bytes pipelined behind a CONNECT or a SOCKS5 handshake.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import io
import json
import os
import random
import socket
import urllib.request
from typing import TYPE_CHECKING

import aiohttp
import pytest
from python_socks import ProxyError
from python_socks.async_.asyncio import Proxy

from egressbox.proxy.server import EgressProxy

if TYPE_CHECKING:
    from pathlib import Path

    from dnsserver import DnsServer
    from proxy_fixtures import (
        Curl,
        EchoOrigin,
        HttpOrigin,
        Origins,
        StartProxy,
        TlsFiles,
        Wire,
    )

IO_TIMEOUT = 15.0

pytestmark = pytest.mark.usefixtures("dials")

# How curl is pointed at the proxy, and the audit protocol each route records.
ROUTES = {
    "connect": "connect",  # -p -x http://PROXY: a CONNECT tunnel for http://
    "plain": "http",  # -x http://PROXY: absolute-form forwarding
    "socks5h": "socks5",  # --socks5-hostname: the proxy resolves the name
    "socks5": "socks5",  # --socks5: curl sends an address (IP literals only here)
}


def socks_authority(proxy: EgressProxy) -> str:
    assert proxy.socks_address is not None
    host, port = proxy.socks_address
    return f"{host}:{port}"


def route_args(proxy: EgressProxy, route: str) -> list[str]:
    assert proxy.http_url is not None
    if route == "connect":
        return ["-p", "-x", proxy.http_url]
    if route == "plain":
        return ["-x", proxy.http_url]
    if route == "socks5h":
        return ["--socks5-hostname", socks_authority(proxy)]
    assert route == "socks5"
    return ["--socks5", socks_authority(proxy)]


def allowed(route: str, host: str, port: int) -> tuple[str, str, int, str, str]:
    return (ROUTES[route], host, port, "allow", "allowed")


# -- curl ----------------------------------------------------------------------------


# (route, host in the URL): curl's plain --socks5 resolves names itself, so it
# only gets IP literals (a test name must never reach the system resolver).
V4_CASES = [
    ("connect", "origin.test"),
    ("plain", "origin.test"),
    ("socks5h", "origin.test"),
    ("connect", "127.0.0.1"),
    ("plain", "127.0.0.1"),
    ("socks5h", "127.0.0.1"),
    ("socks5", "127.0.0.1"),
]


@pytest.mark.parametrize(("route", "host"), V4_CASES)
async def test_curl_reaches_an_ipv4_origin(
    curl: Curl, proxy: EgressProxy, origin: HttpOrigin, wire: Wire, route: str, host: str
) -> None:
    result = await curl(*route_args(proxy, route), origin.url(host))
    assert result.stdout == b"hello from v4"
    assert wire.summary(proxy.records) == [allowed(route, host, origin.port)]
    assert origin.accepted == 1


V6_CASES = [
    ("connect", "v6.test"),
    ("plain", "v6.test"),
    ("socks5h", "v6.test"),
    ("connect", "[::1]"),
    ("plain", "[::1]"),
    ("socks5h", "[::1]"),
    ("socks5", "[::1]"),
]


@pytest.mark.parametrize(("route", "host"), V6_CASES)
async def test_curl_reaches_an_ipv6_loopback_origin(
    curl: Curl,
    proxy: EgressProxy,
    origins: Origins,
    wire: Wire,
    route: str,
    host: str,
) -> None:
    origin6 = await origins.http("::1", label="v6")
    result = await curl(*route_args(proxy, route), origin6.url(host))
    assert result.stdout == b"hello from v6"
    audited = "::1" if host == "[::1]" else host
    assert wire.summary(proxy.records) == [allowed(route, audited, origin6.port)]
    assert origin6.accepted == 1


async def test_curl_socks5_ip_literal_needs_an_ip_allow_entry(
    curl: Curl, start_proxy: StartProxy, origin: HttpOrigin, wire: Wire
) -> None:
    # Names and allow_cidrs alone never admit an IP literal destination.
    policy = {"egress": {"allow": ["origin.test", "localhost"], "allow_cidrs": ["127.0.0.1/32"]}}
    proxy = await start_proxy(policy)
    result = await curl(*route_args(proxy, "socks5"), origin.url("127.0.0.1"), check=False)
    assert result.returncode != 0
    assert wire.summary(proxy.records) == [
        ("socks5", "127.0.0.1", origin.port, "deny", "no_allow_rule")
    ]
    assert origin.accepted == 0


@pytest.mark.parametrize("route", ["connect", "plain", "socks5h"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_curl_post_body_arrives_intact(
    curl: Curl,
    proxy: EgressProxy,
    origin: HttpOrigin,
    tmp_path: Path,
    wire: Wire,
    route: str,
    framing: str,
) -> None:
    body = random.Random(7).randbytes(1024 * 1024 + 17)
    path = tmp_path / "body.bin"
    path.write_bytes(body)
    extra = ["-H", "Transfer-Encoding: chunked"] if framing == "chunked" else []
    result = await curl(
        *route_args(proxy, route),
        *extra,
        "-H",
        "Content-Type: application/octet-stream",
        "--data-binary",
        f"@{path}",
        origin.url("origin.test", "/echo"),
    )
    info = json.loads(result.stdout)
    assert info["method"] == "POST"
    assert info["body_length"] == len(body)
    assert info["body_sha256"] == hashlib.sha256(body).hexdigest()
    if framing == "chunked":
        # Forwarding re-frames a chunked body with chunks of its own.
        assert info["transfer_encoding"] == "chunked"
        assert info["content_length"] is None
    else:
        assert info["content_length"] == str(len(body))
    assert wire.summary(proxy.records) == [allowed(route, "origin.test", origin.port)]


@pytest.mark.parametrize("route", ["connect", "plain", "socks5h"])
@pytest.mark.parametrize("path", ["/big", "/big-chunked"])
async def test_curl_large_download_is_intact(
    curl: Curl, proxy: EgressProxy, origin: HttpOrigin, wire: Wire, route: str, path: str
) -> None:
    result = await curl(*route_args(proxy, route), origin.url("origin.test", path))
    assert len(result.stdout) == len(wire.big_body)
    assert hashlib.sha256(result.stdout).hexdigest() == wire.big_sha256


async def test_curl_keep_alive_gets_a_decision_and_an_upstream_per_request(
    curl: Curl, proxy: EgressProxy, origin: HttpOrigin, wire: Wire
) -> None:
    first = origin.url("origin.test", "/hello")
    second = origin.url("127.0.0.1", "/echo")
    result = await curl(
        "-x",
        str(proxy.http_url),
        "-w",
        "%{http_code} %{num_connects}\\n",
        first,
        "-o",
        os.devnull,
        second,
        "-o",
        os.devnull,
    )
    # One client connection (the second transfer made no new connect)...
    assert result.stdout.decode().splitlines() == ["200 1", "200 0"]
    # ...two decisions, and two upstream connections (never pooled).
    assert wire.summary(proxy.records) == [
        allowed("plain", "origin.test", origin.port),
        allowed("plain", "127.0.0.1", origin.port),
    ]
    assert origin.accepted == 2
    assert [r.path_qs for r in origin.requests] == ["/hello", "/echo"]


async def test_curl_keep_alive_second_request_to_a_denied_host_gets_403(
    curl: Curl,
    proxy: EgressProxy,
    origin: HttpOrigin,
    origins: Origins,
    zone: DnsServer,
    wire: Wire,
) -> None:
    forbidden = origins.tripwire()
    result = await curl(
        "-x",
        str(proxy.http_url),
        "-w",
        "%{http_code} %{num_connects}\\n",
        origin.url("origin.test", "/hello"),
        "-o",
        os.devnull,
        f"http://unlisted.test:{forbidden.port}/",
        "-o",
        os.devnull,
    )
    assert result.stdout.decode().splitlines() == ["200 1", "403 0"]
    assert wire.summary(proxy.records) == [
        allowed("plain", "origin.test", origin.port),
        ("http", "unlisted.test", forbidden.port, "deny", "no_allow_rule"),
    ]
    assert origin.accepted == 1
    assert forbidden.connections() == 0
    assert zone.queries_for("unlisted.test") == []  # no allow rule: no DNS either


async def test_curl_https_through_connect(
    curl: Curl,
    proxy: EgressProxy,
    origins: Origins,
    tls_files: TlsFiles,
    wire: Wire,
) -> None:
    tls_origin = await origins.http("127.0.0.1", label="tls", tls=tls_files.server_context())
    result = await curl(
        "-x",
        str(proxy.http_url),
        "--cacert",
        str(tls_files.cert),
        tls_origin.url("tls.ok.test", scheme="https"),
    )
    assert result.stdout == b"hello from tls"
    assert wire.summary(proxy.records) == [allowed("connect", "tls.ok.test", tls_origin.port)]


# -- python-socks --------------------------------------------------------------------------


async def http_get_on(sock: socket.socket, host: str, path: str = "/hello") -> bytes:
    """GET over a connected socket (Connection: close); the whole response."""
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        writer.write(request.encode())
        return await asyncio.wait_for(reader.read(), IO_TIMEOUT)
    finally:
        writer.close()


@pytest.mark.parametrize(("rdns", "host"), [(True, "origin.test"), (False, "127.0.0.1")])
async def test_python_socks_connects(
    proxy: EgressProxy, origin: HttpOrigin, wire: Wire, rdns: bool, host: str
) -> None:
    client = Proxy.from_url(f"socks5://{socks_authority(proxy)}", rdns=rdns)
    sock = await client.connect(host, origin.port, timeout=IO_TIMEOUT)
    response = await http_get_on(sock, host)
    assert response.startswith(b"HTTP/1.1 200")
    assert response.endswith(b"hello from v4")
    assert wire.summary(proxy.records) == [allowed("socks5", host, origin.port)]


async def test_python_socks_denied_destination_gets_reply_2(
    proxy: EgressProxy, origins: Origins, wire: Wire
) -> None:
    forbidden = origins.tripwire()
    client = Proxy.from_url(f"socks5://{socks_authority(proxy)}", rdns=True)
    with pytest.raises(ProxyError) as caught:
        await client.connect("unlisted.test", forbidden.port, timeout=IO_TIMEOUT)
    assert caught.value.error_code == 2
    assert wire.summary(proxy.records) == [
        ("socks5", "unlisted.test", forbidden.port, "deny", "no_allow_rule")
    ]
    assert forbidden.connections() == 0


USER, PASSWORD = "alice", "correct-horse"


def check_credentials(user: str, password: str) -> bool:
    return (user, password) == (USER, PASSWORD)


async def test_python_socks_with_the_right_credentials(
    start_proxy: StartProxy, origin: HttpOrigin, wire: Wire
) -> None:
    proxy = await start_proxy(socks_credentials=check_credentials)
    url = f"socks5://{USER}:{PASSWORD}@{socks_authority(proxy)}"
    sock = await Proxy.from_url(url, rdns=True).connect("origin.test", origin.port, IO_TIMEOUT)
    assert (await http_get_on(sock, "origin.test")).endswith(b"hello from v4")
    assert wire.summary(proxy.records) == [allowed("socks5", "origin.test", origin.port)]


@pytest.mark.parametrize(
    "userinfo", [f"{USER}:wrong-password@", f"mallory:{PASSWORD}@", ""], ids=str
)
async def test_python_socks_with_wrong_or_no_credentials_is_refused(
    start_proxy: StartProxy, origin: HttpOrigin, userinfo: str
) -> None:
    proxy = await start_proxy(socks_credentials=check_credentials)
    client = Proxy.from_url(f"socks5://{userinfo}{socks_authority(proxy)}", rdns=True)
    with pytest.raises(ProxyError):
        await client.connect("origin.test", origin.port, timeout=IO_TIMEOUT)
    # Refused at authentication: no destination was decided, nothing dialed.
    assert proxy.records == []
    assert origin.accepted == 0


# -- aiohttp, http.client, urllib ------------------------------------------------------


def client_timeout() -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=IO_TIMEOUT * 2)


async def test_aiohttp_plain_forwarding(proxy: EgressProxy, origin: HttpOrigin, wire: Wire) -> None:
    body = random.Random(3).randbytes(300_000)
    async with aiohttp.ClientSession(timeout=client_timeout()) as session:
        async with session.get(origin.url("origin.test"), proxy=proxy.http_url) as response:
            assert response.status == 200
            assert await response.read() == b"hello from v4"
        url = origin.url("origin.test", "/echo?x=1")
        async with session.post(url, data=body, proxy=proxy.http_url) as response:
            info = await response.json()
        async with session.get(origin.url("origin.test", "/big"), proxy=proxy.http_url) as r:
            big = await r.read()
    assert info["path_qs"] == "/echo?x=1"
    assert info["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert hashlib.sha256(big).hexdigest() == wire.big_sha256
    assert wire.summary(proxy.records) == [allowed("plain", "origin.test", origin.port)] * 3
    # aiohttp keeps its proxy connection, and the proxy keeps the upstream one for
    # the same host, port and address: three decisions, one upstream connection.
    assert origin.accepted == 1


async def test_aiohttp_plain_forwarding_denied_gets_403_with_reason(
    proxy: EgressProxy, origins: Origins, wire: Wire
) -> None:
    forbidden = origins.tripwire()
    async with aiohttp.ClientSession(timeout=client_timeout()) as session:
        url = f"http://blocked.ok.test:{forbidden.port}/"
        async with session.get(url, proxy=proxy.http_url) as response:
            assert response.status == 403
            assert response.headers["X-Egressbox-Reason"] == "deny_rule"
    assert wire.summary(proxy.records) == [
        ("http", "blocked.ok.test", forbidden.port, "deny", "deny_rule")
    ]
    assert forbidden.connections() == 0


async def test_aiohttp_https_through_connect(
    proxy: EgressProxy, origins: Origins, tls_files: TlsFiles, wire: Wire
) -> None:
    tls_origin = await origins.http("127.0.0.1", label="tls", tls=tls_files.server_context())
    url = tls_origin.url("tls.ok.test", scheme="https")
    async with aiohttp.ClientSession(timeout=client_timeout()) as session:
        context = tls_files.client_context()
        async with session.get(url, proxy=proxy.http_url, ssl=context) as response:
            assert await response.read() == b"hello from tls"
    assert wire.summary(proxy.records) == [allowed("connect", "tls.ok.test", tls_origin.port)]


async def test_http_client_set_tunnel(proxy: EgressProxy, origin: HttpOrigin, wire: Wire) -> None:
    assert proxy.http_address is not None
    host, port = proxy.http_address

    def fetch() -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(host, port, timeout=IO_TIMEOUT)
        try:
            conn.set_tunnel("origin.test", origin.port)
            conn.request("GET", "/hello")
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    status, body = await asyncio.wait_for(asyncio.to_thread(fetch), IO_TIMEOUT * 2)
    assert (status, body) == (200, b"hello from v4")
    assert wire.summary(proxy.records) == [allowed("connect", "origin.test", origin.port)]


async def test_urllib_proxy_handler(
    proxy: EgressProxy, origin: HttpOrigin, wire: Wire, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": str(proxy.http_url)}))

    def fetch() -> bytes:
        with opener.open(origin.url("origin.test"), timeout=IO_TIMEOUT) as response:
            data: bytes = response.read()
            return data

    body = await asyncio.wait_for(asyncio.to_thread(fetch), IO_TIMEOUT * 2)
    assert body == b"hello from v4"
    assert wire.summary(proxy.records) == [allowed("plain", "origin.test", origin.port)]


# -- bytes pipelined behind the handshake ------------------------------------------------

PAYLOADS = {
    "small": b"ping\n",
    # Looks like a request: the proxy must relay it, never parse or decide it.
    "request-lookalike": b"GET http://unlisted.test/ HTTP/1.1\r\nHost: unlisted.test\r\n\r\n",
    "large": random.Random(11).randbytes(600_000),
}


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
async def test_connect_with_pipelined_payload(
    proxy: EgressProxy, origins: Origins, wire: Wire, payload: bytes
) -> None:
    echo = await origins.echo()
    reader, writer = await wire.open(proxy.http_address)
    try:
        head = f"CONNECT origin.test:{echo.port} HTTP/1.1\r\nHost: origin.test:{echo.port}\r\n\r\n"
        writer.write(head.encode() + payload)  # one write: head and payload together
        status, _, _ = await wire.read_head(reader)
        assert status == 200
        assert await wire.read_exactly(reader, len(payload)) == payload
        writer.write_eof()
        assert await wire.read_to_eof(reader) == b""
    finally:
        await wire.close(writer)
    assert_echo_saw_exactly(echo, payload)
    assert wire.summary(proxy.records) == [allowed("connect", "origin.test", echo.port)]


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
@pytest.mark.parametrize("with_auth", [False, True], ids=["no-auth", "user-pass"])
async def test_socks5_with_pipelined_payload(
    start_proxy: StartProxy, origins: Origins, wire: Wire, payload: bytes, with_auth: bool
) -> None:
    credentials = (USER, PASSWORD) if with_auth else None
    proxy = await start_proxy(socks_credentials=check_credentials if with_auth else None)
    echo = await origins.echo()
    reader, writer = await wire.open(proxy.socks_address)
    try:
        hello = wire.socks_hello("origin.test", echo.port, credentials=credentials)
        writer.write(hello + payload)  # greeting, (auth,) request and payload in one write
        assert await wire.read_socks_reply(reader, with_auth=with_auth) == 0
        assert await wire.read_exactly(reader, len(payload)) == payload
        writer.write_eof()
        assert await wire.read_to_eof(reader) == b""
    finally:
        await wire.close(writer)
    assert_echo_saw_exactly(echo, payload)
    assert wire.summary(proxy.records) == [allowed("socks5", "origin.test", echo.port)]


def assert_echo_saw_exactly(echo: EchoOrigin, payload: bytes) -> None:
    assert echo.accepted == 1
    assert bytes(echo.received[0]) == payload


# -- plain forwarding: framing and connection handling seen on the wire ---------------------


def get(host: str, port: int, path: str, method: str = "GET", extra: str = "") -> bytes:
    return (
        f"{method} http://{host}:{port}{path} HTTP/1.1\r\nHost: {host}:{port}\r\n{extra}\r\n"
    ).encode()


async def test_plain_pipelined_requests_are_each_decided_in_order(
    proxy: EgressProxy, origin: HttpOrigin, origins: Origins, wire: Wire
) -> None:
    forbidden = origins.tripwire()
    port = origin.port
    reader, writer = await wire.open(proxy.http_address)
    try:
        writer.write(  # three requests in one write
            get("origin.test", port, "/hello")
            + get("127.0.0.1", port, "/echo?n=2")
            + get("unlisted.test", forbidden.port, "/")
        )
        first = await wire.read_reply(reader, expect_close=False)
        second = await wire.read_reply(reader, expect_close=False)
        third = await wire.read_reply(reader)
    finally:
        await wire.close(writer)
    assert (first.status, first.body) == (200, b"hello from v4")
    assert second.status == 200
    assert json.loads(second.body)["path_qs"] == "/echo?n=2"
    assert (third.status, third.header("X-Egressbox-Reason"), third.closed) == (
        403,
        "no_allow_rule",
        True,
    )
    assert wire.summary(proxy.records) == [
        allowed("plain", "origin.test", port),
        allowed("plain", "127.0.0.1", port),
        ("http", "unlisted.test", forbidden.port, "deny", "no_allow_rule"),
    ]
    assert origin.accepted == 2
    assert forbidden.connections() == 0


async def test_plain_head_response_has_no_body_and_the_connection_goes_on(
    proxy: EgressProxy, origin: HttpOrigin, wire: Wire
) -> None:
    reader, writer = await wire.open(proxy.http_address)
    try:
        writer.write(get("origin.test", origin.port, "/big", method="HEAD"))
        status, headers, _ = await wire.read_head(reader)
        assert status == 200
        assert headers["content-length"] == str(len(wire.big_body))
        writer.write(get("origin.test", origin.port, "/hello"))
        after = await wire.read_reply(reader, expect_close=False)
    finally:
        await wire.close(writer)
    # Had the proxy waited for a HEAD body, the GET's reply would never come.
    assert (after.status, after.body) == (200, b"hello from v4")


async def test_plain_upstream_4xx_is_relayed_with_connection_close(
    proxy: EgressProxy, origin: HttpOrigin, wire: Wire
) -> None:
    # The proxy ends the client connection after a 4xx (DESIGN §3), so the
    # reply must say so: a client would otherwise send its next request into
    # a connection that is going away.
    reader, writer = await wire.open(proxy.http_address)
    try:
        writer.write(get("origin.test", origin.port, "/status/404"))
        reply = await wire.read_reply(reader)
    finally:
        await wire.close(writer)
    assert (reply.status, reply.body) == (404, b"status 404 from v4")
    assert reply.header("Connection") == "close"
    assert reply.closed


async def read_chunked(wire: Wire, reader: asyncio.StreamReader, limit: int) -> bytes:
    """A chunked body, up to its last chunk (bounded: at most `limit` chunks)."""
    out = bytearray()
    for _ in range(limit):
        line = await asyncio.wait_for(reader.readuntil(b"\r\n"), IO_TIMEOUT)
        size = int(line.split(b";")[0], 16)
        if size == 0:
            assert await wire.read_exactly(reader, 2) == b"\r\n"  # no trailers
            return bytes(out)
        out += await wire.read_exactly(reader, size)
        assert await wire.read_exactly(reader, 2) == b"\r\n"
    raise AssertionError("no last chunk")


async def test_plain_close_delimited_response_is_rechunked_for_http11(
    proxy: EgressProxy, origins: Origins, wire: Wire
) -> None:
    body = random.Random(5).randbytes(700_000)
    scripted = await origins.scripted(b"HTTP/1.1 200 OK\r\nContent-Type: x/y\r\n\r\n" + body)
    reader, writer = await wire.open(proxy.http_address)
    try:
        for _ in range(2):  # the client connection outlives the upstream's close
            writer.write(get("origin.test", scripted.port, "/"))
            status, headers, _ = await wire.read_head(reader)
            assert (status, headers.get("transfer-encoding")) == (200, "chunked")
            assert await read_chunked(wire, reader, len(body)) == body
    finally:
        await wire.close(writer)
    assert scripted.accepted == 2
    assert scripted.heads[0].startswith(b"GET / HTTP/1.1\r\n")


async def test_plain_close_delimited_response_to_http10_ends_with_the_close(
    proxy: EgressProxy, origins: Origins, wire: Wire
) -> None:
    body = random.Random(6).randbytes(700_000)
    scripted = await origins.scripted(b"HTTP/1.1 200 OK\r\nContent-Type: x/y\r\n\r\n" + body)
    authority = f"origin.test:{scripted.port}"
    reader, writer = await wire.open(proxy.http_address)
    try:
        writer.write(f"GET http://{authority}/ HTTP/1.0\r\nHost: {authority}\r\n\r\n".encode())
        status, headers, _ = await wire.read_head(reader)
        rest = await wire.read_to_eof(reader)
    finally:
        await wire.close(writer)
    assert status == 200
    assert "transfer-encoding" not in headers  # HTTP/1.0 has no chunked encoding
    assert rest == body


async def test_aiohttp_large_post_to_a_denied_host_still_reads_the_403(
    proxy: EgressProxy, origins: Origins, wire: Wire
) -> None:
    # No Expect: 100-continue here: the client sends its whole body after a
    # refusal it has not read yet; the proxy must drain it, not reset.
    forbidden = origins.tripwire()
    body = random.Random(9).randbytes(2 * 1024 * 1024)
    async with aiohttp.ClientSession(timeout=client_timeout()) as session:
        url = f"http://unlisted.test:{forbidden.port}/upload"
        upload = io.BytesIO(body)  # raw bytes this large warn (they block the loop)
        async with session.post(url, data=upload, proxy=proxy.http_url) as response:
            assert response.status == 403
            assert response.headers["X-Egressbox-Reason"] == "no_allow_rule"
    assert len(proxy.records) == 1
    assert forbidden.connections() == 0
