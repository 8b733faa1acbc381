"""Plain HTTP forwarding sends the host that was decided, never the client's spelling of it.

The parser admits a `Host` that names the request target under the IDNA mapping (upper
case, a trailing dot, a soft hyphen, U+00AA for `a`, a U-label for its A-label, another
spelling of an IPv6 address), since real clients send such spellings. An origin that routes
by Host must still only ever see the name the policy decided: the proxy writes `Host` from
the decision's normalized host. Judged at a Host-routing origin on loopback that records the
raw bytes of every Host it receives.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

from dnsserver import A, DnsServer
from egressbox.protocols.http1 import RequestHeadParser, forward_head, host_field
from proxy_fixtures import LOOPBACK, LOOPBACK6, StreamOrigin, ipv6_available

if TYPE_CHECKING:
    from proxy_fixtures import StartProxy, Wire

pytestmark = pytest.mark.usefixtures("dials")

IO_TIMEOUT = 10.0
POLICY: dict[str, Any] = {
    "egress": {
        "allow": ["allowed.test", "bücher.test", "127.0.0.1", "[::1]"],
        "allow_cidrs": ["127.0.0.1/32", "::1/128"],
    }
}


class HostRouter(StreamOrigin):
    """Answers every request (kept alive) with the raw Host it received as the body."""

    def __init__(self, host: str = LOOPBACK) -> None:
        super().__init__()
        self.host = host
        self.seen: list[bytes | None] = []

    async def start(self) -> HostRouter:
        self.server = await asyncio.start_server(self._accept, self.host, 0)
        return self

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(100):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
            hosts = [
                line.split(b":", 1)[1].strip(b" \t")
                for line in head.split(b"\r\n")[1:]
                if line[:5].lower() == b"host:"
            ]
            assert len(hosts) <= 1, head
            host = hosts[0] if hosts else None
            self.seen.append(host)
            body = host or b"(none)"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()


@pytest.fixture
async def router() -> Any:
    origin = await HostRouter().start()
    yield origin
    await origin.close()


def _request(target: str, host: bytes | None, version: str = "HTTP/1.1") -> bytes:
    head = f"GET {target} {version}\r\n".encode()
    if host is not None:
        head += b"Host: " + host + b"\r\n"
    return head + b"Connection: close\r\n\r\n"


# (the authority in the request target, the Host bytes the client sends); every one of
# them names allowed.test, so every one is decided as allowed.test and must arrive as it.
SPELLINGS = [
    pytest.param("allowed.test:{port}", b"allowed.te\xadst:{port}", id="soft-hyphen"),
    pytest.param("allowed.test:{port}", b"\xaallowed.test:{port}", id="ordinal-feminine-a"),
    pytest.param("allowed.test:{port}", b"ALLOWED.Test:{port}", id="upper-case"),
    pytest.param("allowed.test:{port}", b"allowed.test.:{port}", id="trailing-dot"),
    pytest.param("ALLOWED.TEST.:{port}", b"ALLOWED.TEST.:{port}", id="odd-target-same-host"),
    pytest.param("Allowed.Test:{port}", None, id="http10-no-host"),
    pytest.param("allowed.test:{port}", b"allowed.test:{port}", id="plain"),
]


@pytest.mark.parametrize(("target", "host"), SPELLINGS)
async def test_the_origin_sees_the_decided_host(
    start_proxy: StartProxy,
    zone: DnsServer,
    router: HostRouter,
    wire: Wire,
    target: str,
    host: bytes | None,
) -> None:
    zone.set("allowed.test", A(LOOPBACK))
    proxy = await start_proxy(POLICY)
    port = router.port
    url = "http://" + target.format(port=port) + "/path"
    sent = None if host is None else host.replace(b"{port}", str(port).encode())
    reply = await wire.exchange(
        proxy.http_address, _request(url, sent, "HTTP/1.0" if host is None else "HTTP/1.1")
    )
    decided = f"allowed.test:{port}".encode()
    assert reply.status == 200, reply.head
    assert router.seen == [decided]  # byte for byte, what the decision named
    assert reply.body == decided
    assert wire.summary(proxy.records) == [("http", "allowed.test", port, "allow", "allowed")]


async def test_a_u_label_host_arrives_as_its_a_label(
    start_proxy: StartProxy, zone: DnsServer, router: HostRouter, wire: Wire
) -> None:
    zone.set("xn--bcher-kva.test", A(LOOPBACK))
    proxy = await start_proxy(POLICY)
    port = router.port
    request = _request(
        f"http://xn--bcher-kva.test:{port}/", f"bücher.test:{port}".encode("latin-1")
    )
    reply = await wire.exchange(proxy.http_address, request)
    assert reply.status == 200, reply.head
    assert router.seen == [f"xn--bcher-kva.test:{port}".encode()]
    assert wire.summary(proxy.records) == [("http", "xn--bcher-kva.test", port, "allow", "allowed")]


@pytest.mark.skipif(not ipv6_available(), reason="no IPv6 loopback (::1) on this host")
async def test_an_ipv6_host_arrives_bracketed_in_canonical_text(
    start_proxy: StartProxy, wire: Wire
) -> None:
    origin = await HostRouter(LOOPBACK6).start()
    try:
        proxy = await start_proxy(POLICY)
        port = origin.port
        target = f"http://[0:0:0:0:0:0:0:1]:{port}/"
        reply = await wire.exchange(proxy.http_address, _request(target, f"[0::1]:{port}".encode()))
        assert reply.status == 200, reply.head
        assert origin.seen == [f"[::1]:{port}".encode()]
    finally:
        await origin.close()


async def test_every_request_of_a_kept_alive_connection_is_rewritten(
    start_proxy: StartProxy, zone: DnsServer, router: HostRouter, wire: Wire
) -> None:
    zone.set("allowed.test", A(LOOPBACK))
    proxy = await start_proxy(POLICY)
    port = router.port
    spellings = [b"ALLOWED.test", b"allowed.te\xadst", b"\xaallowed.test.", b"allowed.test"]
    reader, writer = await wire.open(proxy.http_address)
    try:
        for spelling in spellings:
            writer.write(
                f"GET http://allowed.test:{port}/ HTTP/1.1\r\nHost: ".encode()
                + spelling
                + f":{port}\r\n\r\n".encode()
            )
            reply = await wire.read_reply(reader, expect_close=False)
            assert reply.status == 200, reply.head
    finally:
        await wire.close(writer)
    assert router.seen == [f"allowed.test:{port}".encode()] * len(spellings)
    assert router.accepted == 1  # the same upstream connection carried them all
    assert len(proxy.records) == len(spellings)


@pytest.mark.parametrize(
    "host",
    [
        pytest.param(b"other.test:{port}", id="another-name"),
        pytest.param(b"allowed.test:1{port}", id="another-port"),
        pytest.param(b"allowed.test:0{port}", id="port-leading-zero"),
        pytest.param(b"allowed.test", id="default-port-instead"),
        pytest.param(b"allowed..test:{port}", id="not-a-host"),
        pytest.param(b"allowed.test\xff:{port}", id="unmappable-byte"),
    ],
)
async def test_a_host_naming_anything_else_is_refused_before_any_decision(
    start_proxy: StartProxy, zone: DnsServer, router: HostRouter, wire: Wire, host: bytes
) -> None:
    zone.set("allowed.test", A(LOOPBACK))
    zone.set("other.test", A(LOOPBACK))
    proxy = await start_proxy(POLICY)
    port = router.port
    sent = host.replace(b"{port}", str(port).encode())
    reply = await wire.exchange(proxy.http_address, _request(f"http://allowed.test:{port}/", sent))
    assert reply.status == 400, reply.head
    assert reply.header("X-Egressbox-Reason") == "bad_request"
    assert reply.closed
    assert router.seen == [] and router.accepted == 0
    assert proxy.records == []  # refused as malformed: nothing was decided


# -- the builder, sans-IO ---------------------------------------------------------------------


def _head(raw: bytes) -> Any:
    head = RequestHeadParser().feed(raw)
    assert head is not None
    return head


def test_host_field_brackets_ipv6_and_drops_the_default_port() -> None:
    assert host_field("example.com", 80) == "example.com"
    assert host_field("example.com", 8080) == "example.com:8080"
    assert host_field("::1", 80) == "[::1]"
    assert host_field("2001:db8::1", 8443) == "[2001:db8::1]:8443"
    assert host_field("192.0.2.1", 81) == "192.0.2.1:81"


def test_forward_head_writes_the_decided_host_first_in_every_form() -> None:
    raw = (
        b"GET ws://EXAMPLE.com./chat HTTP/1.1\r\nUser-Agent: x\r\nHost: exa\xadmple.COM\r\n"
        b"Upgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    head = _head(raw)
    out = forward_head(head)  # by default: the target's host, normalized
    assert out.startswith(b"GET /chat HTTP/1.1\r\nHost: example.com\r\nUser-Agent: x\r\n")
    assert out.count(b"Host:") == 1
    # The forwarder passes the decision's host: that is what goes out.
    assert b"\r\nHost: example.com\r\n" in forward_head(head, host="example.com")
    # A field named in Connection cannot drop Host (it never was the client's to keep).
    sneaky = _head(
        b"GET http://example.com:8080/ HTTP/1.1\r\nHost: EXAMPLE.com:8080\r\n"
        b"Connection: host\r\n\r\n"
    )
    assert forward_head(sneaky).startswith(b"GET / HTTP/1.1\r\nHost: example.com:8080\r\n")
